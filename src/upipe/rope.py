"""Rotary position embeddings, applied to a local sequence shard by global position.

Legend: B batch, L local tokens, n heads, d head dim.

Hugging Face convention (Llama, Qwen, Mistral), "rotate half":
    inv_freq_i = theta^(-2i/d),  i = 0 .. d/2-1;   angle[b, l, i] = position_ids[b, l] * inv_freq_i
    cos = cos([angle, angle]),  sin = sin([angle, angle])              (each [B, L, d])
    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]
Interleaved convention (GPT-J, Meta's original Llama): pairs (x_{2i}, x_{2i+1}) rotate, with
cos/sin repeated per pair and rotate_pairs(x)_{2i} = -x_{2i+1}, rotate_pairs(x)_{2i+1} = x_{2i}.

Each rotation is orthogonal with R^T = R(-angle), so the backward of rope is rope with
-sin:  d rope(x)/dx ^T g = g * cos + rotate(g) * (-sin)  (sin is the same on both members
of a pair, hence rotate(g * sin) = rotate(g) * sin).
"""

from __future__ import annotations

import torch


def rope_cos_sin(position_ids_BL, head_dim, *, theta=10000.0, interleaved=False, dtype=None):
    """cos, sin `[B, L, d]` for the given global positions (computed in fp32, then cast)."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    dev = position_ids_BL.device
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim)
    angle_BLi = position_ids_BL.float()[..., None] * inv_freq
    if interleaved:
        angle_BLd = angle_BLi.repeat_interleave(2, dim=-1)
    else:
        angle_BLd = torch.cat([angle_BLi, angle_BLi], dim=-1)
    cos, sin = angle_BLd.cos(), angle_BLd.sin()
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def _halves(t, interleaved):
    """The two members of each rotated pair: (even, odd) features interleaved, else (first
    half, second half) -- views."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]  # (not chunk: its views may not be written in place)


def apply_rope(x_BLnd, cos_BLd, sin_BLd, *, interleaved=False):
    """Rotate x `[B, L, n, d]` by the angles in cos/sin `[B, L, d]` (differentiable).

    out = x * cos, then per pair (x1, x2) out1 -= x2 * sin1, out2 += x1 * sin2, in place:
    besides the output only one half-size product exists at a time (`x * cos + rotate(x) *
    sin` makes three more tensors of x's size), which matters inside the fused UPipe op,
    where this runs per stage on [B, L, U, d] at the step's peak. The same operations as
    that formula, so the same roundings, in eager and compiled code alike.
    """
    cos, sin = cos_BLd[:, :, None], sin_BLd[:, :, None]
    out_BLnd = x_BLnd * cos
    (x1, x2), (s1, s2), (o1, o2) = (_halves(t, interleaved) for t in (x_BLnd, sin, out_BLnd))
    o1.sub_(x2 * s1)
    o2.add_(x1 * s2)
    return out_BLnd


def apply_rope_backward(g_BLnd, cos_BLd, sin_BLd, *, interleaved=False):
    """Gradient w.r.t. the input of `apply_rope` (the inverse rotation)."""
    return apply_rope(g_BLnd, cos_BLd, -sin_BLd, interleaved=interleaved)
