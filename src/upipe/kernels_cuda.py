"""upipe's calls of the CUDA attention kernels, each as its op's contract requires.

Legend: B batch, S query length, Sk key length, H query heads, G kv heads, d head dim.
upipe's layout is q `[B, S, H, d]`, k/v `[B, Sk, G, d]`; the SDPA ops take `[B, heads, len,
d]`, so every call passes transposed views (the memory stays `[B, S, heads, d]`). Each
forward returns (out `[B, S, H, d]`, lse fp32 `[B, H, S]`); each backward takes that lse.

Contracts (torch's sources; `tests/helpers/cuda_emulation.py`, `tests/helpers/cudnn_emulation.py`
and
`tests/helpers/flash_impl_emulation.py` implement them on CPU for the test suite):
- flash: aten `_scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
  return_debug_mask, *, scale)` (transformers/cuda/attention.cu, flash_attn/flash_api.cpp
  `mha_fwd`): GQA native, lse `[B, H, S]`; its backward takes cum_seq_q/k *undefined* (None)
  for a dense call -- a defined one, even empty, selects the varlen kernel
  (attention_backward.cu `_flash_attention_backward`). Under an active FA3/FA4 impl torch
  reroutes these very ops (torch/nn/attention/_fa3.py, _fa4.py `_fa*_register_kernels`) with
  the same arguments and the same lse layout (FA3's `softmax_lse`, FA4's `lse_shape = (batch,
  num_head, seqlen_q)` in flash_attn/cute/interface.py `_flash_attn_fwd`).
- efficient: aten `_scaled_dot_product_efficient_attention`: equal head counts (K/V expanded
  here for GQA), lse padded to a multiple of 32 queries (kernel_forward.h kAlignLSE), which
  its backward reads in full.
- cudnn: aten `_scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp,
  dropout_p, is_causal, return_debug_mask, *, scale)` -> (out, lse, cum_seq_q, cum_seq_k,
  max_q, max_k, philox_seed, philox_offset, debug_attn_mask), `attention.cu`
  `_scaled_dot_product_cudnn_attention_cuda` -> `_cudnn_attention_forward` (dense when
  cum_seq_q is not given) -> cudnn/MHA.cpp `run_cudnn_SDP_fprop`: out allocated like q
  (`alloc_with_matching_layout`), lse `at::empty({b, h, s_q, 1}, kFloat)` -- fp32 `[B, H, S, 1]`
  contiguous (older MHA.cpp sources allocate `{b, h, s_q}`: `torch_private.cudnn_lse_dims`
  reads which from torch's meta kernel) -- with compute_log_sumexp=True (undefined
  otherwise), philox seed/offset int64
  scalars; k/v keep their G heads (the graph takes K `[b, h_k, s_kv, d]`; cudnn-frontend
  accepts h_q % h_k == 0), causal is the top-left diagonal. Its backward
  `_scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, logsumexp,
  philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
  is_causal, *, scale)` (attention_backward.cu `_cudnn_attention_backward`): cum_seq_q
  *undefined* selects the dense path (`is_nested = cum_seq_q.defined()`; the nested one wants
  a 2-D `[H, T]` lse); max_q/max_k are the graph's s_q/s_kv; the lse is read with the strides
  it has, so it gets the forward's `[B, H, S, 1]` layout; philox seed/offset must be defined
  tensors even without dropout (run_cudnn_SDP_bprop casts them with `.to(kLong)` on sm100);
  dq/dk/dv are `empty_like` q/k/v (dk/dv with G heads). One key or one query per call (S or
  Sk == 1) has no cuDNN kernel (sdp_utils.cpp `check_cudnn_tensor_shapes`: "does not support
  key/value sequence length 1"; cudnn-frontend: "s_q = s_kv = 1 is not supported"; MHA.cpp
  `check_cudnn_sdpa_decode` refuses s_q == 1 on cuDNN 9.19-9.25 on sm10x): such calls (a
  one-token document, a document's single token in a ring block) run the efficient kernel,
  forward and backward alike.
- flash_attn: the flash-attn package (>= 2.7) `flash_attn_func` and
  `flash_attn_interface._flash_attn_backward` (`tests/helpers/fake_flash_attn.py`).

Head dims that are not a multiple of 8 (every flash kernel and cuDNN need one: "head_size
should be a multiple of 8"; only F.scaled_dot_product_attention pads, the aten ops do not)
are padded here with zero columns: q.k and the lse are unchanged (the scale is always passed
explicitly), out's padded columns are 0 and the gradients' padded columns are dropped.
"""

from __future__ import annotations

import torch

from upipe.torch_private import aten_op, cudnn_lse_dims, cudnn_sdpa_ops

HALF = (torch.float16, torch.bfloat16)


def expand_kv(t_BSGd, H):
    """Repeat each kv head for its H / G query heads: [B, S, G, d] -> [B, S, H, d]."""
    g = H // t_BSGd.shape[2]
    return t_BSGd if g == 1 else t_BSGd.repeat_interleave(g, dim=2)


def sum_kv(t_BSHd, G):
    """Inverse of `expand_kv` for gradients: sum each kv head's H / G copies."""
    B, S, H, d = t_BSHd.shape
    return t_BSHd if H == G else t_BSHd.view(B, S, G, H // G, d).sum(3)


def pad8(*ts):
    """`ts` with their last dim zero-padded to a multiple of 8 (module doc)."""
    pad = (-ts[0].shape[-1]) % 8
    return ts if pad == 0 else tuple(torch.nn.functional.pad(t, (0, pad)) for t in ts)


def unpad(d, *ts):
    return tuple(t[..., :d] if t.shape[-1] != d else t for t in ts)


def _bhsd(*ts):
    return tuple(t.transpose(1, 2) for t in ts)


# --- flash (torch's FA2, or FA3 / FA4 where activated) -------------------------------------


def flash_forward(q, k, v, causal, scale):
    d = q.shape[-1]
    res = aten_op("_scaled_dot_product_flash_attention")(
        *_bhsd(*pad8(q, k, v)), 0.0, causal, False, scale=scale
    )
    (out,) = unpad(d, res[0].transpose(1, 2))
    return out, res[1]


def flash_backward(dout, q, k, v, out, lse, causal, scale):
    S, Sk, d = q.shape[1], k.shape[1], q.shape[-1]
    # rng state: read only with dropout (mha_bwd), ignored by FA3/FA4
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = aten_op("_scaled_dot_product_flash_attention_backward")(
        *_bhsd(*pad8(dout, q, k, v, out)), lse, None, None, S, Sk, 0.0, causal, no_rng, no_rng,
        scale=scale,
    )  # fmt: skip
    return unpad(d, *_bhsd(dq, dk, dv))


# --- memory-efficient ------------------------------------------------------------------------


def efficient_forward(q, k, v, causal, scale):
    H, d = q.shape[2], q.shape[-1]
    qp, kp, vp = pad8(q, expand_kv(k, H), expand_kv(v, H))
    res = aten_op("_scaled_dot_product_efficient_attention")(
        *_bhsd(qp, kp, vp), None, True, 0.0, causal, scale=scale
    )
    (out,) = unpad(d, res[0].transpose(1, 2))
    return out, res[1][:, :, : q.shape[1]]


def efficient_backward(dout, q, k, v, out, lse, causal, scale):
    S, H, G, d = q.shape[1], q.shape[2], k.shape[2], q.shape[-1]
    dop, qp, kp, vp, op = pad8(dout, q, expand_kv(k, H), expand_kv(v, H), out)
    pad = (-S) % 32  # the kernel reads its lse padded to a multiple of 32 queries
    lse_pad = torch.nn.functional.pad(lse, (0, pad)) if pad else lse  # (finite padding)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = aten_op("_scaled_dot_product_efficient_attention_backward")(
        *_bhsd(dop, qp, kp, vp), None, op.transpose(1, 2), lse_pad, seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    dq, dk, dv = unpad(d, *_bhsd(dq, dk, dv))
    return dq, sum_kv(dk, G), sum_kv(dv, G)


# --- cuDNN ------------------------------------------------------------------------------------


def _cudnn_has_kernel(q, k) -> bool:
    return q.shape[1] > 1 and k.shape[1] > 1  # module doc: one query or key has none


def cudnn_forward(q, k, v, causal, scale):
    if not _cudnn_has_kernel(q, k):
        return efficient_forward(q, k, v, causal, scale)
    forward, _ = cudnn_sdpa_ops()
    d = q.shape[-1]
    res = forward(*_bhsd(*pad8(q, k, v)), None, True, 0.0, causal, False, scale=scale)
    (out,) = unpad(d, res[0].transpose(1, 2))
    lse = res[1]
    return out, lse[..., 0] if lse.dim() == 4 else lse  # [B, H, S, 1] -> [B, H, S] (a view)


def cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    if not _cudnn_has_kernel(q, k):
        return efficient_backward(dout, q, k, v, out, lse, causal, scale)
    _, backward = cudnn_sdpa_ops()
    S, Sk, d = q.shape[1], k.shape[1], q.shape[-1]
    philox = torch.empty((), dtype=torch.int64, device=q.device)  # module doc: defined
    lse = lse.contiguous()  # the forward's layout: [B, H, S, 1] (or [B, H, S], older torch)
    lse_BHS1 = lse.unsqueeze(-1) if cudnn_lse_dims() == 4 else lse
    dq, dk, dv = backward(
        *_bhsd(*pad8(dout, q, k, v, out)), lse_BHS1, philox, philox, None, None, None, S, Sk,
        0.0, causal, scale=scale,
    )  # fmt: skip
    return unpad(d, *_bhsd(dq, dk, dv))


# --- the flash-attn package -------------------------------------------------------------------


def flash_attn_forward(q, k, v, causal, scale):
    import flash_attn

    d = q.shape[-1]
    out, lse, _ = flash_attn.flash_attn_func(
        *pad8(q, k, v), softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    (out,) = unpad(d, out)
    return out, lse


def flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward as fa_backward

    d = q.shape[-1]
    dop, qp, kp, vp, op = pad8(dout, q, k, v, out)
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
    return unpad(d, dq, dk, dv)


FORWARD = {
    "flash": flash_forward,
    "fa3": flash_forward,
    "fa4": flash_forward,
    "efficient": efficient_forward,
    "cudnn": cudnn_forward,
    "flash_attn": flash_attn_forward,
}
BACKWARD = {
    "flash": flash_backward,
    "fa3": flash_backward,
    "fa4": flash_backward,
    "efficient": efficient_backward,
    "cudnn": cudnn_backward,
    "flash_attn": flash_attn_backward,
}


def backward_workspace_bytes(
    kernel: str, B: int, S: int, Sk: int, H: int, G: int, d: int, itemsize
):
    """Bytes the backward kernel allocates besides dq/dk/dv, for the planner (`upipe plan`):

        flash, flash_attn (FA2, flash_api.cpp mha_bwd): fp32 dq accumulator [B, S, H, d],
            and with GQA dk and dv expanded to the query heads [B, Sk, H, d] in q's dtype
            = 4 B S H d + 2 itemsize B Sk H d [G < H]
        cudnn (cudnn-frontend CompositeSDPABackwardNode, get_fe_workspace_size_node): fp32
            dQ_accum [B, H, S, d] and softmax_sum [B, H, S]; dK/dV of the query heads stay
            virtual in the dense graph (no workspace) = 4 B H S d + 4 B H S
        fa3 (hopper/flash_api.cpp mha_bwd), fa4 (flash_attn/cute/interface.py
            _flash_attn_bwd): fp32 dq_accum [B, H, S, d], softmax_d / dpsum and lse_log2
            [B, H, S], and with GQA fp32 dk_accum and dv_accum [B, G, Sk, d]
            = 4 B H S d + 8 B H S + 8 B G Sk d [G < H]
        efficient: not read here; charged as flash (an assumption)
    (FA2, FA3 and FA4 round S and d up to their tile sizes; not counted.) `auto` is charged
    as flash: for GQA with H / G >= 4 (every preset) the largest of the kernels auto picks."""
    rows, gqa = B * H * S, G < H
    if kernel == "cudnn":
        return 4 * rows * d + 4 * rows
    if kernel in ("fa3", "fa4"):
        return 4 * rows * d + 8 * rows + (8 * B * G * Sk * d if gqa else 0)
    return 4 * rows * d + (2 * itemsize * B * Sk * H * d if gqa else 0)
