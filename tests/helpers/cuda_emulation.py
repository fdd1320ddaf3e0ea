"""CPU emulation of the CUDA-only aten ops upipe calls, held to torch 2.13's CUDA contract.

`install()` registers CPU kernels (``torch.library``, dispatch key CPU) for the ops below, so
the ``backend="cuda"`` code path runs on CPU tensors and fails wherever a GPU would. Every
rule was read from torch's sources (paths under ``aten/src/ATen/native/``; the headers also
ship in the 2.13 wheel under ``torch/include``) and is cited at the line that enforces it.
Numbers are fp32 math on the full score matrix (tiny shapes only). Dropout and attention
bias are not emulated (RuntimeError). Where the CUDA code does not check but silently reads
the wrong memory, the emulation raises and says so ("unchecked on CUDA").

Legend: B batch, H query heads, G kv heads, M query length, N key length, d head dim.
The SDPA ops take ``[B, heads, len, d]``; the kernels behind them see ``[B, len, heads, d]``.

1. ``_scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask,
   *, scale)`` -- transformers/cuda/attention.cu ``_scaled_dot_product_flash_attention_cuda``
   -> ``_flash_attention_forward`` -> transformers/cuda/flash_attn/flash_api.cpp ``mha_fwd``:
   fp16/bf16 only, k/v dtype == q dtype; last dim contiguous; d % 8 == 0 (the op does not
   pad: F.scaled_dot_product_attention pads before calling it) and d <= 256; G divides H
   (GQA native); k/v ``[B, G, N, d]`` (v has q's head dim); return_debug_mask needs dropout.
   Causal masking is aligned bottom-right (key j visible to query i iff j <= i + N - M);
   fully masked rows give out 0 and lse +inf. Returns (out with q's memory layout, lse fp32
   contiguous ``[B, H, M]``, cum_seq_q None, cum_seq_k None, M, N, rng_state uint64 ``[2]``,
   unused uint64 ``[]``, debug_attn_mask ``[0]``).
2. ``_scaled_dot_product_flash_attention_backward`` -- attention_backward.cu
   ``_scaled_dot_product_flash_attention_backward_cuda`` -> ``_flash_attention_backward``:
   a *defined* ``cum_seq_q`` (an empty tensor is defined) selects ``mha_varlen_bwd``, whose
   checks then fail (an empty int32 tensor: "batch size must be positive"); None selects
   ``mha_bwd``: fp16/bf16, every tensor q's dtype; d % 8 == 0 ("head_size should be a
   multiple of 8": no padding here either), d <= 256, G divides H; shapes checked; lse is
   read as contiguous fp32 ``[B, H, M]`` (unchecked on CUDA); philox tensors are read only
   with dropout. dq has q's layout; dk/dv have G heads (the H / G copies summed).
3. ``_scaled_dot_product_efficient_attention`` -- attention.cu
   ``_scaled_dot_product_efficient_attention_cuda`` -> ``_efficient_attention_forward``:
   fp32/fp16/bf16 ("Only fp32, half & bf16 supported at the moment"); H == G (no GQA) and
   equal head dims for q/k; last dim contiguous; on sm80+ only "aligned" kernels exist, so
   head/row strides must be multiples of 8 (half) or 4 (fp32) ("cutlassF: no kernel found to
   launch!"). Causal is aligned top-left. lse is fp32 ``[B, H, ceil(M / 32) * 32]`` (``[B, H,
   0]`` without compute_log_sumexp); the padding holds +inf, exactly what
   mem_eff_attention/kernel_forward.h writes there ("we pad logsumexp with inf"), so merging
   or reducing the padded tensor by mistake shows up as inf. out is ``[B, M, H, d]``
   contiguous (viewed as ``[B, H, M, d]``); philox seed/offset are int64 scalars.
4. ``_scaled_dot_product_efficient_attention_backward`` -- attention_backward.cu
   ``_scaled_dot_product_efficient_attention_backward_cuda`` -> ``_efficient_attention_backward``
   + mem_eff_attention/kernel_backward.h ``check_supported``: same dtype/head rules (H == G);
   lse strides: ``stride(1) % 8`` when H > 1 and ``stride(0) % 8`` when B > 1 ("LSE is not
   correctly aligned (strideH)"); the kernel reads lse up to the padded extent
   ceil(M / 32) * 32 (gemm/mma_from_smem.h ``accumApplyLSEToSmem``), so a shorter lse is
   rejected, as is NaN/-inf in its padding (it would turn dK/dV into NaN); fp16/bf16 read
   ``out`` with an implied row stride H * d (kernel_backward.h ``o_strideM``), i.e. out must
   have the layout the forward returned. Returns (dq, dk, dv, None) whatever grad_input_mask.
5. While torch has an FA3 / FA4 impl active (`torch.nn.attention.current_flash_attention_impl()`)
   the CUDA dispatcher runs that impl's wrapper for 1. and 2.: so do these kernels, with
   the contract written in flash_impl_emulation.py (`REROUTED`).
6. ``mm.dtype`` / ``mm.dtype_out`` / ``addmm.dtype`` / ``addmm.dtype_out`` -- cuda/Blas.cpp
   ``_mm_dtype_out_cuda``, ``_addmm_dtype_out_cuda``, ``addmm_out_cuda_impl``: operands share
   one dtype; out_dtype is that dtype or fp32 for fp16/bf16 operands; an ``out`` tensor must
   have out_dtype; addmm's self must have out_dtype or the operands' dtype; mm.dtype_out
   writes into ``out`` as an addmm with self=out, beta=0, so ``out`` must already be
   ``[M, N]``; ``addmm(acc, a, b, out_dtype=fp32, out=acc)`` is the supported in-place
   accumulate (``result.is_same(self)``: C = beta * C + alpha * A @ B, no copy). Products
   accumulate in fp32 (fp64 for fp64).
"""

from __future__ import annotations

import math
import warnings

import torch

__all__ = ["install"]

_LIB: torch.library.Library | None = None  # keeps the registrations alive
_HALF = (torch.float16, torch.bfloat16)
_C10_NAMES = {
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float64: "Double",
    torch.int32: "Int",
    torch.int64: "Long",
}
_NOT_EMULATED = "cuda_emulation: {} is not emulated"
# impl ("FA3" / "FA4") -> the flash ops' emulation while torch has it active: the CUDA
# dispatcher then runs torch's wrapper of that impl instead (flash_impl_emulation.py)
REROUTED: dict[str, dict] = {}


def _rerouted(op: str):
    """The emulation of `op` under the active flash impl, or None under torch's FA2."""
    impl = torch.nn.attention.current_flash_attention_impl()
    if impl is None:
        return None
    _check(
        impl in REROUTED,
        f"cuda_emulation: {impl} is active but flash_impl_emulation is not installed",
    )
    return REROUTED[impl][op]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _expected(cond: bool, expr: str) -> None:
    """A bare TORCH_CHECK(cond): c10 words the failure like this."""
    _check(cond, f"Expected {expr} to be true, but got false.")


def _name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype))


def _scale(scale: float | None, d: int) -> float:
    # transformers/sdp_utils_cpp.h calculate_scale: scale, else 1 / sqrt(query.size(-1))
    return 1.0 / math.sqrt(d) if scale is None else scale


# --- fp32 math on [B, heads, len, d] ---------------------------------------------------


def _scores(q_BHMd, k_BHNd, scale, causal, bottom_right, window_left=-1):
    """Scaled scores with -inf where masked: causal above the (top-left or bottom-right)
    diagonal, and with `window_left` >= 0 (flash_api.cpp: -1 is unlimited) left of it:
    row i, aligned at key i + shift, sees keys i + shift - window_left .. i + shift."""
    s_BHMN = torch.matmul(q_BHMd.float(), k_BHNd.float().transpose(-1, -2)) * scale
    M, N = s_BHMN.shape[-2:]
    shift = N - M if bottom_right else 0
    if causal:
        mask = torch.ones(M, N, dtype=torch.bool).triu(1 + shift)
        s_BHMN = s_BHMN.masked_fill(mask, float("-inf"))
    if window_left >= 0:
        mask = torch.ones(M, N, dtype=torch.bool).tril(shift - window_left - 1)
        s_BHMN = s_BHMN.masked_fill(mask, float("-inf"))
    return s_BHMN


def _expand(t_BGNd, H):
    return t_BGNd.repeat_interleave(H // t_BGNd.shape[1], dim=1)


def _forward_math(q_BHMd, k_BGNd, v_BGNd, scale, causal, bottom_right, window_left=-1):
    """(out fp32 [B, H, M, d], lse fp32 [B, H, M]; -inf on fully masked rows)."""
    H = q_BHMd.shape[1]
    s_BHMN = _scores(q_BHMd, _expand(k_BGNd, H), scale, causal, bottom_right, window_left)
    lse_BHM = torch.logsumexp(s_BHMN, dim=-1)
    p_BHMN = torch.exp(s_BHMN - lse_BHM[..., None])
    p_BHMN = torch.where(torch.isfinite(lse_BHM)[..., None], p_BHMN, 0.0)
    return torch.matmul(p_BHMN, _expand(v_BGNd, H).float()), lse_BHM


def _backward_math(
    do_BHMd, q_BHMd, k_BGNd, v_BGNd, o_BHMd, lse_BHM, scale, causal, bottom_right, window_left=-1
):
    """(dq, dk, dv) in fp32 from the saved out and lse; dk/dv summed to G heads."""
    H, G = q_BHMd.shape[1], k_BGNd.shape[1]
    kk, vv = _expand(k_BGNd, H).float(), _expand(v_BGNd, H).float()
    s_BHMN = _scores(q_BHMd, kk, scale, causal, bottom_right, window_left)
    p_BHMN = torch.exp(s_BHMN - lse_BHM.float()[..., None])
    do = do_BHMd.float()
    dv = torch.matmul(p_BHMN.transpose(-1, -2), do)
    delta_BHM1 = (do * o_BHMd.float()).sum(-1, keepdim=True)
    ds_BHMN = p_BHMN * (torch.matmul(do, vv.transpose(-1, -2)) - delta_BHM1)
    dq = torch.matmul(ds_BHMN, kk) * scale
    dk = torch.matmul(ds_BHMN.transpose(-1, -2), q_BHMd.float()) * scale
    if G != H:  # flash_api.cpp mha_bwd: "For MQA/GQA we need to sum dK and dV across the groups"
        dk, dv = (t.unflatten(1, (G, H // G)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _like(layout_BLHd, values_BHLd):
    """at::empty_like(t) keeps t's strides; fill it and view it as [B, heads, len, d]."""
    out = torch.empty_like(layout_BLHd)
    out.copy_(values_BHLd.transpose(1, 2))
    return out.transpose(1, 2)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p > 0:
        raise RuntimeError(_NOT_EMULATED.format("dropout"))


# --- flash ------------------------------------------------------------------------------


def _flash_forward(
    query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    if rerouted := _rerouted("sdpa_forward"):
        return rerouted(query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    _check(
        all(t.dim() == 4 for t in (query, key, value)),
        "cuda_emulation: _scaled_dot_product_flash_attention takes 4-D [B, heads, len, d]",
    )
    # attention.cu _scaled_dot_product_flash_attention_cuda
    _check(key.size(2) == value.size(2), "Key and Value must have the same sequence length")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # what mha_fwd sees: [B, L, h, d]
    # flash_api.cpp mha_fwd
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    B, M, H, d = q.shape
    N, G = k.shape[1], k.shape[2]
    rng_state = torch.zeros(2, dtype=torch.uint64)  # mha_fwd: "BC breaking change to flash
    unused = torch.zeros((), dtype=torch.uint64)  # seed/offset": uint64 [2] and uint64 []
    debug_mask = torch.empty(0, dtype=query.dtype)  # _flash_attention_forward: empty {0}
    if B == 0:  # mha_fwd's early return for an empty batch
        lse = torch.empty(0, H, M, dtype=torch.float32)
        return torch.empty_like(query), lse, None, None, M, N, rng_state, unused, debug_mask
    _check(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(H % G == 0, "Number of heads in key/value must divide number of heads in query")
    _check(
        tuple(k.shape) == (B, N, G, d),
        "k must have shape (batch_size, seqlen_k, num_heads_k, head_size_og)",
    )
    _check(
        tuple(v.shape) == (B, N, G, d),
        "v must have shape (batch_size, seqlen_k, num_heads_k, head_size_og)",
    )
    _check(
        not return_debug_mask or dropout_p > 0,
        "return_softmax is only supported when p_dropout > 0.0",
    )
    _no_dropout(dropout_p)
    # flash_api.cpp mha_fwd: is_causal -> window_size_right = 0, i.e. the FlashAttention-2 mask
    # aligned bottom-right; a fully masked row (or N == 0) gives out 0 and lse +inf.
    out, lse = _forward_math(query, key, value, _scale(scale, d), is_causal, bottom_right=True)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    # _scaled_dot_product_flash_attention_cuda returns Tensor() for cum_seq_q/k: None here
    return _like(q, out), lse, None, None, M, N, rng_state, unused, debug_mask


def _varlen_backward_checks(dout, q, k, v, out, cu_q, cu_k):
    """flash_api.cpp mha_varlen_bwd, in its order, up to the first shape check."""
    _check(cu_k is not None, "cum_seq_k is undefined but cum_seq_q is defined (varlen path)")
    _check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    _check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _check(cu_q.numel() - 1 > 0, "batch size must be positive")
    head_size, head_size_og = q.size(2), dout.size(2)  # varlen reads q as [total, h, d]
    _check(head_size % 8 == 0, "head_size should be a multiple of 8")
    _check(
        head_size_og % 8 == 0,
        "head_size_og should be a multiple of 8, this is ensured by padding!",
    )
    _check(q.dim() == 3, "q must have shape (total_q, num_heads, head_size)")
    raise RuntimeError(_NOT_EMULATED.format("the varlen flash backward (mha_varlen_bwd)"))


def _flash_backward(
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
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    # attention_backward.cu _scaled_dot_product_flash_attention_backward_cuda
    if grad_out is None:
        return None, None, None
    if rerouted := _rerouted("sdpa_backward"):
        args = (cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal)
        return rerouted(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            *args,
            philox_seed,
            philox_offset,
            scale=scale,
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    # _flash_attention_backward: dout and out are made contiguous ([B, M, H, d])
    dout, o = (t.transpose(1, 2).contiguous() for t in (grad_out, out))
    # mha_bwd and mha_varlen_bwd open with the same dtype and stride checks
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(o.dtype == q.dtype, "query and out must have the same dtype")
    _check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    # _flash_attention_backward: "We check the whether the cumulative_sequence_length_q is
    # defined in order to determine whether we are using varlen or dense forward"
    if cum_seq_q is not None:
        _varlen_backward_checks(dout, q, k, v, o, cum_seq_q, cum_seq_k)
    # mha_bwd (dense)
    B, M, H, d = q.shape
    N, G, d_og = k.size(1), k.size(2), dout.size(3)
    if B == 0:
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    _check(d % 8 == 0, "head_size should be a multiple of 8")
    _check(d_og % 8 == 0, "head_size_og should be a multiple of 8, this is ensured by padding!")
    _check(d <= 256, "FlashAttention backward only supports head dimension at most 256")
    _check(H % G == 0, "Number of heads in key/value must divide number of heads in query")
    _check(d == (d_og + 7) // 8 * 8, "head_size must be head_size_og rounded to a multiple of 8")
    _check(
        tuple(k.shape) == (B, N, G, d),
        "k must have shape (batch_size, seqlen_k, num_heads_k, head_size)",
    )
    _check(
        tuple(v.shape) == (B, N, G, d),
        "v must have shape (batch_size, seqlen_k, num_heads_k, head_size)",
    )
    _check(
        tuple(o.shape) == (B, M, H, d),
        "out must have shape (batch_size, seqlen_q, num_heads, head_size)",
    )
    _check(
        tuple(dout.shape) == (B, M, H, d_og),
        "dout must have shape (batch_size, seqlen_q, num_heads, head_size_og)",
    )
    # mha_bwd hands softmax_lse.data_ptr() to the kernel, which indexes it as contiguous fp32
    # [B, H, M] (flash_bwd_kernel.h row_offset_lse); nothing checks it.
    _check(
        logsumexp.dtype == torch.float32
        and tuple(logsumexp.shape) == (B, H, M)
        and logsumexp.is_contiguous(),
        f"cuda_emulation: flash backward reads logsumexp as contiguous fp32 [B, H, M] = "
        f"{[B, H, M]} (unchecked on CUDA); got {logsumexp.dtype} {list(logsumexp.shape)} "
        f"strides {list(logsumexp.stride())}",
    )
    # mha_bwd reads philox_seed (as uint64 rng_state) only when p_dropout > 0
    _no_dropout(dropout_p)
    dq, dk, dv = _backward_math(
        dout.transpose(1, 2),
        query,
        key,
        value,
        o.transpose(1, 2),
        logsumexp,
        _scale(scale, d),
        is_causal,
        bottom_right=True,
    )
    return _like(q, dq), _like(k, dk), _like(v, dv)


# --- memory-efficient -------------------------------------------------------------------

_LSE_ALIGN = 32  # kernel_forward.h kAlignLSE ("block size of backward")


def _mem_eff_common_checks(q, k, v):
    """_efficient_attention_forward/_backward: the bare TORCH_CHECKs on [B, L, h, d] views."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        _expected(t.dim() == 4, f"{name}.dim() == 4")
    _expected(q.size(0) == k.size(0), "query.size(0) == key.size(0)")
    _expected(q.size(0) == v.size(0), "query.size(0) == value.size(0)")
    _expected(k.size(1) == v.size(1), "key.size(1) == value.size(1)")
    _expected(q.size(2) == k.size(2), "query.size(2) == key.size(2)")  # no GQA
    _expected(q.size(2) == v.size(2), "query.size(2) == value.size(2)")
    _expected(q.size(3) == k.size(3), "query.size(3) == key.size(3)")


def _mem_eff_dtype_checks(q, *others):
    # mem_eff_attention/gemm_kernel_utils.h DISPATCH_TYPES, on query only
    _check(q.dtype in (torch.float32, *_HALF), "Only fp32, half & bf16 supported at the moment")
    # the kernels cast every other pointer to query's scalar_t without a check
    for name, t in others:
        _check(
            t.dtype == q.dtype,
            f"cuda_emulation: {name} is {t.dtype} but query is {q.dtype}; the mem-efficient "
            "kernel reinterprets it as query's dtype (unchecked on CUDA)",
        )


def _strides_aligned(tensors, align, B, H, which):
    """kernel_{forward,backward}.h check_supported: strideM always, strideH/strideB if > 1."""
    for name, t in tensors:
        _check(t.stride(1) % align == 0, f"{name} is not correctly aligned (strideM)")
        _check(H <= 1 or t.stride(2) % align == 0, f"{name} is not correctly aligned (strideH)")
        if which == "backward":
            _check(B <= 1 or t.stride(0) % align == 0, f"{name} is not correctly aligned (strideB)")


def _efficient_forward(
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
):
    if attn_bias is not None:
        raise RuntimeError(_NOT_EMULATED.format("attn_bias"))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # attention.cu: q_t, k_t, v_t
    _mem_eff_common_checks(q, k, v)
    for name, t in (("query", q), ("key", k), ("value", v)):  # CHECK_NOSPARSE_LASTCONTIGUOUS
        _check(t.stride(-1) == 1, f"{name}: last dimension must be contiguous")
    _mem_eff_dtype_checks(q, ("key", k), ("value", v))
    _no_dropout(dropout_p)
    B, M, H, d = q.shape
    # kernels/cutlassF.h lists only aligned kernels for sm80+; launchKernel skips a kernel when
    # stride(2) % kAlignmentQ/K (128 bits: 8 half or 4 fp32 elements; value: 1) is nonzero
    align = 4 if q.dtype == torch.float32 else 8
    _check(
        q.stride(2) % align == 0 and k.stride(2) % align == 0,
        "cutlassF: no kernel found to launch!",
    )
    _strides_aligned((("query", q), ("key", k)), align, B, H, "forward")
    # causal = sdp::CustomMaskType::CausalFromTopLeft
    out, lse = _forward_math(query, key, value, _scale(scale, d), is_causal, bottom_right=False)
    # kernel_forward.h: a fully masked row gets lse 0 ("We set fully masked out rows to 0")
    lse = lse.masked_fill(lse == float("-inf"), 0.0)
    res = torch.empty(B, M, H, v.size(3), dtype=q.dtype)  # at::empty({B, M, num_heads, Kv})
    res.copy_(out.transpose(1, 2))
    # logsumexp = at::empty({B, num_heads, ceil_div(M, kAlignLSE) * kAlignLSE or 0}); the kernel
    # writes +inf past M ("To make the backward easier, we pad logsumexp with `inf`")
    width = -(-M // _LSE_ALIGN) * _LSE_ALIGN if compute_log_sumexp else 0
    lse_pad = torch.full((B, H, width), float("inf"), dtype=torch.float32)
    if compute_log_sumexp:
        lse_pad[..., :M] = lse
    seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    return res.transpose(1, 2), lse_pad, seed, offset


def _efficient_backward(
    grad_out_,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    if grad_out_ is None:
        return None, None, None, None
    if attn_bias is not None:
        raise RuntimeError(_NOT_EMULATED.format("attn_bias"))
    g, q, k, v, o = (t.transpose(1, 2) for t in (grad_out_, query, key, value, out))
    # attention_backward.cu _efficient_attention_backward
    _expected(q.dim() == g.dim(), "query.dim() == grad_out_.dim()")
    _mem_eff_common_checks(q, k, v)
    _expected(q.size(0) == g.size(0), "query.size(0) == grad_out_.size(0)")
    _expected(q.size(1) == g.size(1), "query.size(1) == grad_out_.size(1)")
    _expected(q.size(2) == g.size(2), "query.size(2) == grad_out_.size(2)")
    _expected(v.size(3) == g.size(3), "value.size(3) == grad_out_.size(3)")
    g = g.contiguous()
    for name, t in (("query", q), ("key", k), ("value", v)):
        _check(t.stride(-1) == 1, f"{name}: last dimension must be contiguous")
    _mem_eff_dtype_checks(q, ("key", k), ("value", v), ("out", o), ("grad_out", g))
    _no_dropout(dropout_p)
    B, M, H, d = q.shape
    # kernels/cutlassB.h (sm80: aligned kernels only): launchKernel skips a kernel when
    # stride(2) % kMinimumAlignment (4 for sm80 tensor cores) is nonzero for q, k or v
    _check(all(t.stride(2) % 4 == 0 for t in (q, k, v)), "cutlassB: no kernel found to launch!")
    _check(
        tuple(o.shape) == tuple(g.shape),
        f"cuda_emulation: out {list(out.shape)} must have grad_out's shape "
        f"{list(grad_out_.shape)} (the kernel reads both with grad_out's geometry)",
    )
    if q.dtype in _HALF:
        # kernel_backward.h: fp16/bf16 kernels compute delta = rowsum(dO * O) themselves and
        # address out with o_strideM() = head_dim_value * num_heads (not out.stride(1))
        _check(
            o.stride(-1) == 1 and o.stride(1) == H * o.size(3),
            "cuda_emulation: the fp16/bf16 mem-efficient backward reads out as [B, M, H, d] "
            f"rows of H * d = {H * o.size(3)} elements (o_strideM, unchecked on CUDA); "
            f"out.transpose(1, 2) has strides {list(o.stride())}: pass the out the forward "
            "returned",
        )
    # kernel_backward.h check_supported
    lse = logsumexp
    _check(
        lse.dtype == torch.float32 and lse.dim() == 3 and tuple(lse.shape[:2]) == (B, H),
        f"cuda_emulation: logsumexp must be fp32 [B, H, >= M] = [{B}, {H}, ...] "
        f"(read as lse_scalar_t = float, unchecked on CUDA); got {lse.dtype} {list(lse.shape)}",
    )
    _check(H <= 1 or lse.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)")
    _check(B <= 1 or lse.stride(0) % 8 == 0, "LSE is not correctly aligned (strideB)")
    width = -(-M // _LSE_ALIGN) * _LSE_ALIGN
    # gemm/mma_from_smem.h B2bGemm<MmaTensorOpAccumulatorTileIterator>::accumApplyLSEToSmem
    # reads lse up to ceil_div(M, kAlignLSE) * kAlignLSE: the padded tensor the forward made
    _check(
        M == 0 or (lse.size(2) >= width and lse.stride(2) == 1),
        f"cuda_emulation: the mem-efficient backward reads logsumexp[..., :{width}] "
        f"(ceil(M / 32) * 32 for M = {M}; unchecked on CUDA); got shape {list(lse.shape)} "
        f"strides {list(lse.stride())}: pass the padded logsumexp the forward returned",
    )
    pad = lse[..., M:width]
    _check(
        not (pad.isnan().any() or (pad == float("-inf")).any()),
        "cuda_emulation: logsumexp padding past M holds NaN or -inf; the kernel would turn "
        "dK/dV into NaN (the forward writes +inf there)",
    )
    _strides_aligned((("query", q), ("key", k), ("value", v)), 4, B, H, "backward")
    dq, dk, dv = _backward_math(
        g.transpose(1, 2),
        query,
        key,
        value,
        o.transpose(1, 2),
        lse[..., :M],
        _scale(scale, d),
        is_causal,
        bottom_right=False,
    )
    # grad_q/k/v = at::empty(q_t.sizes()): contiguous [B, L, h, d], returned transposed
    grads = []
    for t, grad in ((q, dq), (k, dk), (v, dv)):
        buf = torch.empty(tuple(t.shape), dtype=t.dtype)
        buf.copy_(grad.transpose(1, 2))
        grads.append(buf.transpose(1, 2))
    return grads[0], grads[1], grads[2], None


# --- out_dtype GEMMs --------------------------------------------------------------------


def _mm_shapes(a, b, a_name):
    _check(a.dim() == 2, f"{a_name} must be a matrix, got {a.dim()}-D tensor")
    _check(b.dim() == 2, f"mat2 must be a matrix, got {b.dim()}-D tensor")
    _check(
        a.shape[1] == b.shape[0],
        f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
        f"{b.shape[0]}x{b.shape[1]})",
    )


def _out_dtype_ok(in_dtype, out_dtype):
    return out_dtype == in_dtype or (out_dtype == torch.float32 and in_dtype in _HALF)


_OUT_DTYPE_MSG = "out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs"
_OUT_TENSOR_MSG = "out_dtype must be the same as the dtype of the provided out tensor"


def _addmm_impl(out, self, mat1, mat2, beta, alpha):
    """Blas.cpp addmm_out_cuda_impl: out = beta * self + alpha * mat1 @ mat2, fp32 accumulate."""
    M, N = mat1.shape[0], mat2.shape[1]
    # AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES_AND2(Half, BFloat16, ...) around the cuBLAS call
    _check(
        mat1.dtype in (torch.float32, torch.float64, *_HALF, torch.complex64, torch.complex128),
        f"\"addmm_cuda\" not implemented for '{_name(mat1.dtype)}'",
    )
    if out is self:  # result.is_same(self): accumulate in place, no copy
        _check(out.dim() == 2, "tensors must be 2-D")
        _check(out.shape[0] == M, "self dim 0 must match mat1 dim 0")
        _check(out.shape[1] == N, "self dim 1 must match mat2 dim 1")
    else:
        if tuple(out.shape) != (M, N):  # at::native::resize_output
            if out.numel():
                warnings.warn(
                    f"An output with one or more elements was resized since it had shape "
                    f"{list(out.shape)}, which does not match the required output shape "
                    f"{[M, N]}.",
                    stacklevel=2,
                )
            out.resize_(M, N)
        if beta != 0:
            out.copy_(self.expand(M, N))  # expand_size(self, result.sizes(), "addmm")
    acc = torch.promote_types(mat1.dtype, torch.float32)
    prod = torch.matmul(mat1.to(acc), mat2.to(acc))
    # cuBLAS with beta == 0 does not read C (NaN in it does not propagate)
    result = alpha * prod + (beta * out.to(acc) if beta != 0 else 0)
    out.copy_(result)
    return out


def _mm_dtype_out(self, mat2, out_dtype, *, out):
    # Blas.cpp _mm_dtype_out_cuda
    _mm_shapes(self, mat2, "self")
    _check(out_dtype == out.dtype, _OUT_TENSOR_MSG)
    _check(self.dtype == mat2.dtype, "input dtypes must be the same")
    _check(_out_dtype_ok(self.dtype, out_dtype), _OUT_DTYPE_MSG)
    return _addmm_impl(out, out, self, mat2, beta=0, alpha=1)  # addmm_out_cuda_impl(out, out, ...)


def _mm_dtype(self, mat2, out_dtype):
    # Blas.cpp _mm_dtype_cuda: result = at::empty({self.size(0), mat2.size(1)}, out_dtype)
    _mm_shapes(self, mat2, "self")
    result = torch.empty(self.shape[0], mat2.shape[1], dtype=out_dtype)
    return _mm_dtype_out(self, mat2, out_dtype, out=result)


def _addmm_dtype_out(self, mat1, mat2, out_dtype, *, beta=1, alpha=1, out):
    # Blas.cpp _addmm_dtype_out_cuda
    _mm_shapes(mat1, mat2, "mat1")
    _check(
        mat1.dtype == mat2.dtype,
        f"mat1 and mat2 must have the same dtype, but got {_name(mat1.dtype)} and "
        f"{_name(mat2.dtype)}",
    )
    _check(_out_dtype_ok(mat1.dtype, out_dtype), _OUT_DTYPE_MSG)
    _check(out_dtype == out.dtype, _OUT_TENSOR_MSG)
    _check(
        out_dtype == self.dtype or self.dtype == mat1.dtype,
        "self dtype must match either out_dtype or mat1 dtype",
    )
    return _addmm_impl(out, self, mat1, mat2, beta, alpha)


def _addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1):
    # Blas.cpp _addmm_dtype_cuda: result = at::empty({mat1.size(0), mat2.size(1)}, out_dtype)
    _mm_shapes(mat1, mat2, "mat1")
    result = torch.empty(mat1.shape[0], mat2.shape[1], dtype=out_dtype)
    return _addmm_dtype_out(self, mat1, mat2, out_dtype, beta=beta, alpha=alpha, out=result)


_KERNELS = {
    "_scaled_dot_product_flash_attention": _flash_forward,
    "_scaled_dot_product_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_efficient_attention": _efficient_forward,
    "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
    "mm.dtype": _mm_dtype,
    "mm.dtype_out": _mm_dtype_out,
    "addmm.dtype": _addmm_dtype,
    "addmm.dtype_out": _addmm_dtype_out,
}


def install() -> None:
    """Register the CPU emulations in this process; safe to call any number of times.

    An op that already has a CPU kernel (say, registered by a second import of this file under
    another module name) is left alone, so repeated or duplicate installs never clash.
    """
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in _KERNELS.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            lib.impl(name, kernel, "CPU")
    _LIB = lib
