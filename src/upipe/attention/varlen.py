"""Document-masked attention over a whole sequence in one CUDA kernel call (varlen flash).

Legend: B batch, P tokens (the whole sequence, in order), u query heads, k kv heads, d head
dim, T = B * P packed tokens, n documents per row.

`documents.local_forward` / `local_backward` call these for the kernels with a varlen call
(`VARLEN`: flash, fa3, fa4; fp16/bf16) instead of one dense kernel per document: the B rows
of n documents are packed as T tokens, `[B, P, u, d] -> [T, u, d]` (a view), with
cumulative boundaries
    cu[b * n + j] = b * P + e_j,   cu[B * n] = T        (int32, on the GPU)
and one call of torch's varlen flash kernel runs them all.

The contract, from torch 2.13's sources (`torch/nn/attention/varlen.py`, `_varlen_attn`,
`_varlen_attn_fake` and `_varlen_attn_backward`, which call these ops the same way; the C++
side is `aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp` `mha_varlen_fwd` /
`mha_varlen_bwd`):
- `aten._flash_attention_forward(q [T, u, d], k [T, k, d], v, cum_seq_q, cum_seq_k, max_q,
  max_k, dropout_p, is_causal, return_debug_mask, *, scale)`: a *defined* cum_seq_q selects
  the varlen kernel; cu int32 [sequences + 1] on the device; max_q/max_k host ints (the
  longest sequence; grid sizes); fp16/bf16; d % 8 == 0 (no padding inside: we pad, as in
  `upipe.kernels`), d <= 256; k divides u (GQA native). Returns (out like q, lse fp32
  **[u, T]**, rng_state, unused, debug mask).
- `aten._flash_attention_backward(dout, q, k, v, out, lse [u, T], cum_seq_q, cum_seq_k,
  max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale)` -> (dq, dk, dv), dk/dv
  with k heads (the query heads sharing one summed). rng_state / unused are read only with
  dropout; torch passes uint64 zeros [2] and an empty tensor.
`tests/helpers/varlen_emulation.py` implements that contract on CPU for the tests.

Under fa3 / fa4 the same two ops run FlashAttention-3 / -4: torch's impls register them
too (torch/nn/attention/_fa3.py and _fa4.py `_fa*_register_kernels`: "ragged query must be
3D", cu_seq_q/k passed on as cu_seqlens_q/k, max_q/max_k as max_seqlen_q/k), with the same
lse layout `[u, T]` (FA3's varlen softmax_lse; FA4's `lse_shape = (num_head, total_q)` in
flash_attn/cute/interface.py `_flash_attn_fwd`) and int32 boundaries. Every torch version
read (2.13's registry, and the earlier FA4 prototype) reroutes the varlen ops, so no
package-level varlen call is needed; `tests/helpers/flash_impl_emulation.py` holds both impls'
contracts on CPU. cuDNN's varlen form (`_cudnn_attention_forward` with cum_seq) is not
used: torch's own `varlen_attn` keeps it off (`_should_use_cudnn` returns False; "GQA is
not supported with the cuDNN backend").

Host syncs: none. The boundaries are host ints already (validated once per call); the
cumulative tensor is copied to the GPU from pinned memory without blocking, and max_q is
computed on the host.
"""

from __future__ import annotations

import itertools

import torch

from upipe.kernels import _scale
from upipe.kernels_cuda import pad8 as _pad8
from upipe.kernels_cuda import unpad as _unpad
from upipe.torch_private import aten_op

VARLEN = ("flash", "fa3", "fa4")  # resolved kernels (fp16/bf16 only) with a varlen call
# ... and those whose window this code passes (torch 2.13's FA3 / FA4 registrations pass
# window sizes on too, but their contracts with windows are not emulated in the tests yet:
# under fa3 / fa4 a sliding window runs in tiles, `upipe.attention.window`)
WINDOWED = ("flash",)


def use_varlen(kernel: str, window=None) -> bool:
    """Whether a resolved kernel (`upipe.kernels.prepare_kernel`) has the varlen call (with
    a sliding `window`: the varlen call with its native window)."""
    return kernel in VARLEN and (window is None or kernel in WINDOWED)


def _cum_seq(bounds, B, P, device):
    """cu (int32 [B * n + 1]) for B rows of P tokens with documents `bounds`, and max len."""
    cu = [b * P + e for b in range(B) for e in bounds[:-1]] + [B * P]
    host = torch.tensor(cu, dtype=torch.int32)
    if device.type == "cuda":  # pinned: the copy is asynchronous, the host does not wait
        host = host.pin_memory()
    return host.to(device, non_blocking=True), max(b - a for a, b in itertools.pairwise(bounds))


def _packed(t_BPnd):
    return t_BPnd.reshape(-1, *t_BPnd.shape[2:])


def _window(window) -> dict:
    """The op's window arguments for a causal sliding window of `window` tokens (None:
    unlimited): token i sees keys i-window+1 .. i = window_size_left window-1, right 0."""
    if window is None:
        return {}
    return {"window_size_left": window - 1, "window_size_right": 0}


def forward(q_BPud, k_BPkd, v_BPkd, bounds, *, causal, softmax_scale, window=None):
    """(out_BPud, lse_BuP) of document-masked attention: one varlen kernel call (`window`:
    a causal sliding window inside each document, `upipe.attention.window`)."""
    B, P, u, d = q_BPud.shape
    cu, longest = _cum_seq(bounds, B, P, q_BPud.device)
    qp, kp, vp = (_packed(t) for t in _pad8(q_BPud, k_BPkd, v_BPkd))
    out_Tud, lse_uT, *_ = aten_op("_flash_attention_forward")(
        qp,
        kp,
        vp,
        cu,
        cu,
        longest,
        longest,
        0.0,
        causal,
        False,
        scale=_scale(softmax_scale, d),
        **_window(window),
    )
    (out_BPud,) = _unpad(d, out_Tud.view(B, P, u, -1))
    return out_BPud, lse_uT.view(u, B, P).transpose(0, 1)


def backward(dout, q, k, v, out, lse_BuP, bounds, *, causal, softmax_scale, window=None):
    """(dq, dk, dv) of `forward` from its saved out and lse: one varlen kernel call."""
    B, P, u, d = q.shape
    cu, longest = _cum_seq(bounds, B, P, q.device)
    dop, qp, kp, vp, op = (_packed(t) for t in _pad8(dout, q, k, v, out))
    lse_uT = lse_BuP.transpose(0, 1).reshape(u, B * P)  # the forward's [u, T] (a view)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = aten_op("_flash_attention_backward")(
        dop,
        qp,
        kp,
        vp,
        op,
        lse_uT,
        cu,
        cu,
        longest,
        longest,
        0.0,
        causal,
        rng_state,
        unused,
        scale=_scale(softmax_scale, d),
        **_window(window),
    )
    shapes = ((B, P, u, -1), (B, P, k.shape[2], -1), (B, P, v.shape[2], -1))
    return _unpad(d, *(g.view(s) for g, s in zip((dq, dk, dv), shapes, strict=True)))
