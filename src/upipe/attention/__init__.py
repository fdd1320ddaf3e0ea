"""Context-parallel attention strategies, one file each, all with the same signature."""

from upipe.attention.module import ContextParallelAttention
from upipe.attention.ulysses import ulysses_attention
from upipe.attention.upipe import upipe_attention

STRATEGIES = {"ulysses": ulysses_attention, "upipe": upipe_attention}
"""Functional strategies by name; each is `fn(q, k, v, *, group, causal, softmax_scale)`."""

__all__ = ["STRATEGIES", "ContextParallelAttention", "ulysses_attention", "upipe_attention"]
