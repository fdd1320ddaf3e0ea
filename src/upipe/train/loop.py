"""The training loop behind `upipe train`: one function per rank, the same on spawned CPU
ranks and under torchrun.

Every rank builds the same model from the seed (`CausalLM.init_weights`), parallelizes it,
and trains on batches chosen by step index alone (`PackedTokens.batch`), so a run's losses
do not depend on the strategy or the number of processes (up to rounding), and a run
resumed from a checkpoint continues the same curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from upipe.attention.registry import CLI_WORDS, STRATEGIES, check_heads, get_strategy
from upipe.attention.schedule import check_heads_per_stage
from upipe.loss import count_valid, global_token_mean
from upipe.memory import MemoryTracker
from upipe.mesh import make_mesh
from upipe.model import PRESETS, CausalLM, ModelConfig, get_config
from upipe.train.data import VOCAB_SIZE, PackedTokens
from upipe.train.parallelize import (
    MemoryFeatures,
    allreduce_gradients,
    apply_fsdp,
    apply_memory_features,
    context_parallel,
    parallelize,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    model: str = dataclasses.field(default="tiny", metadata={"choices": sorted(PRESETS)})
    """Model preset (the tiny one uses the byte vocabulary; others keep their shapes)."""
    strategy: str = dataclasses.field(default="upipe", metadata={"choices": tuple(STRATEGIES)})
    """Context-parallel strategy of the attention layers."""
    nproc: int = 4
    """Processes to spawn on this machine (gloo, CPU); ignored under torchrun."""
    dp: int | None = None
    """Data-parallel degree (default: 1, or every process for strategy none)."""
    ring: int | None = None
    """Ring degree inside the context-parallel group (default: all of it for ring, 2 for
    usp, else 1; ring > 1 with upipe runs each stage as ring attention)."""
    seq_len: int = 8192
    """Tokens per sequence, split over the context-parallel ranks."""
    batch_size: int = 1
    """Sequences per step per data-parallel rank."""
    steps: int = 20
    """Optimizer steps (the total, counting steps done before a resume)."""
    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    heads_per_stage: int | None = None
    """UPipe heads per stage U (default: the ulysses size)."""
    seed: int = 0
    """Seed of the weights and of the document order."""
    data: str | None = None
    """Text/JSON-lines files or directories, comma-separated (default: the Python standard
    library's sources)."""
    dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(DTYPES)})
    """Parameter and activation dtype."""
    tiled_mlp: bool = False
    """Run the MLP in sequence tiles, recomputed in backward."""
    mlp_tile: int = 1024
    """Tokens per MLP tile."""
    chunked_loss: bool = False
    """Compute the cross-entropy in chunks (the full logits never exist)."""
    loss_chunk: int = 1024
    """Tokens per cross-entropy chunk."""
    checkpoint: bool = False
    """Activation checkpointing per block (keep only block inputs, recompute the rest)."""
    offload: bool = False
    """Keep the checkpointed block inputs in host memory (CUDA only; needs --checkpoint)."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer states over all ranks (FSDP2)."""
    device: str = dataclasses.field(default="cpu", metadata={"choices": ("cpu", "cuda")})
    """Device of each rank (cuda: one GPU per process, NCCL; launch with torchrun)."""
    metrics_file: str | None = None
    """Append one JSON line per step (step, loss, tokens_per_s, peak_memory_bytes, ...)."""
    checkpoint_dir: str | None = None
    """Save model + optimizer here (torch distributed checkpoint) at the end and every
    --checkpoint-every steps."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    resume: bool = False
    """Continue from the newest checkpoint in --checkpoint-dir."""
    plot: str | None = "train_loss.png"
    """Write the loss curve here (PNG); '' for none."""

    def degrees(self, world: int) -> tuple[int, int, int]:
        """(dp, ring, ulysses) for `world` processes."""
        spec = get_strategy(self.strategy)
        dp = self.dp or (1 if spec.context_parallel else world)
        cp = max(1, world // dp)
        ring = self.ring or spec.default_ring(cp)
        return dp, ring, max(1, cp // ring)

    def features(self) -> MemoryFeatures:
        return MemoryFeatures(
            tiled_mlp=self.mlp_tile if self.tiled_mlp else None,
            loss_chunk=self.loss_chunk if self.chunked_loss else None,
            checkpoint=self.checkpoint,
            offload=self.offload,
        )


def validate(cfg: TrainConfig, world: int, model: ModelConfig | None = None) -> str | None:
    """The first problem with `cfg` on `world` processes, as a message naming the fix
    (`model`: the model's shapes, if not those of the preset `cfg.model`)."""
    m = model or get_config(cfg.model)
    for name in ("nproc", "seq_len", "batch_size", "steps", "mlp_tile", "loss_chunk"):
        if getattr(cfg, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}"
    if cfg.checkpoint_every < 0 or cfg.lr <= 0 or cfg.grad_clip < 0:
        return "--checkpoint-every and --grad-clip must be >= 0 and --lr > 0"
    dp, ring, uly = cfg.degrees(world)
    if world % dp:
        return f"--dp {dp} must divide the number of processes ({world})"
    cp, spec = world // dp, get_strategy(cfg.strategy)
    if not spec.context_parallel and cp != 1:
        return (
            f"strategy {cfg.strategy} has no context parallelism: use --dp {world} "
            "(or leave it out)"
        )
    if ring * uly != cp:
        return f"--ring {ring} must divide the context-parallel size {cp} (= {world} / dp {dp})"
    if spec.needs_ring_and_ulysses and not 1 < ring < cp:
        return (
            f"{cfg.strategy} needs 1 < --ring < {cp} (the context-parallel size); "
            f"use ulysses or ring"
        )
    if spec.on_mesh_called and ring > 1:
        name = spec.on_mesh_called
        return f"{cfg.strategy} with --ring > 1 is {name}: use --strategy {name}"
    problem = check_heads(
        cfg.strategy,
        m.n_heads,
        m.n_kv_heads,
        uly,
        size="ulysses size",
        words=CLI_WORDS,
        what=cfg.model,
    )
    if problem:
        return problem
    if spec.heads_per_stage:
        try:
            check_heads_per_stage(m.n_heads, m.n_kv_heads, uly, cfg.heads_per_stage)
        except ValueError as e:
            return f"--heads-per-stage: {e}"
    elif cfg.heads_per_stage is not None:
        return "--heads-per-stage applies to --strategy upipe only"
    multiple = cp * (2 if spec.layout == "zigzag" or ring > 1 else 1)
    if cfg.seq_len % multiple:
        return (
            f"--seq-len {cfg.seq_len} must be a multiple of {multiple} for {cfg.strategy} on "
            f"{cp} context-parallel ranks; try {cfg.seq_len + (-cfg.seq_len) % multiple}"
        )
    if cfg.offload and not cfg.checkpoint:
        return "--offload keeps the checkpointed block inputs on the host; add --checkpoint"
    if cfg.resume and not cfg.checkpoint_dir:
        return "--resume needs --checkpoint-dir"
    if m.vocab_size >= VOCAB_SIZE:
        return None
    return f"{cfg.model} has a vocabulary of {m.vocab_size} < {VOCAB_SIZE} byte tokens"


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


class Trainer:
    """Model, optimizer, data and checkpoints of one rank (default process group set up)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, *, mesh=None, model_config=None):
        """`mesh`: the (dp, ring, ulysses) mesh of `cfg.degrees`, if the caller built it
        (the planner does, outside `FakeTensorMode`); by default it is built here.
        `model_config`: a `ModelConfig` to build instead of the preset `cfg.model`."""
        self.cfg, self.device = cfg, device
        if mesh is None:
            dp, ring, uly = cfg.degrees(dist.get_world_size())
            mesh = make_mesh(ulysses=uly, ring=ring, dp=dp, device_type=device.type)
        dp = mesh["dp"].size()
        self.mesh = mesh
        self.cp = context_parallel(cfg.strategy, self.mesh)
        self.dp, self.dp_rank = dp, self.mesh.get_local_rank("dp")
        # built in the training dtype (no fp32 copy; fake tensors in the planner cannot be
        # cast either): with FSDP on the meta device, then sharded, and only this rank's
        # shards are allocated (a 70B model never exists whole on a GPU); else on the
        # device. Either way initialised from the seed to the same values.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[cfg.dtype])
        try:
            with torch.device("meta" if cfg.fsdp else device):
                model = CausalLM(model_config or get_config(cfg.model))
        finally:
            torch.set_default_dtype(default_dtype)
        parallelize(model, self.cp, heads_per_stage=cfg.heads_per_stage)
        apply_memory_features(model, cfg.features(), device)
        if cfg.fsdp:
            apply_fsdp(model, self.mesh)
            model.to_empty(device=device)
        model.init_weights(cfg.seed)
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        self.data = PackedTokens(cfg.data, seed=cfg.seed)
        self.positions_L = self.cp.positions(cfg.seq_len)

    def batch(self, step: int):
        """This rank's (input_ids, labels, position_ids) `[B, L]` of `step` (0-based)."""
        cfg = self.cfg
        ids_BS, labels_BS = self.data.batch(
            step * self.dp + self.dp_rank, cfg.batch_size, cfg.seq_len
        )
        pos = self.positions_L
        return tuple(
            t.to(self.device)
            for t in (ids_BS[:, pos], labels_BS[:, pos], pos.expand(cfg.batch_size, -1))
        )

    def forward_backward(self, step: int) -> float:
        """Loss (global token mean, same on every rank) of `step`; gradients summed over ranks."""
        ids, labels, pos = self.batch(step)
        loss = global_token_mean(self.model(ids, pos, labels), count_valid(labels))
        loss.backward()
        if not self.cfg.fsdp:
            allreduce_gradients(self.model)
        return loss.item()

    def optimizer_step(self) -> None:
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, step: int) -> dict:
        """One training step, measured: loss, seconds and this rank's peak memory."""
        persistent = _storage_bytes(
            [*self.model.parameters()]
            + [t for s in self.optimizer.state.values() for t in s.values()]
        )
        dist.barrier()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            loss = self.forward_backward(step)
            self.optimizer_step()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            with MemoryTracker() as mem:
                loss = self.forward_backward(step)
                self.optimizer_step()
            peak = persistent + mem.peak_bytes
        return {"loss": loss, "seconds": time.perf_counter() - t0, "peak_memory_bytes": peak}

    # checkpoints: torch distributed checkpoint, one directory per step
    def _state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, step: int) -> Path:
        import torch.distributed.checkpoint as dcp

        path = Path(self.cfg.checkpoint_dir) / f"step_{step:08d}"
        dcp.save(self._state(), checkpoint_id=str(path))
        return path

    def load_latest(self) -> int:
        """Load the newest complete checkpoint; returns its step (0 if there is none)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        root = Path(self.cfg.checkpoint_dir)
        done = sorted(p for p in root.glob("step_*") if (p / ".metadata").exists())
        if not done:
            return 0
        state = self._state()
        dcp.load(state, checkpoint_id=str(done[-1]))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        return int(done[-1].name.split("_")[1])


def _history(cfg: TrainConfig, upto: int) -> list[dict]:
    """Metrics of the steps before a resume, from the metrics file (for the plot)."""
    if not (cfg.metrics_file and os.path.exists(cfg.metrics_file)):
        return []
    with open(cfg.metrics_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def train(cfg: TrainConfig, device: torch.device | None = None) -> list[dict]:
    """Run `cfg` on this rank (default process group initialised); returns the per-step
    metrics on every rank (rank 0 also prints, logs and plots them)."""
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, device)
    start = trainer.load_latest() if cfg.resume else 0
    history = _history(cfg, start) if rank == 0 else []
    tokens = cfg.seq_len * cfg.batch_size * trainer.dp
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.strategy}", unit="step")
    for step in range(start, cfg.steps):
        m = trainer.step(step)
        peaks = [None] * world
        dist.all_gather_object(peaks, m["peak_memory_bytes"])
        row = {
            "step": step + 1,
            "loss": m["loss"],
            "tokens_per_s": tokens / m["seconds"],
            "peak_memory_bytes": max(peaks),
            "peak_memory_bytes_per_rank": peaks,
            "seconds": m["seconds"],
            "strategy": cfg.strategy,
            "world_size": world,
        }
        history.append(row)
        if rank == 0:
            bar.set_postfix(
                loss=f"{m['loss']:.4f}",
                tok_s=f"{row['tokens_per_s']:.0f}",
                peak_MiB=f"{max(peaks) / 2**20:.0f}",
            )
            bar.update()
            if cfg.metrics_file:
                with open(cfg.metrics_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
        last = step + 1 == cfg.steps
        every = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
        if cfg.checkpoint_dir and (last or every):
            trainer.save(step + 1)
    if rank == 0:
        bar.close()
        if cfg.plot and history:
            plot_loss(
                history, cfg.plot, f"{cfg.model}, {cfg.strategy}, S={cfg.seq_len}, {world} ranks"
            )
    return history


def plot_loss(history: list[dict], path: str, title: str) -> None:
    """Loss (and tokens/s) vs step as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in history], marker="." if len(steps) < 50 else None)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(history: list[dict]) -> str:
    """The run in a few lines: first/last loss, median tokens/s, peak memory per rank."""
    if not history:
        return "no steps run"
    tps = sorted(r["tokens_per_s"] for r in history)
    peak = max(r["peak_memory_bytes"] for r in history)
    return (
        f"steps {history[0]['step']}..{history[-1]['step']}: loss {history[0]['loss']:.4f} -> "
        f"{history[-1]['loss']:.4f} (ln 257 = {math.log(257):.3f}); median "
        f"{tps[len(tps) // 2]:.0f} tokens/s; peak memory per rank {peak / 2**20:.1f} MiB"
    )
