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


def _rotate(x, interleaved):
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([-x2, x1], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_BLnd, cos_BLd, sin_BLd, *, interleaved=False):
    """Rotate x `[B, L, n, d]` by the angles in cos/sin `[B, L, d]` (differentiable)."""
    cos, sin = cos_BLd[:, :, None], sin_BLd[:, :, None]
    return x_BLnd * cos + _rotate(x_BLnd, interleaved) * sin


def apply_rope_backward(g_BLnd, cos_BLd, sin_BLd, *, interleaved=False):
    """Gradient w.r.t. the input of `apply_rope` (the inverse rotation)."""
    return apply_rope(g_BLnd, cos_BLd, -sin_BLd, interleaved=interleaved)
