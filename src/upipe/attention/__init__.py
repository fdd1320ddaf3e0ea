"""Context-parallel attention strategies, one file each, all with the same signature.

Under `torch.compile` each strategy op is one clean graph break (`torch.compiler.disable`):
the rest of the model compiles, and the op runs as written. Its buffers are freed and its
exchanges ordered by hand for memory (stage by stage, collectives on their own streams),
which a traced graph would not keep; the validation exchange (`common`) runs outside any
graph too, and is skipped once the inputs' signature was agreed.
"""

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
