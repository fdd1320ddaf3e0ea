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

Backends (chosen by argument; `None` picks by device):
- "cpu":        aten `_scaled_dot_product_flash_attention_for_cpu` (+ backward); GQA native.
- "cuda":       aten `_scaled_dot_product_flash_attention` (fp16/bf16) or
                `_scaled_dot_product_efficient_attention` (fp32); K/V are expanded for GQA.
- "flash_attn": the `flash_attn` package's kernels when installed; GQA native.
- "reference":  float64 math on the full S x S score matrix; for tests and tiny shapes only.

Causal masking is aligned at the diagonal and needs equal query and key lengths (every row
then sees at least one key, so no fully masked row -- whose lse would be 0, not -inf --
can occur). Strategies that need off-diagonal blocks call the kernel non-causally.
"""

from __future__ import annotations

import importlib.util
import math

import torch

BACKENDS = ("cpu", "cuda", "flash_attn", "reference")


def default_backend(device: torch.device) -> str:
    """The backend used for `device` when none is given."""
    if device.type == "cuda":
        return "flash_attn" if importlib.util.find_spec("flash_attn") else "cuda"
    if device.type == "cpu":
        return "cpu"
    raise ValueError(
        f"no attention kernel for device type {device.type!r}; use a cpu or cuda tensor, "
        "or backend='reference'"
    )


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
    backend = backend or default_backend(q.device)
    _check(q, k, v, causal, backend)
    scale = _scale(softmax_scale, q.shape[-1])
    if backend == "cpu":
        out_BHSd, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
        )
        return out_BHSd.transpose(1, 2), lse_BHS
    if backend == "flash_attn":
        out, lse = _flash_attn_forward(q, k, v, causal, scale)
        return out, lse
    if backend == "cuda":
        H = q.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, _expand_kv(k, H), _expand_kv(v, H)))
        if q.dtype in (torch.float16, torch.bfloat16):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qt, kt, vt, 0.0, causal, False, scale=scale
            )
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, None, True, 0.0, causal, scale=scale
            )
        return res[0].transpose(1, 2), res[1][:, :, : q.shape[1]]
    return _reference_forward(q, k, v, causal, scale)


def attention_backward(dout, q, k, v, out, lse, *, causal=True, softmax_scale=None, backend=None):
    """Gradients (dq, dk, dv) of `attention_forward`, from its saved `out` and `lse`."""
    backend = backend or default_backend(q.device)
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


# --- CUDA -------------------------------------------------------------------------------


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    H, G = q.shape[2], k.shape[2]
    dot, qt, ot = dout.transpose(1, 2), q.transpose(1, 2), out.transpose(1, 2)
    kt, vt = _expand_kv(k, H).transpose(1, 2), _expand_kv(v, H).transpose(1, 2)
    S, Sk = q.shape[1], k.shape[1]
    if q.dtype in (torch.float16, torch.bfloat16):
        cum_q = torch.empty(0, dtype=torch.int32, device=q.device)
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dot,
            qt,
            kt,
            vt,
            ot,
            lse,
            cum_q,
            cum_q,
            S,
            Sk,
            0.0,
            causal,
            no_rng,
            no_rng,
            scale=scale,
        )
    else:
        # the efficient kernel stores lse padded to a multiple of 32 queries
        pad = (-S) % 32
        lse_pad = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dot,
            qt,
            kt,
            vt,
            None,
            ot,
            lse_pad,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, _sum_kv(dk, G), _sum_kv(dv, G)


def _flash_attn_forward(q, k, v, causal, scale):
    import flash_attn

    out, lse, _ = flash_attn.flash_attn_func(
        q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward as fa_backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa_backward(
        dout,
        q,
        k,
        v,
        out,
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
    return dq, dk, dv
