"""The training stack: data, parallelize step, loop, checkpoints, metrics.

A library with no command line (that is `upipe.cli.train`): `train(cfg)` runs on every rank
of an initialised default process group; `Trainer` is one rank's model, optimizer, data and
checkpoints.
"""

from upipe.train.config import TrainConfig
from upipe.train.loop import Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
