"""Run on every rank of a LocalCluster by tests/distributed/test_moe.py: MoE training steps."""

from __future__ import annotations

import torch

from upipe.train import Trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def moe_steps(rank, world_size, cfg):
    """Per step (loss, balance loss), and the full gradients of step 1 (summed over ranks)."""
    trainer = Trainer(cfg, torch.device("cpu"))
    losses, aux, grads = [], [], None
    for step in range(cfg.steps):
        losses.append(trainer.forward_backward(step))
        aux.append(trainer.router_aux_loss)
        if step == 0:
            grads = {
                n: _full(p.grad).detach().clone() for n, p in trainer.master.named_parameters()
            }
        trainer.optimizer_step()
    return {"losses": losses, "aux": aux, "grads": grads}
