"""CPU emulation of torch 2.13's varlen flash ops, held to their CUDA contract.

`install()` registers CPU kernels for ``aten::_flash_attention_forward`` and
``aten::_flash_attention_backward`` in their *varlen* form (``cum_seq_q`` defined), so that
`upipe.attention.varlen` runs in the tests and fails wherever a GPU would. The contract
(read from torch 2.13: ``torch/nn/attention/varlen.py`` ``_varlen_attn``,
``_varlen_attn_fake``, ``_varlen_attn_backward``; C++ ``transformers/cuda/flash_attn/
flash_api.cpp`` ``mha_varlen_fwd`` / ``mha_varlen_bwd``):

- q ``[T_q, H, d]``, k/v ``[T_k, G, d]`` (3-D, packed), last dim contiguous, fp16/bf16, all
  one dtype; d % 8 == 0 (the op does not pad), d <= 256; G divides H.
- cum_seq_q/k: int32 ("cu_seqlens_q must have dtype int32"), contiguous, 1-D
  [sequences + 1], sequences > 0 ("batch size must be positive"). Not checked on CUDA but
  read as such: cu[0] == 0, non-decreasing, cu[-1] == T, every length <= max_q / max_k
  (the grid is sized by max_q) -- the emulation raises "unchecked on CUDA" for those.
- Causal masking per sequence, aligned bottom-right (equal lengths here: the diagonal).
- Forward returns (out like q, lse fp32 contiguous ``[H, T_q]``, rng_state uint64 [2],
  unused uint64 [], debug mask [0]); backward reads lse as contiguous fp32 ``[H, T_q]``
  (unchecked on CUDA) and returns dq like q, dk/dv like k/v with G heads (summed).
While an FA3 / FA4 impl is active the ops run that impl's contract instead
(flash_impl_emulation.py). The dense form (cum_seq_q None) is not emulated here: upipe
calls the dense kernels through ``_scaled_dot_product_flash_attention`` (cuda_emulation.py).
"""

from __future__ import annotations

import collections

import torch
from cuda_emulation import (
    _HALF,
    _backward_math,
    _check,
    _forward_math,
    _no_dropout,
    _rerouted,
    _scale,
)

_LIB: torch.library.Library | None = None
CALLS = collections.Counter()  # kernel calls in this process, by op ("forward", "backward")
_UNCHECKED = "varlen_emulation: {} (unchecked on CUDA: the kernel would read wrong memory)"


def _check_common(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p):
    _check(cum_q is not None, "varlen_emulation: the dense form is not emulated")
    _no_dropout(dropout_p)
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    _check(all(t.dim() == 3 for t in (q, k, v)), "varlen q/k/v must be [total, heads, d]")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    for name, cu in (("cu_seqlens_q", cum_q), ("cu_seqlens_k", cum_k)):
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _check(cu.is_contiguous() and cu.dim() == 1, f"{name} must be contiguous")
    n = cum_q.numel() - 1
    _check(n > 0, "batch size must be positive")
    _check(cum_k.numel() == n + 1, "cu_seqlens_k must have shape (batch_size + 1)")
    T_q, H, d = q.shape
    G = k.shape[1]
    _check(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(H % G == 0, "Number of heads in key/value must divide number of heads in query")
    cq, ck = cum_q.tolist(), cum_k.tolist()
    for cu, T, mx, name in ((cq, T_q, max_q, "q"), (ck, k.shape[0], max_k, "k")):
        lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        _check(cu[0] == 0 and cu[-1] == T, _UNCHECKED.format(f"cu_seqlens_{name} != [0..{T}]"))
        _check(min(lengths) >= 0, _UNCHECKED.format(f"cu_seqlens_{name} decreases"))
        _check(max(lengths) <= mx, _UNCHECKED.format(f"a {name} length exceeds max_{name}"))
    return list(zip(cq, cq[1:], ck, ck[1:], strict=False))


def _window_left(left, right, is_causal, max_k):
    """The window's left size as mha_varlen_fwd / mha_varlen_bwd normalise it: None or
    >= max_seqlen_k is -1 (unlimited); a right size must be unlimited or 0 with is_causal
    (the only form upipe passes; the kernel sets right = 0 when causal)."""
    right = -1 if right is None or right >= max_k else right
    _check(
        right == -1 or (is_causal and right == 0),
        "varlen_emulation: only causal windows (right 0) are emulated",
    )
    return -1 if left is None or left >= max_k else left


def _seq(t_Tnd, a, b):
    return t_Tnd[a:b].transpose(0, 1).unsqueeze(0)  # [1, heads, len, d]


def _forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    if rerouted := _rerouted("varlen_forward"):  # an active FA3/FA4 impl serves the op
        return rerouted(
            query,
            key,
            value,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            return_debug_mask,
            scale=scale,
            seqused_k=seqused_k,
            alibi_slopes=alibi_slopes,
            block_table=block_table,
        )
    spans = _check_common(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
    CALLS["forward"] += 1
    _check(
        all(x is None for x in (seqused_k, alibi_slopes, block_table)),
        "varlen_emulation: seqused_k, alibi_slopes and block_table are not emulated",
    )
    T, H, d = query.shape
    out = torch.empty_like(query)
    lse_HT = torch.empty(H, T, dtype=torch.float32)
    s = _scale(scale, d)
    left = _window_left(window_size_left, window_size_right, is_causal, max_k)
    for qa, qb, ka, kb in spans:
        o, lse = _forward_math(
            _seq(query, qa, qb), _seq(key, ka, kb), _seq(value, ka, kb), s, is_causal, True, left
        )
        out[qa:qb] = o[0].transpose(0, 1).to(query.dtype)
        lse_HT[:, qa:qb] = lse[0]
    rng_state = torch.zeros(2, dtype=torch.uint64)
    return out, lse_HT, rng_state, torch.zeros((), dtype=torch.uint64), torch.empty(0)


def _backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    if rerouted := _rerouted("varlen_backward"):
        return rerouted(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            rng_state,
            unused,
            scale=scale,
        )
    spans = _check_common(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
    CALLS["backward"] += 1
    T, H, d = query.shape
    for t in (grad_out, out):
        _check(t.shape == query.shape and t.dtype == query.dtype, "dout/out must be like q")
        _check(t.stride(-1) == 1, "out/dout must have contiguous last dimension")
    _check(
        logsumexp.dtype == torch.float32
        and tuple(logsumexp.shape) == (H, T)
        and logsumexp.is_contiguous(),
        _UNCHECKED.format("lse is read as contiguous fp32 [num_heads, total_q]"),
    )
    dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
    s = _scale(scale, d)
    left = _window_left(window_size_left, window_size_right, is_causal, max_k)
    for qa, qb, ka, kb in spans:
        grads = _backward_math(
            _seq(grad_out, qa, qb),
            _seq(query, qa, qb),
            _seq(key, ka, kb),
            _seq(value, ka, kb),
            _seq(out, qa, qb),
            logsumexp[None, :, qa:qb],
            s,
            is_causal,
            True,
            left,
        )
        for acc, g, (a, b) in zip((dq, dk, dv), grads, ((qa, qb), (ka, kb), (ka, kb)), strict=True):
            acc[a:b] = g[0].transpose(0, 1).to(acc.dtype)
    return dq, dk, dv


def install() -> None:
    """Register the CPU emulations in this process; safe to call any number of times."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in (
        ("_flash_attention_forward", _forward),
        ("_flash_attention_backward", _backward),
    ):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            lib.impl(name, kernel, "CPU")
    _LIB = lib
