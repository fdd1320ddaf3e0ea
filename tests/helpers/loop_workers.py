"""Module-level functions run on every rank of a LocalCluster by
tests/distributed/test_train_loop.py and
tests/runs/test_mixed_precision.py."""

from __future__ import annotations

import torch

from upipe.train import Trainer


def train_rows(rank, world_size, cfg):
    """upipe.train.train(cfg)'s metrics, and the token rows (lists) training and evaluation
    read on this rank."""
    from upipe.train import train

    rows = train(cfg)
    trainer = Trainer(cfg, torch.device("cpu"))
    steps = range(cfg.steps)
    read = [c[0] for s in steps for i in trainer.micro_batches(s) for c in trainer.batch(i)]
    held = [c[0] for i in trainer.eval_batches() for c in trainer.batch(i, held_out=True)]
    flat = lambda batches: [row.tolist() for b in batches for row in b]  # noqa: E731
    return rows, flat(read), flat(held)


def losses(rank, world_size, cfg):
    """The loss of each of cfg.steps optimizer steps."""
    trainer = Trainer(cfg, torch.device("cpu"))
    out = []
    for step in range(cfg.steps):
        out.append(trainer.forward_backward(step))
        trainer.optimizer_step()
    return out


def state_bytes(rank, world_size, cfg):
    """(bytes by kind with gradients and AdamW states present, parameters of the model,
    dtypes of masters / compute weights / gradients / AdamW states)."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.forward_backward(0)
    trainer.optimizer.step()  # AdamW states created; gradients still present
    counts = trainer.state_bytes()
    masters = list(trainer.master.parameters())
    states = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim()]
    dtypes = {
        "master": {p.dtype for p in masters},
        "compute": {p.dtype for p in trainer.model.parameters()},
        "grad": {p.grad.dtype for p in masters},
        "optimizer": {t.dtype for t in states},
    }
    return counts, trainer.model.config.num_params(), dtypes


def train_lrs_and_notes(rank, world_size, cfg):
    """upipe.train.train(cfg): (step, lr, loss) of each step run, and what rank 0 printed to
    stderr (the resume notes); a raised error as its message."""
    import contextlib
    import io

    from upipe.train import train

    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            rows = train(cfg)
    except Exception as e:  # noqa: BLE001 -- the test reads the message
        return f"{type(e).__name__}: {e}"
    return [(r["step"], r["lr"], r["loss"]) for r in rows], printed.getvalue()


def train_with_rank_options(rank, world_size, cfgs):
    """upipe.train.train(cfgs[rank]) (each rank its own options); a raised error as its
    message."""
    from upipe.train import train

    try:
        return train(cfgs[rank])
    except ValueError as e:
        return str(e)
