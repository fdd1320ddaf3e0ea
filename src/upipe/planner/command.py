"""The command that trains a planned candidate: `torchrun ... -m upipe.train ...` on CUDA
GPUs, `upipe train --nproc N --device cpu ...` on this machine's CPU ranks, with every option
that differs from `upipe train`'s defaults (`upipe.train.TrainConfig`), so that what runs is
what was planned (`tests/runs/test_timing.py` parses it back)."""

from __future__ import annotations

import dataclasses
import math

from upipe.train.config import TrainConfig

# options the printed command always names, first, in this order
SHOWN = ("device", "model", "strategy", "seq_len", "dtype", "fsdp")


def _options(kw: dict, seq_len: int, device: str) -> list[str]:
    """`upipe train`'s options for candidate `kw` (TrainConfig fields) at `seq_len`: the
    `SHOWN` ones, then every other that differs from the default (--nproc: the caller's)."""
    cfg = TrainConfig(**{**kw, "seq_len": seq_len, "device": device})
    default = TrainConfig()
    names = [*SHOWN, *(f.name for f in dataclasses.fields(TrainConfig) if f.name not in SHOWN)]
    words = []
    for name in names:
        value = getattr(cfg, name)
        if name == "nproc" or (name not in SHOWN and value == getattr(default, name)):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
        else:
            words += [flag, str(value)]
    return words


def torchrun_command(kw: dict, gpus: int, seq_len: int, gpus_per_node: int) -> str:
    """The command that trains candidate `kw` (TrainConfig fields) on `gpus` CUDA GPUs at
    `seq_len` tokens: every option that differs from `upipe train`'s default, the `SHOWN`
    ones first. Beyond one node: torchrun's c10d rendezvous, run on every node."""
    words = _options(kw, seq_len, "cuda")  # (--nproc: torchrun's --nproc-per-node decides)
    if gpus <= gpus_per_node:
        launch = f"torchrun --nproc-per-node {gpus}"
    else:
        nodes = math.ceil(gpus / gpus_per_node)
        launch = (
            f"torchrun --nnodes {nodes} --nproc-per-node {gpus // nodes} --rdzv-backend c10d "
            "--rdzv-endpoint HEAD_NODE:29500"
        )
    return " ".join([launch, "-m", "upipe.train", *words])


def train_command(kw: dict, gpus: int, seq_len: int, device: str, gpus_per_node: int = 8) -> str:
    """The command that trains candidate `kw` on `gpus` ranks at `seq_len` tokens: on
    `device` cuda `torchrun_command`'s, on cpu `upipe train` spawning `gpus` CPU ranks."""
    if device == "cuda":
        return torchrun_command(kw, gpus, seq_len, gpus_per_node)
    return " ".join(["upipe train --nproc", str(gpus), *_options(kw, seq_len, "cpu")])
