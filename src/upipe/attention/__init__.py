"""Context-parallel attention strategies, one file each, all with the same signature."""

from upipe.attention.ulysses import ulysses_attention

STRATEGIES = {"ulysses": ulysses_attention}
"""Functional strategies by name; each is `fn(q, k, v, *, group, causal, softmax_scale)`."""

__all__ = ["STRATEGIES", "ulysses_attention"]
