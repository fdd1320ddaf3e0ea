"""upipe: memory-efficient context parallelism (UPipe: headwise-chunked Ulysses attention)."""

from upipe.attention import (
    ContextParallelAttention,
    ring_attention,
    ulysses_attention,
    upipe_attention,
    usp_attention,
)
from upipe.comm import sequence_positions, shard_sequence, unshard_sequence
from upipe.memory import MemoryTracker
from upipe.mesh import make_mesh
from upipe.packing import document_positions

__version__ = "0.1.0"

__all__ = [
    "ContextParallelAttention",
    "MemoryTracker",
    "document_positions",
    "make_mesh",
    "ring_attention",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
    "upipe_attention",
    "usp_attention",
]
