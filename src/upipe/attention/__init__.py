"""Context-parallel attention strategies, one file each, all with the same signature."""

from upipe.attention.module import ContextParallelAttention
from upipe.attention.ring import ring_attention
from upipe.attention.ulysses import ulysses_attention
from upipe.attention.upipe import upipe_attention
from upipe.attention.usp import usp_attention

STRATEGIES = {"ulysses": ulysses_attention, "upipe": upipe_attention, "ring": ring_attention}
"""Functional strategies by name; each is `fn(q, k, v, *, group, causal, softmax_scale)`
(ring also takes `layout=`, default "zigzag"). `usp_attention` takes a 2-D `mesh` instead
of a group, so it is not listed; `upipe_attention` also accepts `mesh=`."""

__all__ = [
    "STRATEGIES",
    "ContextParallelAttention",
    "ring_attention",
    "ulysses_attention",
    "upipe_attention",
    "usp_attention",
]
