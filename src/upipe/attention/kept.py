"""Attention outputs handed from a checkpointed forward to its recomputation.

An activation checkpoint (`upipe.model.features.activation_checkpoint`) runs its functions
twice: once without a graph in forward, and again with one in backward, to rebuild the
graph. Every attention op of upipe keeps for its own backward what its kernel made -- the
output and the log-sum-exp (lse); the rest it has (its inputs) or recomputes -- so a
recomputation that calls the kernel again only makes the same bits a second time. With
`attention_outputs="keep"` (or "offload") the checkpoint hands the forward's over instead:

- in forward, function j of the checkpoint runs inside `KeptOutputs.recording(j)`: each
  attention op it calls `claim`s a `Call`, computes as usual and `Call.keep`s what its
  backward needs;
- in backward, function j's recomputation runs inside `KeptOutputs.replaying(j, take=True)`:
  the same call gets those tensors back (`Call.reused`), skips its kernel and everything
  that only feeds the kernel, and saves them for its backward as if it had made them. The
  entry is then gone from the store: the op's backward is its one consumer, and frees it.
  A segment's backward first recomputes the inputs of its inner functions without a graph
  (`replaying(j, take=False)`): those calls read the same entries and leave them for the
  recomputation with grad that follows.

What an op keeps (B batch, L local tokens, H query heads, d head dim, C group size):
- the fused UPipe op (fused.py): every stage's output slice `[B, L, U, d]` in the sequence
  layout and its lse `[B, u, S]`; its recomputation runs only y = sum_s out_s W_o[:, s]^T
  (no projections, no all-to-all, no kernel);
- Ulysses and USP (ulysses.py): out `[B, S, h, d]` in the head layout and lse `[B, h, S]`;
  the recomputation still exchanges q, k, v (its backward needs them in the head layout)
  and the output back, but runs no kernel (USP: no ring);
- functional UPipe (upipe.py): out `[B, L, H, d]` and each stage's lse (no exchange, no
  kernel); ring (ring.py): out `[B, L, H, d]` and lse `[B, H, L]` (no ring pass).
Per attention layer and rank that is one `[B, L, H*d]` tensor in the compute dtype plus an
fp32 lse of B * L * H elements (with heads split unevenly, H counts as C * h_r, h_r this
rank's query heads):

    bytes per layer = B * L * H * d * element_size + 4 * B * L * H

held from the layer's forward to its backward, on the device ("keep") or in host memory
beside the checkpoint's input ("offload": `upipe.model.offload.Offloader.save_outputs`).

Keys. The n-th attention call made while function j runs is call (j, n), in the forward and
in every recomputation alike, so the functions must make their attention calls in the same
order with the same inputs in both (as recomputation itself requires). Each call records
its op and input shapes; a recomputation whose call differs raises instead of reusing the
wrong tensors. A kept tensor changed in place before its function returned (an autograd
error for any saved tensor) raises too (the version counters are compared then).

The active pass lives in a `ContextVar` of the thread that runs the function: the autograd
engine runs a checkpoint's backward, hence its recomputation, in a thread of its own on
CUDA, and sets the pass there. Only the outermost checkpoint keeps: a checkpoint met while
another one's pass is active (a checkpoint nested in a recomputed function) leaves its
attention calls to that pass, which saw the same calls in its forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Callable

import torch

_PASS: contextvars.ContextVar[_Pass | None] = contextvars.ContextVar("upipe_kept", default=None)


@dataclasses.dataclass
class Call:
    """One attention op call inside a checkpoint's pass. Recomputing, `reused()` hands over
    the forward's tensors (the op then skips its kernel); in the forward it is None and the
    op computes, then hands what its backward needs to `keep`."""

    _kept: list[torch.Tensor] | None
    _keep: Callable[[list[torch.Tensor]], None] | None = None

    def reused(self) -> list[torch.Tensor] | None:
        """The forward's tensors, once (this call then holds no reference: the op's backward
        is what frees them), or None in the forward."""
        tensors, self._kept = self._kept, None
        return tensors

    def keep(self, tensors) -> None:
        if self._keep is None:
            raise RuntimeError("this attention call is a recomputation: it has its tensors")
        self._keep(list(tensors))
        self._keep = None


@dataclasses.dataclass
class _Entry:
    signature: tuple
    ordinal: int
    """the call's position in the checkpoint's forward (its host arena, with offload)"""
    tensors: list[torch.Tensor] | None
    """on the device; None when kept on the host"""
    versions: list[tuple[weakref.ref, int]]


class KeptOutputs:
    """The attention outputs of one checkpoint call (a function or a segment of them), by
    attention call (module doc).

    `host`: None keeps them where the ops made them; else an object with `save(ordinal,
    tensors)` and `load(ordinal) -> tensors` that keeps them elsewhere (the offloader's host
    arena), `ordinal` numbering the calls of the checkpoint's forward from 0."""

    def __init__(self, host=None):
        self.host = host
        self._entries: dict[tuple[int, int], _Entry] = {}

    @contextlib.contextmanager
    def recording(self, j: int):
        """Function j's forward: its attention calls keep their outputs here."""
        with _active(_Pass(self, j, record=True)):
            yield
        for (fn, _), entry in self._entries.items():
            if fn == j:
                _check_versions(entry, j)

    @contextlib.contextmanager
    def replaying(self, j: int, *, take: bool):
        """A recomputation of function j: its attention calls get the forward's outputs;
        `take` (the recomputation whose backward runs next) removes them from the store."""
        with _active(_Pass(self, j, record=False, take=take)):
            yield
        if take:
            left = sorted(n for fn, n in self._entries if fn == j)
            if left:
                raise RuntimeError(
                    f"the recomputation of checkpointed function {j} made fewer attention "
                    f"calls than its forward (calls {left} were not made again); a checkpointed "
                    "function must make the same attention calls each time it runs"
                )

    def release(self) -> None:
        self._entries.clear()

    def _record(self, key, signature, tensors) -> None:
        entry = _Entry(signature, len(self._entries), None, [])
        entry.versions = [(weakref.ref(t), t._version) for t in tensors]
        if self.host is None:
            entry.tensors = tensors
        else:
            self.host.save(entry.ordinal, tensors)
        self._entries[key] = entry

    def _replay(self, key, signature, take: bool) -> list[torch.Tensor]:
        j, n = key
        entry = self._entries.get(key)
        if entry is None or entry.signature != signature:
            made = "no such call" if entry is None else f"{entry.signature}"
            raise RuntimeError(
                f"the recomputation of checkpointed function {j} made attention call {n} as "
                f"{signature}, its forward made {made}; a checkpointed function must make the "
                "same attention calls each time it runs (use attention_outputs='recompute' "
                "for one that does not)"
            )
        if take:
            del self._entries[key]
        if entry.tensors is not None:
            return list(entry.tensors)
        return self.host.load(entry.ordinal)


def _check_versions(entry: _Entry, j: int) -> None:
    for ref, version in entry.versions:
        t = ref()
        if t is not None and t._version != version:
            raise RuntimeError(
                f"an attention output kept for the recomputation of checkpointed function {j} "
                "was modified in place after the op returned it; the recomputation would not "
                "see the forward's values (use attention_outputs='recompute', or do not write "
                "into the attention output)"
            )
    entry.versions = []


@dataclasses.dataclass
class _Pass:
    """The pass a function of a checkpoint is in: recording its forward, or replaying it."""

    owner: KeptOutputs
    fn: int
    record: bool
    take: bool = False
    calls: int = 0

    def claim(self, signature) -> Call:
        key = (self.fn, self.calls)
        self.calls += 1
        if self.record:
            return Call(None, lambda tensors: self.owner._record(key, signature, tensors))
        return Call(self.owner._replay(key, signature, self.take))


@contextlib.contextmanager
def _active(p: _Pass):
    token = _PASS.set(p)
    try:
        yield
    finally:
        _PASS.reset(token)


def active() -> bool:
    """Whether a checkpoint's pass is running in this thread (a checkpoint met now leaves its
    attention calls to it: module doc)."""
    return _PASS.get() is not None


def claim(what: str, *inputs) -> Call | None:
    """The `Call` of the attention op `what` on `inputs` (its tensors: their shapes and dtype
    make the call's signature), or None outside a checkpoint's pass (compute as always).
    Call it once per op call, after validation, on every rank alike."""
    p = _PASS.get()
    if p is None:
        return None
    sig = (what, *((tuple(t.shape), str(t.dtype)) for t in inputs if t is not None))
    return p.claim(sig)
