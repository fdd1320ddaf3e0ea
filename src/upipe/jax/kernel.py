"""Local attention for `upipe.jax`: blockwise forward and backward from the log-sum-exp.

Legend: B batch, S tokens (the full sequence, after the all-to-all), n query heads, k kv
heads, g = n / k query heads per kv head (query head i uses kv head i // g), d head dim,
b tokens per block, T = S / b blocks.

FlashAttention-2's algorithm (arXiv 2307.08691, algorithms 1 and 2) in `lax` loops, so that
memory stays O(S * d + b * b) per head instead of O(S * S), forward and backward. Forward,
per query block i over key blocks j (j <= i when causal), in fp32 (fp64 for fp64 inputs):
    s = scale * q_i k_j^T,   m' = max(m, rowmax s),   p = exp(s - m')
    z = z * exp(m - m') + rowsum p,   o = o * exp(m - m') + p v_j
    out_i = o / z,   lse_i = m + log z
Backward, with delta_i = rowsum(dout_i * out_i), per key block j over query blocks i:
    p = exp(scale * q_i k_j^T - lse_i),   dv_j += p^T dout_i,   dp = dout_i v_j^T
    ds = p * (dp - delta_i),   dq_i += scale * ds k_j,   dk_j += scale * ds^T q_i
The `custom_vjp` keeps q, k, v, out and lse for backward; out and lse are named
(`OUT`, `LSE`) so that a `jax.checkpoint` policy can keep them while recomputing the rest.

Why not a library kernel: `jax.nn.dot_product_attention` (implementation "xla", the only one
on CPU) builds the [B, n, S, S] logits -- 1 GiB per head at S = 16K in fp32 -- and its
autodiff keeps the probabilities; "cudnn" and the Pallas flash kernels
(`jax.experimental.pallas.ops.gpu` / `.tpu`) need a GPU or TPU. On one device it is the
tests' reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

OUT = "upipe_attention_out"
LSE = "upipe_attention_lse"


def block_for(S: int, block_size: int) -> int:
    """The block length: the largest divisor of S that is at most `block_size`."""
    return max(b for b in range(1, min(S, block_size) + 1) if S % b == 0)


def attention(q_BSnd, k_BSkd, v_BSkd, *, causal=True, scale=None, block_size=512):
    """softmax(scale * q k^T [+ causal mask]) v per head, GQA (k divides n); `[B, S, n, d]`
    out. scale defaults to d^-1/2; blocks of `block_for(S, block_size)` tokens."""
    scale = q_BSnd.shape[-1] ** -0.5 if scale is None else float(scale)
    return _attention(q_BSnd, k_BSkd, v_BSkd, causal, scale, block_for(q_BSnd.shape[1], block_size))


def _acc(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _blocks(t, b):
    """[B, S, ...] -> [B, T, b, ...] (a view)."""
    return t.reshape(t.shape[0], -1, b, *t.shape[2:])


def _block(t_BT, i):
    return lax.dynamic_index_in_dim(t_BT, i, axis=1, keepdims=False)


def _scores(q_bkgd, k_bkd, scale, causal, i, j):
    """scale * q_i k_j^T `[B, k, g, b, b]` in the accumulation dtype, -inf where masked."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q_bkgd, k_bkd, preferred_element_type=_acc(q_bkgd.dtype))
    s = s * scale
    if causal:  # global query i*b + r sees keys up to itself
        b = s.shape[-1]
        keep = (i * b + jnp.arange(b))[:, None] >= (j * b + jnp.arange(b))[None, :]
        s = jnp.where(keep, s, -jnp.inf)
    return s


def _forward(q_BSnd, k_BSkd, v_BSkd, causal, scale, b):
    B, S, n, d = q_BSnd.shape
    k, T, acc = k_BSkd.shape[2], S // b, _acc(q_BSnd.dtype)
    q_BTbkgd = _blocks(q_BSnd.reshape(B, S, k, n // k, d), b)
    k_BTbkd, v_BTbkd = _blocks(k_BSkd, b), _blocks(v_BSkd, b)

    def query_block(i, carry):
        out_BTbkgd, lse_BkgTb = carry
        q_i = _block(q_BTbkgd, i)

        def key_block(j, state):
            m, z, o = state
            s = _scores(q_i, _block(k_BTbkd, j), scale, causal, i, j)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            c = jnp.exp(m - m_new)
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", p, _block(v_BTbkd, j), preferred_element_type=acc)
            return m_new, z * c + p.sum(-1), o * c[..., None] + pv

        stats = jnp.full_like(q_i, -jnp.inf, acc, shape=(B, k, n // k, b))
        init = (stats, jnp.zeros_like(stats), jnp.zeros_like(q_i, acc, (*stats.shape, d)))
        m, z, o = lax.fori_loop(0, i + 1 if causal else T, key_block, init)
        o_bkgd = (o / z[..., None]).transpose(0, 3, 1, 2, 4).astype(q_BSnd.dtype)
        out_BTbkgd = lax.dynamic_update_index_in_dim(out_BTbkgd, o_bkgd, i, axis=1)
        lse_BkgTb = lax.dynamic_update_index_in_dim(lse_BkgTb, m + jnp.log(z), i, axis=3)
        return out_BTbkgd, lse_BkgTb

    init = (jnp.zeros_like(q_BTbkgd), jnp.zeros_like(q_BTbkgd, acc, (B, k, n // k, T, b)))
    out_BTbkgd, lse_BkgTb = lax.fori_loop(0, T, query_block, init)
    return out_BTbkgd.reshape(B, S, n, d), lse_BkgTb


def _backward(dout_BSnd, q_BSnd, k_BSkd, v_BSkd, out_BSnd, lse_BkgTb, causal, scale, b):
    B, S, n, d = q_BSnd.shape
    k, T, acc = k_BSkd.shape[2], S // b, _acc(q_BSnd.dtype)
    split = lambda t: _blocks(t.reshape(B, S, k, n // k, d), b)  # noqa: E731
    q_BTbkgd, dout_BTbkgd = split(q_BSnd), split(dout_BSnd)
    k_BTbkd, v_BTbkd = _blocks(k_BSkd, b), _blocks(v_BSkd, b)
    out_BTbkgd = split(out_BSnd)
    delta_BkgTb = jnp.einsum(
        "btqhgd,btqhgd->bhgtq", dout_BTbkgd, out_BTbkgd, preferred_element_type=acc
    )
    stats_BkgTb = (lse_BkgTb, delta_BkgTb)

    def key_block(j, carry):
        dq_BTbkgd, dk_BTbkd, dv_BTbkd = carry
        k_j, v_j = _block(k_BTbkd, j), _block(v_BTbkd, j)

        def query_block(i, state):
            dq_BTbkgd, dk, dv = state
            q_i, dout_i = _block(q_BTbkgd, i), _block(dout_BTbkgd, i)
            lse_i, delta_i = (lax.dynamic_index_in_dim(t, i, 3, False) for t in stats_BkgTb)
            p = jnp.exp(_scores(q_i, k_j, scale, causal, i, j) - lse_i[..., None])
            dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p, dout_i, preferred_element_type=acc)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", dout_i, v_j, preferred_element_type=acc)
            ds = p * (dp - delta_i[..., None]) * scale
            dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds, q_i, preferred_element_type=acc)
            dq_i = _block(dq_BTbkgd, i) + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j)
            return lax.dynamic_update_index_in_dim(dq_BTbkgd, dq_i, i, axis=1), dk, dv

        init = (dq_BTbkgd, jnp.zeros_like(k_j, acc), jnp.zeros_like(k_j, acc))
        dq_BTbkgd, dk, dv = lax.fori_loop(j if causal else 0, T, query_block, init)
        put = lambda t, x: lax.dynamic_update_index_in_dim(t, x.astype(t.dtype), j, axis=1)  # noqa: E731
        return dq_BTbkgd, put(dk_BTbkd, dk), put(dv_BTbkd, dv)

    init = (jnp.zeros_like(q_BTbkgd, acc), jnp.zeros_like(k_BTbkd), jnp.zeros_like(v_BTbkd))
    dq_BTbkgd, dk_BTbkd, dv_BTbkd = lax.fori_loop(0, T, key_block, init)
    dq_BSnd = dq_BTbkgd.reshape(B, S, n, d).astype(q_BSnd.dtype)
    return dq_BSnd, dk_BTbkd.reshape(k_BSkd.shape), dv_BTbkd.reshape(v_BSkd.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q_BSnd, k_BSkd, v_BSkd, causal, scale, b):
    return _forward(q_BSnd, k_BSkd, v_BSkd, causal, scale, b)[0]


def _attention_fwd(q_BSnd, k_BSkd, v_BSkd, causal, scale, b):
    out_BSnd, lse_BkgTb = _forward(q_BSnd, k_BSkd, v_BSkd, causal, scale, b)
    out_BSnd, lse_BkgTb = checkpoint_name(out_BSnd, OUT), checkpoint_name(lse_BkgTb, LSE)
    return out_BSnd, (q_BSnd, k_BSkd, v_BSkd, out_BSnd, lse_BkgTb)


def _attention_bwd(causal, scale, b, residuals, dout_BSnd):
    return _backward(dout_BSnd, *residuals, causal, scale, b)


_attention.defvjp(_attention_fwd, _attention_bwd)
