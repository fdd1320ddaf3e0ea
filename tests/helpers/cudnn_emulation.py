"""CPU emulation of torch's cuDNN attention ops, held to their CUDA contract.

`install()` registers CPU kernels (``torch.library``, dispatch key CPU) for
``aten::_scaled_dot_product_cudnn_attention`` and its backward, so `backend="cudnn"` runs
in the tests and fails wherever a GPU would. Read from torch's sources (2.13's op schemas;
the CUDA side from the newest sources at hand) and NVIDIA's cudnn-frontend, cited at each
rule; where CUDA does not check but would misread memory, the emulation raises and says
so ("unchecked on CUDA"). Numbers are fp32 math on the full score matrix (tiny shapes).
Dropout and attention bias are not emulated (RuntimeError).

Legend: B batch, H query heads, G kv heads, M query length, N key length, d head dim.
The ops take ``[B, heads, len, d]``.

1. ``_scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p,
   is_causal, return_debug_mask, *, scale)`` -- transformers/cuda/attention.cu
   ``_scaled_dot_product_cudnn_attention_cuda`` -> ``_cudnn_attention_forward`` (dense:
   no cum_seq) -> cudnn/MHA.cpp ``run_cudnn_SDP_fprop`` / ``build_graph``:
   - the graph's io type is HALF unless q is bf16 (``build_graph``): q, k, v must be one of
     fp16/bf16 and alike (anything else is misread; unchecked on CUDA);
   - Q ``[b, h, s_q, d]``, K/V ``[b, h_k, s_kv, d]`` with their own strides, the last one 1
     (cudnn-frontend "The stride for the last dimension ... should be 1");
     h_q % h_k == 0 (cudnn-frontend: "For group-query attention, number of heads for key and
     query must be a factor of number of heads for query"): GQA native;
   - d % 8 == 0, d <= 128, or <= 256 on sm90 with cuDNN >= 9.10 (sdp_utils.cpp
     ``check_cudnn_tensor_shapes``; cudnn-frontend ``CompositeSDPABackwardNode``: "Num
     hidden_dim should be less than or equal to 128 and hidden_dim should be multiple of 8");
     the emulated GPU is `ARCH` with cuDNN `CUDNN_VERSION`;
   - one key or one query has no kernel (sdp_utils "cudnn SDPA does not support key/value
     sequence length 1"; frontend "s_q = s_kv = 1 is not supported"; MHA.cpp
     ``check_cudnn_sdpa_decode``: s_q == 1 refused on cuDNN 9.19-9.25 on sm10x);
   - 16-byte aligned base addresses and strides (the kernels load through TMA on sm90+;
     misaligned addresses fault: unchecked on CUDA);
   - causal masks the top-left diagonal (``CausalMask::TOP_LEFT``);
   - returns (out allocated like q -- ``alloc_with_matching_layout``, which is
     ``empty_like(q)`` for out's shape -- , lse ``at::empty({b, h, s_q, 1}, kFloat)``: fp32
     ``[B, H, M, 1]`` contiguous, *undefined* without compute_log_sumexp, cum_seq_q/k
     undefined, M, N, philox seed/offset int64 ``[]``, debug mask undefined).
2. ``_scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, logsumexp,
   philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
   is_causal, *, scale)`` -- attention_backward.cu ``_cudnn_attention_backward`` ->
   MHA.cpp ``run_cudnn_SDP_bprop``:
   - ``is_nested = cum_seq_q.defined()``: a defined cum_seq_q (an empty tensor is defined)
     takes the nested path, whose ``run_cudnn_SDP_bprop_nestedtensor`` wants a 2-D lse
     ("cuDNN SDPA expected a 2D (H, T) softmax_lse");
   - philox seed/offset are ``.to(kLong)``-ed on sm100 even without dropout: undefined ones
     crash there (unchecked elsewhere);
   - the graph reads Stats with the lse's own sizes and strides: fp32 ``[B, H, M, 1]``
     contiguous, the forward's layout (MHA.cpp only ever makes that one: "TODO(eqy):
     investigate why cuDNN doesn't like BSH layout softmaxstats");
   - max_q / max_k are the graph's s_q / s_kv: they must be M and N (unchecked on CUDA);
   - dtypes, heads, head dims, lengths and alignment as the forward (out and grad_out too);
   - dq, dk, dv ``empty_like`` q, k, v (dk/dv with G heads).
"""

from __future__ import annotations

import collections

import torch
from cuda_emulation import _HALF, _backward_math, _check, _forward_math, _no_dropout, _scale

__all__ = ["install"]

ARCH = (9, 0)  # the emulated GPU (H200, as the project's GPU machine)
CUDNN_VERSION = 91100
_LIB: torch.library.Library | None = None
CALLS = collections.Counter()  # kernel calls in this process ("forward", "backward")
_NOT_EMULATED = "cudnn_emulation: {} is not emulated"
_UNCHECKED = "cudnn_emulation: {} (unchecked on CUDA)"


def head_dim_limit() -> int:
    return 256 if ARCH == (9, 0) and CUDNN_VERSION >= 91000 else 128


def _common(q, k, v, attn_bias, dropout_p, tensors):
    """The checks forward and backward share, on ``[B, heads, len, d]`` inputs."""
    if attn_bias is not None:
        raise RuntimeError(_NOT_EMULATED.format("attn_bias"))
    _no_dropout(dropout_p)
    _check(
        all(t.dim() == 4 for t in (q, k, v)),
        "Q tensor has unexpected number of dims, please report a bug to PyTorch.",
    )
    _check(
        q.dtype in _HALF and all(t.dtype == q.dtype for _, t in tensors),
        _UNCHECKED.format(
            f"the graph's io type is {'BFLOAT16' if q.dtype == torch.bfloat16 else 'HALF'}, but "
            f"the tensors are {[str(t.dtype) for _, t in tensors]}: misread"
        ),
    )
    for name, t in tensors:
        _check(
            t.stride(-1) == 1,
            "The stride for the last dimension corresponding to the embedding size per head "
            f"should be 1 for {name}",
        )
    B, H, M, d = q.shape
    G, N = k.shape[1], k.shape[2]
    _check(tuple(k.shape) == (B, G, N, d) and k.shape == v.shape, "k/v must be [B, G, N, d]")
    _check(
        H % G == 0,
        "For group-query attention, number of heads for key and query must be a factor of "
        "number of heads for query",
    )
    limit = head_dim_limit()
    _check(
        d % 8 == 0 and d <= limit,
        f"Num hidden_dim should be less than or equal to {limit} and hidden_dim should be "
        "multiple of 8",
    )
    _check(
        M > 1 and N > 1,
        "cudnn_emulation: one query or key (s_q == 1 or s_kv == 1) has no cuDNN kernel "
        "(sdp_utils check_cudnn_tensor_shapes; cudnn-frontend 's_q = s_kv = 1 is not "
        "supported'; decode refused on cuDNN 9.19-9.25 sm10x)",
    )
    for name, t in tensors:  # (the graph's checks above come first, then the launch)
        _check(
            t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]),
            _UNCHECKED.format(f"{name} is not 16-byte aligned (misaligned address)"),
        )
    return B, H, M, N, d


def _forward(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    tensors = (("Q", query), ("K", key), ("V", value))
    B, H, M, N, d = _common(query, key, value, attn_bias, dropout_p, tensors)
    CALLS["forward"] += 1
    out, lse = _forward_math(query, key, value, _scale(scale, d), is_causal, bottom_right=False)
    res = torch.empty_like(query)  # alloc_with_matching_layout: out's shape is q's
    res.copy_(out)
    lse_BHM1 = None
    if compute_log_sumexp:
        lse_BHM1 = torch.empty(B, H, M, 1, dtype=torch.float32)
        lse_BHM1.copy_(lse[..., None])
    seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
    return res, lse_BHM1, None, None, M, N, seed, offset, None


def _backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    if cum_seq_q is not None:  # _cudnn_attention_backward: is_nested = cum_seq_q.defined()
        _check(logsumexp.dim() == 2, "cuDNN SDPA expected a 2D (H, T) softmax_lse")
        raise RuntimeError(_NOT_EMULATED.format("the nested (varlen) cuDNN backward"))
    _check(
        philox_seed is not None and philox_offset is not None,
        _UNCHECKED.format(
            "philox_seed/philox_offset are undefined: run_cudnn_SDP_bprop calls .to(kLong) on "
            "them on sm100 even without dropout, which crashes there"
        ),
    )
    tensors = (("Q", query), ("K", key), ("V", value), ("O", out), ("dO", grad_out))
    B, H, M, N, d = _common(query, key, value, attn_bias, dropout_p, tensors)
    _check(out.shape == query.shape and grad_out.shape == query.shape, "O/dO must be like Q")
    lse = logsumexp
    _check(
        lse.dtype == torch.float32 and tuple(lse.shape) == (B, H, M, 1) and lse.is_contiguous(),
        _UNCHECKED.format(
            f"the backward graph reads Stats as given; the forward's layout is contiguous fp32 "
            f"[B, H, M, 1] = {[B, H, M, 1]}, got {lse.dtype} {list(lse.shape)} strides "
            f"{list(lse.stride())}"
        ),
    )
    _check(
        (max_q, max_k) == (M, N),
        _UNCHECKED.format(f"max_q/max_k are the graph's s_q/s_kv {(M, N)}, got {(max_q, max_k)}"),
    )
    CALLS["backward"] += 1
    dq, dk, dv = _backward_math(
        grad_out, query, key, value, out, lse[..., 0], _scale(scale, d), is_causal, False
    )
    grads = []
    for like, g in ((query, dq), (key, dk), (value, dv)):
        buf = torch.empty_like(like)
        buf.copy_(g)
        grads.append(buf)
    return tuple(grads)


def install() -> None:
    """Register the CPU emulations in this process; safe to call any number of times."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in (
        ("_scaled_dot_product_cudnn_attention", _forward),
        ("_scaled_dot_product_cudnn_attention_backward", _backward),
    ):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            lib.impl(name, kernel, "CPU")
    _LIB = lib
