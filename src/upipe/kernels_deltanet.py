"""Local kernels of the Gated DeltaNet layer (Qwen3-Next, Qwen3.5): the causal depthwise
convolution and the chunked gated delta rule, on one rank's heads over the whole sequence.

Legend: B batch, S sequence, c channels, K conv kernel taps, G key heads, H value heads
(value head i reads key head i // (H / G)), d key head dim, e value head dim.

The gated delta rule, per value head, with q_t, k_t l2-normalised and a state M [d, e]:

    M_t = exp(g_t) M_{t-1} + beta_t k_t (v_t - exp(g_t) M_{t-1}^T k_t)^T
    o_t = M_t^T q_t / sqrt(d)

g_t <= 0 (log of the decay, fp32) and beta_t in (0, 1) come from the layer's gates; M_0 = 0.
The chunked form (chunks of 64 tokens, a triangular solve inside each, a scan across them)
computes the same. Both kernels here are independent per head and per channel, so a rank
holding some heads for the whole sequence computes exactly its share of the layer.

Documents (packed sequences, boundaries `docs = (0, e_1, ..., S)` of the full sequence, the
same for every row): the state and the convolution restart at each document start, as if
each document were its own sequence -- what the unconverted model computes when fed one
document at a time (transformers itself refuses packed input to this layer without `fla`).

Backends of the scan (`SCAN_BACKENDS`):
- "upipe": upipe's own chunked rule with a backward of its own (`upipe.kernels_delta_rule`:
  the same operations as transformers' torch implementation in forward; its forward saves
  only its inputs and its backward recomputes the chunk states, as fla's does), called
  once per document.
- "torch": the model's own torch implementation (transformers'
  `torch_chunk_gated_delta_rule`, passed in as `reference`: upipe does not import
  transformers), called once per document, differentiated by autograd.
- "fla": flash-linear-attention's Triton kernel `fla.ops.gated_delta_rule.chunk_gated_delta_rule`
  (CUDA), one call for all documents. Its contract, read from fla/ops/gated_delta_rule/chunk.py
  (fla-org/flash-linear-attention, commit 92396f2): q, k, v `[B, T, h, d|e]` with the same
  head count h; g, beta `[B, T, h]`; scale None means d ** -0.5; `use_qk_l2norm_in_kernel`;
  `cu_seqlens` (int64, on the device, `[N + 1]`) only with B = 1 -- so the rows are
  flattened into one sequence of B * S tokens whose documents are every row's; returns
  (o `[B, T, h, e]` in q's dtype, final state). q and k are repeated to the value heads
  first (as fla's own GatedDeltaNet layer does). tests/distributed/test_deltanet.py runs this
  path on the CPU against a stand-in with that contract.
"auto" (None): "fla" for CUDA inputs when the package is installed, else "upipe".

The convolution is torch's depthwise `conv1d` (as transformers' `causal_conv1d_fn` fallback),
once per document: each document's first K - 1 outputs see zeros before it.
"""

from __future__ import annotations

import importlib.util
import itertools

import torch
import torch.nn.functional as F

from upipe import loops
from upipe.kernels_delta_rule import delta_rule

SCAN_BACKENDS = ("upipe", "torch", "fla")


def fla_available() -> bool:
    """Whether flash-linear-attention is importable here."""
    return importlib.util.find_spec("fla") is not None


def fla_chunk_gated_delta_rule():
    """fla's `chunk_gated_delta_rule` (imported on first use; the planner's simulation puts
    the memory of its kernels in its place: `upipe.planner.deltanet`)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def resolve_scan_backend(backend, device) -> str:
    """The scan backend to run: `backend`, or for None "fla" on CUDA when installed, else
    "upipe". ValueError for an unknown name or "fla" where it is not installed."""
    if backend is None:
        return "fla" if device.type == "cuda" and fla_available() else "upipe"
    if backend not in SCAN_BACKENDS:
        raise ValueError(f"unknown scan backend {backend!r}; choose one of {SCAN_BACKENDS}")
    if backend == "fla" and not fla_available():
        raise ValueError(
            "scan backend 'fla' needs flash-linear-attention (pip install "
            "flash-linear-attention); use backend='upipe' or None"
        )
    return backend


def _pieces(docs, S):
    """(start, end) of each document, or of the whole sequence without documents."""
    return [(0, S)] if docs is None else list(itertools.pairwise(docs))


def causal_conv(x_BSc, w_cK, docs=None):
    """SiLU(causal depthwise conv) of x `[B, S, c]` with taps w `[c, K]` (no bias), the
    sequence restarting at each document of `docs`: `[B, S, c]`, in x's dtype."""
    S, c, K = x_BSc.shape[1], w_cK.shape[0], w_cK.shape[1]
    x_BcS = x_BSc.transpose(1, 2).to(w_cK.dtype)
    w_c1K = w_cK.unsqueeze(1)
    parts = [
        F.conv1d(x_BcS[..., a:b], w_c1K, padding=K - 1, groups=c)[..., : b - a]
        for a, b in _pieces(docs, S)
    ]
    out_BcS = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return F.silu(out_BcS).transpose(1, 2).to(x_BSc.dtype)


class Scan:
    """The chunked gated delta rule of one call: `backend` (resolved) and the torch
    `reference` implementation; `docs` the document boundaries or None. Builds fla's
    device `cu_seqlens` once per call (one host-to-device copy), reused by every stage."""

    def __init__(self, backend: str, reference, docs=None):
        self.backend, self.reference, self.docs = backend, reference, docs
        self._cu = {}

    def __call__(self, q_BSgd, k_BSgd, v_BShe, g_BSh, beta_BSh, *, for_backward=False):
        """o `[B, S, h, e]` (v's dtype) for h value heads over g key heads (value head i
        reads key head i // (h / g)); g fp32, beta in v's dtype. `for_backward`: a
        recomputation whose backward follows at once (the "upipe" scan then keeps what its
        backward needs instead of recomputing it; the others ignore it)."""
        if self.backend == "fla":
            return self._fla(q_BSgd, k_BSgd, v_BShe, g_BSh, beta_BSh)
        S = q_BSgd.shape[1]
        outs = []
        for a, b in _pieces(self.docs, S):
            q, k, v, g, beta = (t[:, a:b] for t in (q_BSgd, k_BSgd, v_BShe, g_BSh, beta_BSh))
            if self.backend == "upipe":
                outs.append(delta_rule(q, k, v, g, beta, for_backward=for_backward))
            else:
                outs.append(loops.chunk_scan(
                    self.reference, q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True
                )[0])  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _fla(self, q_BSgd, k_BSgd, v_BShe, g_BSh, beta_BSh):
        chunk_gated_delta_rule = fla_chunk_gated_delta_rule()
        B, S, h = v_BShe.shape[:3]
        rep = h // q_BSgd.shape[2]
        q, k = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (q_BSgd, k_BSgd))
        tensors = (q, k, v_BShe, g_BSh, beta_BSh)
        if self.docs is None and B == 1:
            o, _ = chunk_gated_delta_rule(*tensors, use_qk_l2norm_in_kernel=True)
            return o
        flat = [t.reshape(1, B * S, *t.shape[2:]) for t in tensors]
        o, _ = chunk_gated_delta_rule(
            *flat, use_qk_l2norm_in_kernel=True, cu_seqlens=self._cu_seqlens(B, S, q.device)
        )
        return o.view(B, S, *o.shape[2:])

    def _cu_seqlens(self, B, S, device):
        """Every row's documents as boundaries of the B * S flattened tokens (int64, on the
        device; made once per call)."""
        key = (B, S, device)
        if key not in self._cu:
            docs = self.docs or (0, S)
            bounds = [r * S + e for r in range(B) for e in docs[:-1]] + [B * S]
            host = torch.tensor(bounds, dtype=torch.int64)
            if device.type == "cuda":  # page-locked: the copy does not wait for the stream
                host = host.pin_memory()
            self._cu[key] = host.to(device, non_blocking=True)
        return self._cu[key]
