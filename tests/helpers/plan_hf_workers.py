"""Run on every rank of a LocalCluster by tests/distributed/test_plan_hf.py: a real step's peak
memory of
the Hugging Face path, counted as the planner counts it."""

from __future__ import annotations

import torch

from upipe.mesh import make_mesh
from upipe.planner.hf import HFJob, block_index, build_model
from upipe.planner.step import StepTracker, measure_step
from upipe.torch_private import flatten_mesh
from upipe.train import TrainConfig


def real_hf_peak(rank, world_size, kw, hf, seq_lens):
    """Per-rank device peak of real steps at `seq_lens` (after a warm-up step) of the model of
    config `hf` converted for candidate `kw` (TrainConfig fields), built and stepped by the
    planner's own `build_model` / `HFJob` on real tensors: every storage allocated since
    the model was built."""
    cfg = TrainConfig(**kw)
    mesh = make_mesh(ulysses=world_size)
    fsdp_mesh = flatten_mesh(mesh, "fsdp")
    mem = StepTracker()
    with mem:
        model, optimizer = build_model(cfg, hf, hf["num_hidden_layers"], mesh, fsdp_mesh)
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # (in place: allocates nothing)
        for p in model.parameters():
            local = p.to_local()
            local.copy_(0.02 * torch.randn(local.shape, generator=gen, dtype=local.dtype))
        for b in model.buffers():  # the rotary embedding's inverse frequencies
            b.copy_(torch.linspace(1.0, 1e-3, b.numel(), dtype=b.dtype).view_as(b))
    job = HFJob(model, optimizer, mem, C=world_size, batch=cfg.batch_size, offload=False)
    job.block = block_index(mesh)
    return [measure_step(job, S).peak_bytes for S in [seq_lens[0], *seq_lens]][1:]
