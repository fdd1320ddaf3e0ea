"""upipe: memory-efficient context parallelism (UPipe: headwise-chunked Ulysses attention).

The public API below is imported on first use (a module `__getattr__`, PEP 562): `import
upipe` alone imports no torch, so that the parts that need none -- `upipe.heads` (the head
rules and plans) and `upipe.jax` (the JAX port) -- load without it.
"""

import importlib

__version__ = "0.1.0"

_HOMES = {  # each public name, by the module it lives in
    "ContextParallelAttention": "upipe.attention",
    "ring_attention": "upipe.attention",
    "ulysses_attention": "upipe.attention",
    "upipe_attention": "upipe.attention",
    "usp_attention": "upipe.attention",
    "sequence_positions": "upipe.comm",
    "shard_sequence": "upipe.comm",
    "unshard_sequence": "upipe.comm",
    "MemoryTracker": "upipe.memory",
    "make_mesh": "upipe.mesh",
    "document_positions": "upipe.packing",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """A name of the public API (imported from its home and bound on first use), or a
    submodule (imported)."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
