"""A Llama-style attention layer in JAX (plain functions): q/k/v projections, RoPE,
context-parallel attention, o_proj, on this device's shard of the sequence.

Legend: B batch, L local tokens, S = C * L, D model width, H query heads, G kv heads,
d head dim, C size of the mesh axis, U heads per stage, N = H*d.

Parameters are a dict in `torch.nn.Linear` layout with Hugging Face names, so PyTorch
weights (`upipe.ContextParallelAttention`, Llama checkpoints) load unchanged:
q_proj [H*d, D], k_proj / v_proj [G*d, D], o_proj [D, H*d]; no biases.

RoPE, Hugging Face's "rotate half" convention (as `upipe.rope`):
    inv_freq_i = theta^(-2i/d),  angle = position * inv_freq,  cos/sin = cos/sin([angle, angle])
    rope(x) = x * cos + [-x2, x1] * sin     (x = [x1, x2], halves of the head dim)

"ulysses": projections and RoPE for all heads, `ulysses_attention`, o_proj.
"upipe": the projections are fused into the stages (as `upipe.attention.fused`). Per round
r and stage s (`attention.StageGrid`):
    k, v = rope(x W_k[kv heads of r]^T), x W_v[kv heads of r]^T   --seq_to_head-->
    q = rope(x W_q[heads of (r, s)]^T)                             --seq_to_head-->
    y += head_to_seq(attention(q, k, v)) W_o[:, heads of (r, s)]^T   (fp32 accumulator)
so full-head q/k/v and the full attention output never exist; backward keeps x, the
weights and each stage's attention output and log-sum-exp (`attention.POLICY`) and
recomputes the projections, RoPE and exchanges.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from upipe.jax.attention import StageGrid, run_stages, ulysses_attention
from upipe.jax.comm import head_to_seq, seq_to_head
from upipe.jax.kernel import attention

STRATEGIES = ("ulysses", "upipe")


def rope_cos_sin(positions_BL, head_dim, *, theta=10000.0, dtype=jnp.float32):
    """cos, sin `[B, L, d]` for global positions (computed in fp32, then cast)."""
    inv_freq = theta ** -(jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angle_BLi = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    angle_BLd = jnp.concatenate([angle_BLi, angle_BLi], axis=-1)
    return jnp.cos(angle_BLd).astype(dtype), jnp.sin(angle_BLd).astype(dtype)


def apply_rope(x_BLnd, cos_BLd, sin_BLd):
    """Rotate x `[B, L, n, d]` by the angles of cos/sin `[B, L, d]`."""
    x1, x2 = jnp.split(x_BLnd, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_BLnd * cos_BLd[:, :, None] + rotated * sin_BLd[:, :, None]


def _check(params, x_BLD, positions_BL, head_dim, strategy) -> tuple[int, int]:
    """(H, G) from the parameter shapes, or a ValueError naming the numbers."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    D = x_BLD.shape[-1] if x_BLD.ndim == 3 else None
    if D is None or positions_BL.shape != x_BLD.shape[:2]:
        raise ValueError(
            f"x must be [B, L, D] and positions [B, L]; got {x_BLD.shape}, {positions_BL.shape}"
        )
    if not jnp.issubdtype(positions_BL.dtype, jnp.integer):
        raise ValueError(f"positions must be integers, got {positions_BL.dtype}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary embeddings), got {head_dim}")
    shapes = {n: tuple(params[n].shape) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    N, GD = shapes["q_proj"][0], shapes["k_proj"][0]
    ok = (
        N % head_dim == 0
        and GD % head_dim == 0
        and shapes["q_proj"] == (N, D)
        and shapes["k_proj"] == shapes["v_proj"] == (GD, D)
        and shapes["o_proj"] == (D, N)
    )
    if not ok:
        raise ValueError(
            f"parameters must be q_proj [H*d, D], k_proj/v_proj [G*d, D], o_proj [D, H*d] "
            f"with D = {D}, d = {head_dim}; got {shapes}"
        )
    return N // head_dim, GD // head_dim


def attention_layer(
    params,
    x_BLD,
    positions_BL,
    *,
    axis_name,
    head_dim,
    strategy="upipe",
    heads_per_stage=None,
    causal=True,
    rope_theta=10000.0,
    block_size=512,
):
    """y `[B, L, D]` of the attention layer on this device's tokens x `[B, L, D]` at global
    positions `[B, L]` (call inside `shard_map`, the sequence split contiguously over
    `axis_name`). `strategy` "upipe" (default; `heads_per_stage` U, default C) or
    "ulysses"."""
    H, G = _check(params, x_BLD, positions_BL, head_dim, strategy)
    B, L, D = x_BLD.shape
    d = head_dim
    cos, sin = rope_cos_sin(positions_BL, d, theta=rope_theta, dtype=x_BLD.dtype)
    wq_HdD, wk_GdD, wv_GdD = (params[n].reshape(-1, d, D) for n in ("q_proj", "k_proj", "v_proj"))
    wo_DHd = params["o_proj"].reshape(D, H, d)

    def project(w_ndD):
        return jnp.einsum("blD,ndD->blnd", x_BLD, w_ndD)

    kernel = dict(causal=causal, block_size=block_size)
    if strategy == "ulysses":
        q, k = apply_rope(project(wq_HdD), cos, sin), apply_rope(project(wk_GdD), cos, sin)
        out_BLHd = ulysses_attention(q, k, project(wv_GdD), axis_name=axis_name, **kernel)
        return jnp.einsum("blhd,Dhd->blD", out_BLHd, wo_DHd)
    grid = StageGrid.plan(H, G, lax.axis_size(axis_name), heads_per_stage)

    def kv_of_round(r):
        k_BLkd = apply_rope(project(grid.take_kv(wk_GdD, 0, r)), cos, sin)
        v_BLkd = project(grid.take_kv(wv_GdD, 0, r))
        return seq_to_head(k_BLkd, axis_name), seq_to_head(v_BLkd, axis_name)

    def stage(y_BLD, r, s, kv):
        q_BSud = seq_to_head(apply_rope(project(grid.take_q(wq_HdD, 0, r, s)), cos, sin), axis_name)
        out_BLUd = head_to_seq(attention(q_BSud, *kv, **kernel), axis_name)
        wo_DUd = grid.take_q(wo_DHd, 1, r, s)
        acc = dict(preferred_element_type=y_BLD.dtype)
        return y_BLD + jnp.einsum("blud,Dud->blD", out_BLUd, wo_DUd, **acc)

    y32_BLD = jnp.zeros_like(x_BLD, jnp.promote_types(x_BLD.dtype, jnp.float32))
    return run_stages(y32_BLD, grid, kv_of_round, stage).astype(x_BLD.dtype)
