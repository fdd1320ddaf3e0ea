"""Rotary position embeddings, applied to a local sequence shard by global position.

Legend: B batch, L local tokens, n heads, d head dim.

Hugging Face convention (Llama, Qwen, Mistral), "rotate half":
    inv_freq_i = 1 / theta^(2i/d),  i = 0 .. d/2-1   (in fp32, as transformers computes it;
                 Llama 3.1's "llama3" scaling then rescales them: `Llama3RopeScaling`)
    angle[b, l, i] = position_ids[b, l] * inv_freq_i
    cos = cos([angle, angle]),  sin = sin([angle, angle])              (each [B, L, d])
    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]
Interleaved convention (GPT-J, Meta's original Llama): pairs (x_{2i}, x_{2i+1}) rotate, with
cos/sin repeated per pair and rotate_pairs(x)_{2i} = -x_{2i+1}, rotate_pairs(x)_{2i+1} = x_{2i}.

Partial rotary (Phi-4-mini's partial_rotary_factor < 1): cos/sin `[B, L, r]` with r < d rotate
the first r features of each head (rotate half within them) and pass the other d - r through.

Each rotation is orthogonal with R^T = R(-angle), so the backward of rope is rope with
-sin:  d rope(x)/dx ^T g = g * cos + rotate(g) * (-sin)  (sin is the same on both members
of a pair, hence rotate(g * sin) = rotate(g) * sin).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(kw_only=True, frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's "llama3" RoPE scaling (transformers' `rope_parameters` of that type).

    With wavelength w_i = 2 pi / inv_freq_i and n = `original_max_position_embeddings`:
    w_i < n / high_freq_factor keeps inv_freq_i; w_i > n / low_freq_factor divides it by
    `factor`; in between it is interpolated, with s = (n / w_i - low) / (high - low):
    (1 - s) inv_freq_i / factor + s inv_freq_i."""

    factor: float
    """Divisor of the low (long-wavelength) frequencies (8 in Llama 3.1)."""
    low_freq_factor: float
    """n / low_freq_factor: the wavelength above which frequencies are divided (1)."""
    high_freq_factor: float
    """n / high_freq_factor: the wavelength below which frequencies are kept (4)."""
    original_max_position_embeddings: int
    """n, the context length of pre-training (8192)."""

    def __post_init__(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor ({self.high_freq_factor}) > "
                f"low_freq_factor ({self.low_freq_factor})"
            )

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (fp32, the operations transformers runs)."""
        n, low, high = (
            self.original_max_position_embeddings,
            self.low_freq_factor,
            self.high_freq_factor,
        )
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > n / low, inv_freq / self.factor, inv_freq)
        smooth = (n / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < n / high) * ~(wavelen > n / low)
        return torch.where(medium, smoothed, scaled)


def inv_frequencies(head_dim, *, theta=10000.0, scaling=None, device=None) -> torch.Tensor:
    """inv_freq `[d/2]` in fp32 (module doc), scaled by `scaling` (`Llama3RopeScaling`) if
    given: bit for bit transformers' default and "llama3" rope parameters."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    return inv_freq if scaling is None else scaling.apply(inv_freq)


def rope_cos_sin(
    position_ids_BL, head_dim, *, theta=10000.0, interleaved=False, dtype=None, scaling=None
):
    """cos, sin `[B, L, d]` for the given global positions (computed in fp32, then cast);
    `scaling`: a `Llama3RopeScaling` of the frequencies, or None."""
    inv_freq = inv_frequencies(
        head_dim, theta=theta, scaling=scaling, device=position_ids_BL.device
    )
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
    r = cos_BLd.shape[-1]
    if r < x_BLnd.shape[-1]:  # partial rotary: the first r features rotate (module doc)
        out_BLnd = x_BLnd.clone()
        out_BLnd[..., :r] = apply_rope(x_BLnd[..., :r], cos_BLd, sin_BLd, interleaved=interleaved)
        return out_BLnd
    cos, sin = cos_BLd[:, :, None], sin_BLd[:, :, None]
    out_BLnd = x_BLnd * cos
    (x1, x2), (s1, s2), (o1, o2) = (_halves(t, interleaved) for t in (x_BLnd, sin, out_BLnd))
    o1.sub_(x2 * s1)
    o2.add_(x1 * s2)
    return out_BLnd


def apply_rope_backward(g_BLnd, cos_BLd, sin_BLd, *, interleaved=False):
    """Gradient w.r.t. the input of `apply_rope` (the inverse rotation)."""
    return apply_rope(g_BLnd, cos_BLd, -sin_BLd, interleaved=interleaved)
