"""Memory measurement, the bottom layer that training and planning build on: the live-tensor
tracker (`tracker`), closed-form peaks of one attention layer (`model`) and the fake process
group that runs one rank of a job alone (`simulate`). The simulated training step and the
planner are in `upipe.planner`."""

from upipe.memory.tracker import MemoryTracker

__all__ = ["MemoryTracker"]
