"""Memory measurement (and, later, simulation and planning)."""

from upipe.memory.tracker import MemoryTracker

__all__ = ["MemoryTracker"]
