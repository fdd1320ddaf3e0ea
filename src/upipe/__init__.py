"""upipe: memory-efficient context parallelism (UPipe: headwise-chunked Ulysses attention)."""

from upipe.attention import ContextParallelAttention, ulysses_attention, upipe_attention
from upipe.comm import shard_sequence, unshard_sequence
from upipe.memory import MemoryTracker

__version__ = "0.1.0"

__all__ = [
    "ContextParallelAttention",
    "MemoryTracker",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
    "upipe_attention",
]
