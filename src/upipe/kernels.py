"""Local (single-device) attention that returns its log-sum-exp, and its backward.

Every strategy calls these two functions on the tensors it holds after communication:

    attention_forward(q, k, v, *, causal, softmax_scale, backend) -> (out, lse)
    attention_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, backend) -> (dq, dk, dv)

Legend: B batch, S sequence (queries and keys have the same length), H query heads,
G kv heads (G divides H; query head h uses kv head h // (H / G)), d head dim.
Layout: q `[B, S, H, d]`, k/v `[B, S, G, d]`, out like q, lse `[B, H, S]` (fp32; fp64 for
fp64 inputs) with
lse[b, h, i] = log sum_j exp(scale * q_i . k_j) over the keys query i may see.

The backward reuses the saved `out` and `lse` (no forward recompute):
    P = exp(scale * Q K^T - lse),  dV = P^T dO,  dP = dO V^T,
    delta = rowsum(dO * O),  dS = P * (dP - delta),  dQ = scale * dS K,  dK = scale * dS^T Q
with dK/dV of a kv head summed over the H / G query heads that share it.

Backends (chosen by argument, never at import; `resolve_backend`). On CUDA each runs one of
torch's ops or a package, as its contract in torch's sources requires (`upipe.kernels_cuda`
cites them; the tests run every CUDA path on CPU against emulations of those contracts):
- "auto" / None: the kernel for the device, dtype and head dim (`upipe.kernels_select`: the
                rule, its reasons and sources, logged once).
- "cpu":        aten `_scaled_dot_product_flash_attention_for_cpu` (+ backward); GQA native.
- "flash":      aten `_scaled_dot_product_flash_attention` (+ backward): torch's
                FlashAttention-2; fp16/bf16, GQA native.
- "efficient":  aten `_scaled_dot_product_efficient_attention` (+ backward): fp32 (and
                fp16/bf16); K/V expanded for GQA (the kernel needs equal head counts).
- "cudnn":      aten `_scaled_dot_product_cudnn_attention` (+ backward), compute_log_sumexp:
                cuDNN's attention inside every CUDA build of torch; fp16/bf16, GQA native,
                its lse `[B, H, S, 1]` viewed as `[B, H, S]`.
- "fa3", "fa4": the "flash" ops with torch's FA3 / FA4 impl activated
                (`torch.nn.attention.activate_flash_attention_impl`), which reroutes them to
                FlashAttention-3 (`flash_attn_interface`, sm90) or FlashAttention-4
                (`flash_attn.cute`, pip package flash-attn-4; sm90/sm100). Process-wide:
                see `upipe.kernels_select`.
- "flash_attn": the flash-attn package (>= 2.7); fp16/bf16; GQA native.
- "cuda":       today's CUDA default, kept for compatibility: "flash" for fp16/bf16,
                "efficient" otherwise.
- "reference":  float64 math on the full S x S score matrix; for tests and tiny shapes only.
A kernel whose package is missing, or that cannot take the dtype or head dim, is refused
with a ValueError naming the package or the limit and the fix (`check_kernel`, which the
strategies call on every rank before any collective). Packed documents (`upipe.attention.
documents`) use each backend's varlen call where it has one: flash, fa3 and fa4 (the varlen
aten op, rerouted alike); the others make one call per document.

Causal masking is aligned at the diagonal and needs equal query and key lengths (every row
then sees at least one key, so no fully masked row -- whose lse would be 0, not -inf --
can occur). Strategies that need off-diagonal blocks call the kernel non-causally.
"""

from __future__ import annotations

import math

import torch

from upipe import kernels_cuda, kernels_select
from upipe.heads import kv_problem
from upipe.kernels_cuda import expand_kv, sum_kv
from upipe.kernels_select import CUDA_KERNELS, HALF, KERNELS, auto_kernel, kernel_problem
from upipe.torch_private import aten_op

__all__ = [
    "BACKENDS",
    "HALF",
    "KERNELS",
    "acc_dtype",
    "attention_backward",
    "attention_forward",
    "check_kernel",
    "default_backend",
    "prepare_kernel",
    "resolve_backend",
    "uses_cuda_kernels",
]
BACKENDS = ("auto", "cpu", "cuda", *CUDA_KERNELS, "reference")


def resolve_backend(backend, device, dtype, *, head_dim=None, documents=False) -> str:
    """The kernel `backend` names for inputs of `dtype` on `device`: auto's choice for None
    or "auto" (`head_dim`: the inputs' head dim, for auto's limits; `documents`: for packed
    documents, where auto prefers a varlen kernel), "cuda" spelled out, else `backend`."""
    if backend is None or backend == "auto":
        return auto_kernel(device, dtype, head_dim, documents=documents)
    if backend == "cuda":
        return "flash" if dtype in HALF else "efficient"
    return backend


def default_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The kernel used for `device` (and `dtype`) when none is given (auto's choice)."""
    return resolve_backend(None, device, dtype or torch.float32)


def uses_cuda_kernels(backend: str) -> bool:
    """Whether a resolved backend runs CUDA's kernels (and so CUDA's GEMMs, `upipe.gemm`)."""
    return backend not in ("cpu", "reference")


def check_kernel(backend, device, dtype, head_dim, *, documents=False) -> str:
    """The kernel `backend` resolves to for attention of `dtype` and `head_dim` on `device`,
    or a ValueError naming why it cannot run there and the fix (`kernels_select`). Cheap: the
    strategies call it on every rank before any collective."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    kernel = resolve_backend(backend, device, dtype, head_dim=head_dim, documents=documents)
    problem = kernel_problem(kernel, device, dtype, head_dim) if kernel in CUDA_KERNELS else None
    if problem:
        raise ValueError(problem)
    if kernel == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' runs CPU tensors, got {device}; use backend='auto'")
    return kernel


def prepare_kernel(backend, device, dtype, head_dim, *, documents=False) -> str:
    """`check_kernel`, and for fa3/fa4 the process-wide activation of torch's impl (once;
    `kernels_select.activate`). What every kernel call runs first; callers that want the
    activation (and auto's log line) at a known point call it ahead of time."""
    kernel = check_kernel(backend, device, dtype, head_dim, documents=documents)
    if kernel in kernels_select.IMPL:
        kernels_select.activate(kernel)
    return kernel


def _check(q, k, v, causal, mask=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, heads, d], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    B, S, H, d = q.shape
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    problem = kv_problem(H, k.shape[2])
    if problem:
        raise ValueError(problem)
    if causal and k.shape[1] != S:
        raise ValueError(
            f"causal attention needs equal query ({S}) and key ({k.shape[1]}) lengths; "
            "split off-diagonal blocks and call them with causal=False"
        )
    if mask is not None and (mask.shape != (S, k.shape[1]) or mask.dtype != acc_dtype(q.dtype)):
        raise ValueError(
            f"mask must be {acc_dtype(q.dtype)} [{S}, {k.shape[1]}] (queries x keys), got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for lse and for sums of partial results: fp32, or the input's when wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _scale(softmax_scale, d):
    return 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale


MASK_KERNELS = ("cpu", "reference")
"""The kernels that take an additive `mask` (`attention_forward`)."""


def attention_forward(q, k, v, *, causal=True, softmax_scale=None, backend=None, mask=None):
    """Attention of q `[B, S, H, d]` over k/v `[B, Sk, G, d]`.

    Returns (out `[B, S, H, d]` in q's dtype, lse fp32 `[B, H, S]`). `mask`: an additive
    `[S, Sk]` of 0 (seen) and -inf (hidden) in `acc_dtype(q.dtype)`, for the `MASK_KERNELS`
    only; every row must see a key (the CPU kernel gives a row it hides entirely lse 0, not
    -inf). (Under fp64 queries the CPU kernel gave wrong results with an fp32 mask --
    measured, relative errors of 1 to 19 -- and right ones with an fp64 mask; by our reading
    of its `_scale_attn_mask_fusion_kernel`, it steps by the mask's vector width while
    loading the query's, half as wide.)
    """
    _check(q, k, v, causal, mask)
    kernel = prepare_kernel(backend, q.device, q.dtype, q.shape[-1])
    scale = _scale(softmax_scale, q.shape[-1])
    _check_mask_kernel(mask, kernel)
    if kernel == "cpu":
        out_BHSd, lse_BHS = aten_op("_scaled_dot_product_flash_attention_for_cpu")(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal,
            attn_mask=mask, scale=scale,
        )  # fmt: skip
        return out_BHSd.transpose(1, 2), lse_BHS
    if kernel == "reference":
        return _reference_forward(q, k, v, causal, scale, mask)
    return kernels_cuda.FORWARD[kernel](q, k, v, causal, scale)


def attention_backward(
    dout, q, k, v, out, lse, *, causal=True, softmax_scale=None, backend=None, mask=None
):
    """Gradients (dq, dk, dv) of `attention_forward`, from its saved `out` and `lse`."""
    _check(q, k, v, causal, mask)
    kernel = prepare_kernel(backend, q.device, q.dtype, q.shape[-1])
    scale = _scale(softmax_scale, q.shape[-1])
    _check_mask_kernel(mask, kernel)
    if kernel == "cpu":
        dq, dk, dv = aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse,
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if kernel == "reference":
        return _reference_backward(dout, q, k, v, out, lse, causal, scale, mask)
    return kernels_cuda.BACKWARD[kernel](dout, q, k, v, out, lse, causal, scale)


def _check_mask_kernel(mask, kernel) -> None:
    if mask is not None and kernel not in MASK_KERNELS:
        raise ValueError(f"a mask runs on the {MASK_KERNELS} kernels only, not {kernel!r}")


# --- float64 reference ------------------------------------------------------------------


def _reference_scores(q, k, causal, scale, mask=None):
    """Scaled scores [B, H, S, Sk] in fp64 with -inf above the diagonal when causal, plus
    `mask`."""
    H = q.shape[2]
    s_BHSS = torch.einsum("bshd,bthd->bhst", q.double(), expand_kv(k, H).double()) * scale
    if causal:
        S = q.shape[1]
        upper = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        s_BHSS = s_BHSS.masked_fill(upper, float("-inf"))
    return s_BHSS if mask is None else s_BHSS + mask.double()


def _reference_forward(q, k, v, causal, scale, mask=None):
    s_BHSS = _reference_scores(q, k, causal, scale, mask)
    lse_BHS = torch.logsumexp(s_BHSS, dim=-1)
    p_BHSS = torch.exp(s_BHSS - lse_BHS[..., None])
    out = torch.einsum("bhst,bthd->bshd", p_BHSS, expand_kv(v, q.shape[2]).double())
    return out.to(q.dtype), lse_BHS.to(acc_dtype(q.dtype))


def _reference_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    H, G = q.shape[2], k.shape[2]
    s_BHSS = _reference_scores(q, k, causal, scale, mask)
    p_BHSS = torch.exp(s_BHSS - lse.double()[..., None])
    do, vv, kk = dout.double(), expand_kv(v, H).double(), expand_kv(k, H).double()
    dv = torch.einsum("bhst,bshd->bthd", p_BHSS, do)
    dp_BHSS = torch.einsum("bshd,bthd->bhst", do, vv)
    delta_BHS = (do * out.double()).sum(-1).transpose(1, 2)
    ds_BHSS = p_BHSS * (dp_BHSS - delta_BHS[..., None])
    dq = torch.einsum("bhst,bthd->bshd", ds_BHSS, kk) * scale
    dk = torch.einsum("bhst,bshd->bthd", ds_BHSS, q.double()) * scale
    return dq.to(q.dtype), sum_kv(dk, G).to(k.dtype), sum_kv(dv, G).to(v.dtype)
