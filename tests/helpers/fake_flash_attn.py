"""A stand-in for the flash-attn package (2.7 API), to run upipe's `backend="flash_attn"`
path on CPU. It keeps the package's contract where upipe depends on it:

- `flash_attn.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
  return_attn_probs=False)`: q `[B, S, H, d]`, k/v `[B, S, G, d]` (G divides H), fp16/bf16;
  returns (out, softmax_lse fp32 `[B, H, S]`, S_dmask) with return_attn_probs (the package's
  `FlashAttnFunc` pads d to a multiple of 8 itself, flash_attn_interface.py).
- `flash_attn.flash_attn_interface._flash_attn_backward(dout, q, k, v, out, softmax_lse,
  dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
  softcap, alibi_slopes, deterministic, rng_state=None)`: the >= 2.7 argument names (2.6
  had `window_size`, no `window_size_left/right`), writes dq/dk/dv in place; the kernel
  (csrc/flash_attn/flash_api.cpp `mha_bwd`) needs d % 8 == 0 ("head_size should be a
  multiple of 8") -- the padding is the caller's job here.
Numbers come from torch's CPU flash kernel (same math).
"""

from __future__ import annotations

import sys
import types

import torch

_HALF = (torch.float16, torch.bfloat16)


def _check(*ts):
    for t in ts:
        if t.dtype not in _HALF:
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        if t.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    if ts[1].shape[2] == 0 or ts[0].shape[2] % ts[1].shape[2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    _check(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p,
        causal,
        scale=softmax_scale,
    )
    out = out.transpose(1, 2).contiguous()
    return (out, lse.contiguous(), None) if return_attn_probs else out


def _flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    _check(q, k, v, dout, out)
    if q.shape[-1] % 8:
        raise RuntimeError("head_size should be a multiple of 8")
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)),
        softmax_lse,
        dropout_p,
        causal,
        scale=softmax_scale,
    )
    for buf, g in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(g.transpose(1, 2))
    return softmax_lse


def install(monkeypatch) -> None:
    """Make `import flash_attn` find this stand-in for the test's duration."""
    package = types.ModuleType("flash_attn")
    package.flash_attn_func = flash_attn_func
    package.__version__ = "2.7.4"
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_backward = _flash_attn_backward
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
