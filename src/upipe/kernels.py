"""Local (single-device) attention that returns its log-sum-exp, and its backward.

Every strategy calls these two functions on the tensors it holds after communication:

    attention_forward(q, k, v, *, causal, softmax_scale) -> (out, lse)
    attention_backward(dout, q, k, v, out, lse, *, causal, softmax_scale) -> (dq, dk, dv)

Legend: B batch, S sequence (queries and keys have the same length), H query heads,
G kv heads (G divides H; query head h uses kv head h // (H / G)), d head dim.
Layout: q `[B, S, H, d]`, k/v `[B, S, G, d]`, out like q, lse `[B, H, S]` (fp32; fp64 for
fp64 inputs) with
lse[b, h, i] = log sum_j exp(scale * q_i . k_j) over the keys query i may see.

The backward reuses the saved `out` and `lse` (no forward recompute):
    P = exp(scale * Q K^T - lse),  dV = P^T dO,  dP = dO V^T,
    delta = rowsum(dO * O),  dS = P * (dP - delta),  dQ = scale * dS K,  dK = scale * dS^T Q
with dK/dV of a kv head summed over the H / G query heads that share it.

Backends (chosen by argument; `None` picks by device and dtype, `resolve_backend`):
- "cpu":        aten `_scaled_dot_product_flash_attention_for_cpu` (+ backward); GQA native.
- "cuda":       aten `_scaled_dot_product_flash_attention` (fp16/bf16; GQA native) or
                `_scaled_dot_product_efficient_attention` (fp32; K/V expanded for GQA, as
                that kernel needs equal head counts).
- "flash_attn": the `flash_attn` package (>= 2.7) when installed; fp16/bf16; GQA native.
- "reference":  float64 math on the full S x S score matrix; for tests and tiny shapes only.
The CUDA calls follow the ops' contracts in torch 2.13's sources (attention.cu,
attention_backward.cu, flash_api.cpp); `tests/cuda_emulation.py` implements those
contracts on CPU so that the "cuda" path runs in the test suite.

Causal masking is aligned at the diagonal and needs equal query and key lengths (every row
then sees at least one key, so no fully masked row -- whose lse would be 0, not -inf --
can occur). Strategies that need off-diagonal blocks call the kernel non-causally.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re

import torch

BACKENDS = ("cpu", "cuda", "flash_attn", "reference")
HALF = (torch.float16, torch.bfloat16)
FLASH_ATTN_MIN_VERSION = (2, 7)  # the `_flash_attn_backward` keyword arguments used below


@functools.cache
def flash_attn_version() -> tuple[int, ...] | None:
    """The installed flash-attn package's (major, minor), or None when it is not installed."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from importlib.metadata import version

    return tuple(int(p) for p in re.findall(r"\d+", version("flash_attn"))[:2])


def default_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The backend used for `device` (and `dtype`) when none is given: on CUDA the flash-attn
    package for fp16/bf16 when a supported version is installed, else torch's kernels."""
    if device.type == "cuda":
        fa = flash_attn_version()
        if dtype in HALF and fa is not None and fa >= FLASH_ATTN_MIN_VERSION:
            return "flash_attn"
        return "cuda"
    if device.type == "cpu":
        return "cpu"
    raise ValueError(
        f"no attention kernel for device type {device.type!r}; use a cpu or cuda tensor, "
        "or backend='reference'"
    )


def resolve_backend(backend: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """`backend`, or the default for the device and dtype when None."""
    return backend or default_backend(device, dtype)


def uses_cuda_kernels(backend: str) -> bool:
    """Whether a resolved backend runs CUDA's kernels (and so CUDA's GEMMs, `upipe.gemm`)."""
    return backend in ("cuda", "flash_attn")


def _check(q, k, v, causal, backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, heads, d], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    B, S, H, d = q.shape
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if H % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide query heads ({H})")
    if causal and k.shape[1] != S:
        raise ValueError(
            f"causal attention needs equal query ({S}) and key ({k.shape[1]}) lengths; "
            "split off-diagonal blocks and call them with causal=False"
        )
    if backend == "flash_attn":
        fa = flash_attn_version()
        if fa is None or fa < FLASH_ATTN_MIN_VERSION:
            found = "not installed" if fa is None else "version " + ".".join(map(str, fa))
            raise ValueError(
                f"backend='flash_attn' needs the flash-attn package >= "
                f"{'.'.join(map(str, FLASH_ATTN_MIN_VERSION))} ({found}); install it "
                "(pip install flash-attn) or use backend='cuda'"
            )
    if backend in ("flash_attn", "cuda") and q.dtype in HALF and d > 256:
        raise ValueError(f"the flash kernels support head dims up to 256, got {d}")
    if backend == "flash_attn" and q.dtype not in HALF:
        raise ValueError(
            f"backend='flash_attn' takes fp16/bf16 inputs, got {q.dtype}; use backend='cuda' "
            "(torch's memory-efficient kernel) for fp32"
        )


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for lse and for sums of partial results: fp32, or the input's when wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _scale(softmax_scale, d):
    return 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale


def _expand_kv(t_BSGd, H):
    """Repeat each kv head for its H / G query heads: [B, S, G, d] -> [B, S, H, d]."""
    g = H // t_BSGd.shape[2]
    return t_BSGd if g == 1 else t_BSGd.repeat_interleave(g, dim=2)


def _sum_kv(t_BSHd, G):
    """Inverse of `_expand_kv` for gradients: sum each kv head's H / G copies."""
    B, S, H, d = t_BSHd.shape
    return t_BSHd if H == G else t_BSHd.view(B, S, G, H // G, d).sum(3)


def attention_forward(q, k, v, *, causal=True, softmax_scale=None, backend=None):
    """Attention of q `[B, S, H, d]` over k/v `[B, Sk, G, d]`.

    Returns (out `[B, S, H, d]` in q's dtype, lse fp32 `[B, H, S]`).
    """
    backend = resolve_backend(backend, q.device, q.dtype)
    _check(q, k, v, causal, backend)
    scale = _scale(softmax_scale, q.shape[-1])
    if backend == "cpu":
        out_BHSd, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
        )
        return out_BHSd.transpose(1, 2), lse_BHS
    if backend == "flash_attn":
        return _flash_attn_forward(q, k, v, causal, scale)
    if backend == "cuda":
        return _cuda_forward(q, k, v, causal, scale)
    return _reference_forward(q, k, v, causal, scale)


def attention_backward(dout, q, k, v, out, lse, *, causal=True, softmax_scale=None, backend=None):
    """Gradients (dq, dk, dv) of `attention_forward`, from its saved `out` and `lse`."""
    backend = resolve_backend(backend, q.device, q.dtype)
    _check(q, k, v, causal, backend)
    scale = _scale(softmax_scale, q.shape[-1])
    if backend == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse,
            0.0,
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if backend == "flash_attn":
        return _flash_attn_backward(dout, q, k, v, out, lse, causal, scale)
    if backend == "cuda":
        return _cuda_backward(dout, q, k, v, out, lse, causal, scale)
    return _reference_backward(dout, q, k, v, out, lse, causal, scale)


# --- float64 reference ------------------------------------------------------------------


def _reference_scores(q, k, causal, scale):
    """Scaled scores [B, H, S, Sk] in fp64 with -inf above the diagonal when causal."""
    H = q.shape[2]
    s_BHSS = torch.einsum("bshd,bthd->bhst", q.double(), _expand_kv(k, H).double()) * scale
    if causal:
        S = q.shape[1]
        mask = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        s_BHSS = s_BHSS.masked_fill(mask, float("-inf"))
    return s_BHSS


def _reference_forward(q, k, v, causal, scale):
    s_BHSS = _reference_scores(q, k, causal, scale)
    lse_BHS = torch.logsumexp(s_BHSS, dim=-1)
    p_BHSS = torch.exp(s_BHSS - lse_BHS[..., None])
    out = torch.einsum("bhst,bthd->bshd", p_BHSS, _expand_kv(v, q.shape[2]).double())
    return out.to(q.dtype), lse_BHS.to(acc_dtype(q.dtype))


def _reference_backward(dout, q, k, v, out, lse, causal, scale):
    H, G = q.shape[2], k.shape[2]
    s_BHSS = _reference_scores(q, k, causal, scale)
    p_BHSS = torch.exp(s_BHSS - lse.double()[..., None])
    do, vv, kk = dout.double(), _expand_kv(v, H).double(), _expand_kv(k, H).double()
    dv = torch.einsum("bhst,bshd->bthd", p_BHSS, do)
    dp_BHSS = torch.einsum("bshd,bthd->bhst", do, vv)
    delta_BHS = (do * out.double()).sum(-1).transpose(1, 2)
    ds_BHSS = p_BHSS * (dp_BHSS - delta_BHS[..., None])
    dq = torch.einsum("bhst,bthd->bshd", ds_BHSS, kk) * scale
    dk = torch.einsum("bhst,bshd->bthd", ds_BHSS, q.double()) * scale
    return dq.to(q.dtype), _sum_kv(dk, G).to(k.dtype), _sum_kv(dv, G).to(v.dtype)


# --- CUDA ---------------------------------------------------------------------------------
# The flash kernels (torch's aten ops and flash-attn's backward) need a head dim that is a
# multiple of 8 (flash_api.cpp `mha_fwd`/`mha_bwd`: "head_size should be a multiple of 8";
# only F.scaled_dot_product_attention pads, the aten ops do not), and the memory-efficient
# kernel's sm80+ instances need rows aligned to 8 (half) / 4 (fp32) elements (cutlassF.h:
# "no kernel found to launch"). All take [*, S, *, d] with stride(-1) == 1. Padding q, k,
# v (and out, dout) with zero columns to a multiple of 8 changes nothing else: q.k and the
# lse are unchanged (the scale is always passed explicitly), out's padded columns are 0,
# and the gradients' padded columns are dropped.


def _pad8(*ts):
    pad = (-ts[0].shape[-1]) % 8
    return ts if pad == 0 else tuple(torch.nn.functional.pad(t, (0, pad)) for t in ts)


def _unpad(d, *ts):
    return tuple(t[..., :d] if t.shape[-1] != d else t for t in ts)


def _cuda_forward(q, k, v, causal, scale):
    d = q.shape[-1]
    if q.dtype in HALF:  # flash: k/v may have fewer heads (mha_fwd), no expansion
        qp, kp, vp = _pad8(q, k, v)
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            qp.transpose(1, 2),
            kp.transpose(1, 2),
            vp.transpose(1, 2),
            0.0,
            causal,
            False,
            scale=scale,
        )
        (out,) = _unpad(d, res[0].transpose(1, 2))
        return out, res[1]
    # memory-efficient kernel: equal head counts; its lse is padded to a multiple of 32
    H = q.shape[2]
    qp, kp, vp = _pad8(q, _expand_kv(k, H), _expand_kv(v, H))
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        qp.transpose(1, 2),
        kp.transpose(1, 2),
        vp.transpose(1, 2),
        None,
        True,
        0.0,
        causal,
        scale=scale,
    )
    (out,) = _unpad(d, res[0].transpose(1, 2))
    return out, res[1][:, :, : q.shape[1]]


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    S, Sk, d = q.shape[1], k.shape[1], q.shape[-1]
    if q.dtype in HALF:
        dop, qp, kp, vp, op = _pad8(dout, q, k, v, out)
        # cum_seq_q/k None: an undefined tensor selects the dense kernel; a defined one, even
        # empty, selects varlen (attention_backward.cu `_flash_attention_backward`). The rng
        # state is read only with dropout > 0.
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *(t.transpose(1, 2) for t in (dop, qp, kp, vp, op)),
            lse,
            None,
            None,
            S,
            Sk,
            0.0,
            causal,
            no_rng,
            no_rng,
            scale=scale,
        )
        return _unpad(d, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))
    H, G = q.shape[2], k.shape[2]
    dop, qp, kp, vp, op = _pad8(dout, q, _expand_kv(k, H), _expand_kv(v, H), out)
    pad = (-S) % 32  # the efficient kernel reads its lse padded to a multiple of 32 queries
    lse_pad = torch.nn.functional.pad(lse, (0, pad)) if pad else lse  # (finite padding)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dop.transpose(1, 2),
        qp.transpose(1, 2),
        kp.transpose(1, 2),
        vp.transpose(1, 2),
        None,
        op.transpose(1, 2),
        lse_pad,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    dq, dk, dv = _unpad(d, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))
    return dq, _sum_kv(dk, G), _sum_kv(dv, G)


def _flash_attn_forward(q, k, v, causal, scale):
    import flash_attn

    d = q.shape[-1]
    qp, kp, vp = _pad8(q, k, v)
    out, lse, _ = flash_attn.flash_attn_func(
        qp, kp, vp, softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    (out,) = _unpad(d, out)
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward as fa_backward

    d = q.shape[-1]
    dop, qp, kp, vp, op = _pad8(dout, q, k, v, out)
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    fa_backward(
        dop,
        qp,
        kp,
        vp,
        op,
        lse,
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    return _unpad(d, dq, dk, dv)
