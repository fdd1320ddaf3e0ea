"""The Gated DeltaNet layer's scan in a simulated step on CUDA: the memory of
flash-linear-attention's chunk kernel, and its FLOPs.

On a GPU upipe runs the chunked gated delta rule with fla's `chunk_gated_delta_rule` where
flash-linear-attention is installed (`upipe.kernels_deltanet`); the planner plans that path
(`upipe plan --device cuda`, the default; with --device cpu it plans upipe's own scan,
`upipe.kernels_delta_rule`, its loops cut short by `upipe.planner.sampled`). fla's kernels
are Triton: they cannot run here, and nothing of them is needed but what they allocate.
`fla_kernels()` puts `DeltaRuleMemory` in fla's place for a simulated step: an autograd
Function that allocates, frees and saves for backward the tensors of
`ChunkGatedDeltaRuleFunction` in the order its Python code does (read from
fla-org/flash-linear-attention, fla/ops/gated_delta_rule/chunk.py and the functions it calls,
at commit 92396f2, the contract `upipe.kernels_deltanet` was written against), computing
nothing:

forward (q, k `[B, T, h, d]`, v `[B, T, h, e]` in dtype X; g `[B, T, h]` fp32, beta
`[B, T, h]`; NT = ceil(T / 64) chunks):
- `input_guard`: a contiguous copy of each non-contiguous input, held until forward returns;
- `l2norm_fwd` of q and k: q', k' (X) and their fp32 rstd `[B T h]` (saved);
- `chunk_local_cumsum(g)`: g' fp32 (saved);
- `chunk_scaled_dot_kkt_fwd`: A `[B, T, h, 64]` fp32, then `solve_tril` -> A' in X (saved;
  the fp32 A freed);
- `recompute_w_u_fwd`: w (as k), u (as v); `chunk_gated_delta_rule_fwd_h`: the chunk states
  h `[B, NT, h, d, e]` in X and v_new (as u); `chunk_fwd_o`: o (as v) -- w, u, h and v_new
  are freed when `chunk_gated_delta_rule_fwd` returns;
- saved: q', q_rstd, k', k_rstd, v, g', beta, A'. Returns o.

backward (do as v):
- `recompute_w_u_fwd` (w, u) and `chunk_gated_delta_rule_fwd_h` (h, v_new) again;
  `chunk_bwd_dv_local`: dv; `chunk_gated_delta_rule_bwd_dhu`: dh (as h) and dv2 (as dv; the
  first dv freed when it is rebound); `chunk_bwd_dqkwg`: dq, dk, dw and an fp32 dg per
  64-wide block of d (`[ceil(d / 64), B, T, h]`, summed into dg `[B, T, h]`);
  `prepare_wy_repr_bwd`: dk2, dv3, db, dg2 (dv2 freed on rebinding); `chunk_local_cumsum`
  of dg (reverse): a new fp32 dg; all locals of `chunk_gated_delta_rule_bwd` freed when it
  returns;
- `l2norm_bwd` of dq and dk: new dq, dk (the old ones freed on rebinding). Returns dq, dk,
  dv, dg (fp32), db.
fla's allocations are all of this kind (`torch.empty` / `zeros` of these shapes in Python,
none inside the kernels); Triton's and the autotuner's own scratch are not counted.

FLOPs (`forward_flops`, `backward_flops`): the matrix products of the chunked algorithm
(Yang, Kautz, Hatamizadeh, "Gated Delta Networks", 2024; fla's kernels) per head and chunk
of C = 64 tokens, key dim d, value dim e; elementwise work (decays, gates, norms) is left
out:

    forward:  A = (beta K) K^T              2 C^2 d    (chunk_scaled_dot_kkt)
              (I + A)^-1                    C^3 / 3 multiply-adds  (solve_tril)
              w = A' (beta e^g K), u = A' (beta V)             2 C^2 d + 2 C^2 e
              v_new = u - w h, h' = e^g h + K^T v_new          4 C d e   (the state)
              o = e^g Q h + (Q K^T * M) v_new                  2 C d e + 2 C^2 d + 2 C^2 e
            = 6 C^2 d + 4 C^2 e + 6 C d e + (2/3) C^3
    backward: w, u and the states again                        2 C^2 (d + e) + 4 C d e
              dv (local) = (Q K^T * M)^T do                    2 C^2 d + 2 C^2 e
              dh recurrence, dv2 = dv + K dh                   6 C d e
              dq, dk, dw (states and intra-chunk)              6 C d e + 4 C^2 d + 2 C^2 e
              through w, u and A' (WY backward)                8 C^2 d + 4 C^2 e + 4 C^3
            = 16 C^2 d + 10 C^2 e + 16 C d e + 4 C^3

per chunk and head (the backward's last line: dA' from dw, du (2 C^2 (d + e)), dk_beta and
dv_beta through A'^T (2 C^2 (d + e)), dA = -A'^T dA' A'^T (4 C^3), dk through A (4 C^2 d)).
The time model (`upipe.planner.timing`) times them at the GPU's dense GEMM rate: a lower
bound for Triton kernels (not measured on a GPU).

Legend: B batch, T tokens of the call, h heads, d key and e value head dims, NT chunks, X
the inputs' dtype.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

CHUNK = 64  # fla's chunk size (BT) for the gated delta rule
_FP32 = torch.float32


def _chunks(T: int) -> int:
    return -(-T // CHUNK)


def forward_flops(B: int, T: int, h: int, d: int, e: int) -> int:
    """FLOPs of fla's chunked gated delta rule forward (module doc)."""
    C = CHUNK
    per_chunk = 6 * C * C * d + 4 * C * C * e + 6 * C * d * e + 2 * C**3 // 3
    return B * h * _chunks(T) * per_chunk


def backward_flops(B: int, T: int, h: int, d: int, e: int) -> int:
    """FLOPs of its backward (module doc)."""
    C = CHUNK
    per_chunk = 16 * C * C * d + 10 * C * C * e + 16 * C * d * e + 4 * C**3
    return B * h * _chunks(T) * per_chunk


def _account(kind: str, flops: int) -> None:
    """Where the FLOPs of each call go: nowhere, unless `upipe.planner.timing` counts them
    (it patches this function)."""


def _l2norm_fwd(x):
    """`fla.modules.l2norm.l2norm_fwd`'s allocations: y as x, fp32 rstd per row."""
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=_FP32)


class DeltaRuleMemory(torch.autograd.Function):
    """The memory of fla's `ChunkGatedDeltaRuleFunction` (module doc), values not computed."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, l2norm):
        # input_guard: contiguous copies, held by its wrapper until forward returns
        held = q, k, v, g, beta = tuple(t.contiguous() for t in (q, k, v, g, beta))
        (B, T, h, d), e = q.shape, v.shape[-1]
        q_rstd = k_rstd = None
        if l2norm:
            q, q_rstd = _l2norm_fwd(q)
            k, k_rstd = _l2norm_fwd(k)
        g = torch.empty_like(g, dtype=_FP32)  # chunk_local_cumsum
        A = q.new_empty(B, T, h, CHUNK, dtype=_FP32)  # chunk_scaled_dot_kkt_fwd
        A = torch.zeros_like(A, dtype=k.dtype)  # solve_tril (the fp32 A freed)
        w, u = torch.empty_like(k), torch.empty_like(v)  # recompute_w_u_fwd
        states = k.new_empty(B, _chunks(T), h, d, e)  # chunk_gated_delta_rule_fwd_h
        v_new = torch.empty_like(u)
        o = torch.empty_like(v_new)  # chunk_fwd_o
        del w, u, states, v_new, held  # (chunk_gated_delta_rule_fwd returns; then forward)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A)
        ctx.l2norm = l2norm
        _account("forward", forward_flops(B, T, h, d, e))
        return o

    @staticmethod
    def backward(ctx, do):
        q, q_rstd, k, k_rstd, v, g, beta, A = ctx.saved_tensors
        do = do.contiguous()  # input_guard
        (B, T, h, d), e = q.shape, v.shape[-1]
        # chunk_gated_delta_rule_bwd: its locals live until it returns
        w, u = torch.empty_like(k), torch.empty_like(v)  # recompute_w_u_fwd
        states = k.new_empty(B, _chunks(T), h, d, e)  # chunk_gated_delta_rule_fwd_h
        v_new = torch.empty_like(u)
        dv = torch.empty_like(do)  # chunk_bwd_dv_local
        dh = torch.empty_like(states)  # chunk_gated_delta_rule_bwd_dhu (q.new_empty)
        dv = torch.empty_like(dv)  # its dv2 (the first dv freed on rebinding)
        dq, dk = torch.empty_like(q), torch.empty_like(k)  # chunk_bwd_dqkwg
        blocks = -(-d // 64)  # NK: 64-wide blocks of d (CONST_TILING 64 on H100 / H200)
        dg_blocks = g.new_empty(blocks, *g.shape, dtype=_FP32)
        dw = torch.empty_like(w)
        dg = dg_blocks.sum(0)
        del dg_blocks
        dk2, dv3 = torch.empty_like(k), torch.empty_like(v)  # prepare_wy_repr_bwd
        db, dg2 = torch.empty_like(beta), torch.empty_like(g)
        dv = dv3  # (dv2 freed)
        del dv3
        dg = torch.empty_like(dg, dtype=_FP32)  # chunk_local_cumsum(dg, reverse=True)
        del w, u, states, v_new, dh, dw, dk2, dg2  # (chunk_gated_delta_rule_bwd returns)
        if ctx.l2norm:  # l2norm_bwd: dx as y
            dq = torch.empty_like(q)
            dk = torch.empty_like(k)
        _account("backward", backward_flops(B, T, h, d, e))
        return dq, dk, dv, dg, db, None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None):  # fmt: skip
    """fla's `chunk_gated_delta_rule` as upipe calls it (`upipe.kernels_deltanet.Scan`: no
    initial or final state; `cu_seqlens` with B = 1, which changes no allocation where the
    documents are whole chunks): (o, None), with fla's memory (`DeltaRuleMemory`)."""
    if initial_state is not None or output_final_state:
        raise ValueError("the simulated fla kernel runs without initial or final states")
    return DeltaRuleMemory.apply(q, k, v, g, beta, use_qk_l2norm_in_kernel), None


def fla_kernels():
    """Within the block the Gated DeltaNet layers scan with fla (`resolve_scan_backend`
    answers "fla" for the automatic choice, as on CUDA where fla is installed), whose kernel
    is `chunk_gated_delta_rule` above."""
    import upipe.attention.deltanet as layer
    import upipe.kernels_deltanet as kernels

    def on_cuda(backend, device):
        return "fla" if backend is None else kernels.resolve_scan_backend(backend, device)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(layer, "resolve_scan_backend", on_cuda))
    fla = mock.patch.object(kernels, "fla_chunk_gated_delta_rule", lambda: chunk_gated_delta_rule)
    stack.enter_context(fla)
    return stack
