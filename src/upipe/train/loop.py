"""The training loop behind `upipe train`: one function per rank, the same on spawned CPU
ranks and under torchrun.

Every rank builds the same model from the seed (`CausalLM.init_weights`), parallelizes it,
and trains on batches chosen by step index alone (`PackedTokens.batch`), so a run's losses
do not depend on the strategy or the number of processes (up to rounding), and a run
resumed from a checkpoint continues the same curve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from upipe.attention.registry import get_strategy
from upipe.kernels import prepare_kernel
from upipe.loss import IGNORE_INDEX, count_valid, global_count, global_token_mean
from upipe.memory import MemoryTracker
from upipe.mesh import make_mesh
from upipe.model import CausalLM, ModelConfig, load_hf_weights, save_hf_checkpoint
from upipe.model.hf_checkpoint import read_hf_config
from upipe.packing import document_positions
from upipe.plot import Panel, Series, save_plot
from upipe.train.checkpointing import CheckpointError, load_latest_checkpoint, save_checkpoint
from upipe.train.config import DTYPES, TrainConfig, padded_length
from upipe.train.config import model_config as train_model_config
from upipe.train.data import PackedTokens, mask_document_ends
from upipe.train.outputs import append_metrics, read_metrics, write_metrics
from upipe.train.parallelize import (
    MasterWeights,
    allreduce_gradients,
    apply_fsdp,
    apply_memory_features,
    context_parallel,
    parallelize,
)
from upipe.train.tokenizers import HFTokenizer, copy_tokenizer


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """The learning-rate factor of optimizer step `step` (0-based): linear warmup over
    `warmup` steps ((step + 1) / (warmup + 1)), then a cosine from 1 at step `warmup` to
    `min_ratio` at the last step, `total - 1`.

    One closed form for `LambdaLR` rather than `SequentialLR(LinearLR, CosineAnnealingLR)`:
    the latter steps its second scheduler with the deprecated epoch argument at the
    milestone, needs a nonzero start factor and a special case for no warmup, and
    `CosineAnnealingLR` updates the rate recursively (rounding accumulates); a factor that
    depends on the step alone also makes a resumed run's rates those of a straight run."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(1, total - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclasses.dataclass
class LRSchedule:
    """The run's learning-rate factor per optimizer step: `warmup_cosine` over `steps` steps.

    A callable object rather than a `functools.partial`: `LambdaLR.state_dict()` saves the
    fields of callable objects (not of functions), so a checkpoint records the schedule it
    was trained with and `LambdaLR.load_state_dict` restores it -- a run resumed with another
    --steps continues the saved curve unless it asks for a new one (`Trainer.load_latest`)."""

    steps: int
    warmup: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, warmup=self.warmup, total=self.steps, min_ratio=self.min_ratio)

    def __str__(self) -> str:
        return (
            f"{self.warmup} warmup steps, then a cosine to {self.min_ratio:g} x lr at step "
            f"{self.steps}"
        )


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite; raised before the update, so the
    weights, the optimizer and every checkpoint are as after the step before."""


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) as the whole tensor; any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


class Trainer:
    """Model, optimizer, data and checkpoints of one rank (default process group set up).

    Precision: `model` computes in `cfg.dtype`; the optimizer updates `master`, the weights
    in `cfg.master_dtype` (fp32 by default), whose gradients are accumulated and reduced in
    that dtype. With FSDP2 the model's sharded parameters are the masters and its mixed
    precision policy casts them for compute; without, `master` is a separate module
    (`MasterWeights`) when the dtypes differ, and the model itself when they agree.

    With `cfg.fsdp_offload` the sharded masters, their gradients and the AdamW states are
    host memory (`apply_fsdp(offload=True)`), and the update runs on the CPU.
    """

    def __init__(self, cfg: TrainConfig, device: torch.device, *, mesh=None, model_config=None):
        """`mesh`: the (dp, ring, ulysses) mesh of `cfg.degrees`, if the caller built it
        (the planner does, outside `FakeTensorMode`); by default it is built here.
        `model_config`: a `ModelConfig` to build instead of the preset `cfg.model`."""
        self.cfg, self.device = cfg, device
        self.spec = get_strategy(cfg.strategy)  # the registry entry, looked up once
        world = dist.get_world_size()
        if mesh is None:
            dp, ring, uly = cfg.degrees(world, self.spec)
            mesh = make_mesh(ulysses=uly, ring=ring, dp=dp, device_type=device.type)
        self.mesh = mesh
        self.cp = context_parallel(self.spec, self.mesh)
        self.dp, self.dp_rank = mesh["dp"].size(), self.mesh.get_local_rank("dp")
        self._multiple = padded_length(dataclasses.replace(cfg, seq_len=1), world, self.spec)
        compute, master = DTYPES[cfg.dtype], DTYPES[cfg.master_dtype]
        eval_fraction = cfg.eval_fraction if cfg.eval_every else 0.0
        self.data = PackedTokens(
            cfg.data,
            seed=cfg.seed,
            tokenizer=cfg.tokenizer,
            eval_fraction=eval_fraction,
            skip_bad_records=cfg.skip_bad_records,
        )
        config = model_config or train_model_config(cfg, self.data.vocab_size)
        # built in the master dtype (no full-size cast: fake tensors in the planner cannot
        # be cast either): with FSDP on the meta device, then sharded, and only this rank's
        # shards are allocated (a 70B model never exists whole on a GPU); else on the
        # device. Either way initialised from the seed to the same values.
        model = _build(config, master, "meta" if cfg.fsdp else device)
        # the attention kernel checked here, before any step (and FA3/FA4 activated, which is
        # process-wide; auto logs its choice); the layers get the option itself (auto may
        # choose differently for packed documents)
        prepare_kernel(cfg.attention_kernel, device, compute, config.head_dim)
        attn = dict(heads_per_stage=cfg.heads_per_stage, backend=cfg.attention_kernel)
        parallelize(model, self.cp, **attn)
        apply_memory_features(model, cfg.features(), device)
        self.masters = None
        if cfg.fsdp:
            mixed = compute if compute != master else None
            apply_fsdp(model, self.mesh, param_dtype=mixed, offload=cfg.fsdp_offload)
            # offloaded shards are materialised on the host (FSDP2 requires the CPU there)
            model.to_empty(device="cpu" if cfg.fsdp_offload else device)
        model.init_weights(cfg.seed)
        if cfg.init_from_hf:  # into the masters (sharded: each rank reads its shards)
            load_hf_weights(model, cfg.init_from_hf)
        self.model = self.master = model
        if compute != master and not cfg.fsdp:  # a compute copy of the fp32 masters
            self.model = _build(config, compute, device)
            parallelize(self.model, self.cp, **attn)
            apply_memory_features(self.model, cfg.features(), device)
            self.masters = MasterWeights(self.model, self.master)
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        self.decayed = (
            [p for p in self.master.parameters() if p.ndim >= 2] if cfg.weight_decay else []
        )
        """The masters --weight-decay scales (`decay_weights`)."""
        self.schedule = LRSchedule(cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self._positions = {}
        self.router_aux_loss: float | None = None
        """MoE: the balance loss of the last step (`forward_backward`); None if dense."""

    def padded(self, seq_len: int) -> int:
        """`seq_len` padded to what the layout splits evenly (`padded_length`)."""
        return seq_len + (-seq_len) % self._multiple

    def positions(self, seq_len: int) -> torch.Tensor:
        """Global positions `[L]` of this rank's tokens, the sequence padded."""
        if seq_len not in self._positions:
            self._positions[seq_len] = self.cp.positions(seq_len)
        return self._positions[seq_len]

    def batch(self, index: int, *, held_out: bool = False) -> list[tuple]:
        """This rank's part of batch `index` of the training stream (`PackedTokens.batch`;
        `held_out`: of the evaluation stream, `PackedTokens.eval_batch`) as model calls:
        (input_ids, labels, position_ids `[B', L]`, cu_seqlens or None).

        The sequence is padded at the end to a length the layout splits evenly
        (`padded_length`; labels -100 there). With document masking each row is its own
        call (B' = 1), as rows are packed differently and a call takes one set of
        boundaries: the row's documents (`PackedTokens.documents`), the padding as one more,
        positions restarting per document, and no label on a document's last token (its
        target, the next document's first token, is not visible to it). Without, one call
        of B' = batch_size rows, positions 0 .. S-1."""
        cfg, data = self.cfg, self.data
        read = data.eval_batch if held_out else data.batch
        ids_BS, labels_BS = read(index, cfg.batch_size, cfg.seq_len)
        S = self.padded(cfg.seq_len)
        ids_BS = torch.nn.functional.pad(ids_BS, (0, S - cfg.seq_len), value=0)
        labels_BS = torch.nn.functional.pad(labels_BS, (0, S - cfg.seq_len), value=IGNORE_INDEX)
        pos_L = self.positions(S)
        if not cfg.document_mask:
            pos_BL = pos_L.expand(cfg.batch_size, -1)
            return [
                tuple(t.to(self.device) for t in (ids_BS[:, pos_L], labels_BS[:, pos_L], pos_BL))
                + (None,)
            ]
        labels_BS = mask_document_ends(ids_BS, labels_BS, data.eos_id)
        bounds = (data.eval_documents if held_out else data.documents)(
            index, cfg.batch_size, cfg.seq_len
        )
        calls = []
        for b, cu in enumerate(bounds):
            cu = (*cu.tolist(), S) if cfg.seq_len < S else tuple(cu.tolist())  # host ints
            doc_pos_L = document_positions(cu, S)[pos_L]
            row = (ids_BS[b : b + 1, pos_L], labels_BS[b : b + 1, pos_L], doc_pos_L[None])
            calls.append(tuple(t.to(self.device) for t in row) + (cu,))
        return calls

    def micro_batches(self, step: int) -> list[int]:
        """Indices of the batches of optimizer step `step` on this rank: its
        `cfg.grad_accum` micro-batches are the rows of the one batch of
        batch_size x grad_accum sequences it would take without accumulation."""
        first = (step * self.dp + self.dp_rank) * self.cfg.grad_accum
        return list(range(first, first + self.cfg.grad_accum))

    def forward_backward(self, step: int) -> float:
        """Loss of optimizer step `step`: the mean over every valid token of all its
        micro-batches on all ranks (the same on every rank). The gradients of that mean,
        summed over ranks, are in the masters' `.grad` (in the master dtype).

        MoE: the objective is that loss + coef x the balance loss, the mean over the step's
        model calls on all data-parallel ranks of each call's balance loss over its whole
        sequences (`CausalLM.router_aux_loss`; `aux_loss_scale` = 1 / the number of calls,
        so a data-parallel run equals one process taking all the calls). The balance loss
        itself (not times coef) is `router_aux_loss` after the step."""
        calls = [call for i in self.micro_batches(step) for call in self.batch(i)]
        count = global_count(sum(count_valid(labels) for _, labels, _, _ in calls))
        moe = bool(self.model.config.n_experts)
        if moe:  # each call's share of the mean over the calls of every data-parallel rank
            self.model.aux_loss_scale = 1.0 / (len(calls) * self.dp)
        losses, aux = [], []
        for ids, labels, pos, cu_seqlens in calls:
            loss_sum = self.model(ids, pos, labels, cu_seqlens=cu_seqlens)
            loss = global_token_mean(loss_sum, count_valid(labels), total_count=count)
            loss.backward()
            losses.append(loss.detach())
            if moe:
                aux.append(self.model.router_aux_loss)
        if not self.cfg.fsdp:
            allreduce_gradients(self.master)
        if moe:  # the same on the C ranks of a sequence: sum over all, / (C x calls x dp)
            aux_sum = torch.stack(aux).double().sum()
            dist.all_reduce(aux_sum)
            losses.append(aux_sum / (len(calls) * dist.get_world_size()))
        # one host read per step (not one per call: each would wait for the GPU)
        values = torch.stack(losses).double().tolist()
        self.router_aux_loss = values.pop() if moe else None
        return sum(values)

    def clip_gradients(self) -> torch.Tensor:
        """The global norm of the masters' gradients (0-d, before clipping), and clip them to
        `cfg.grad_clip` if set: `clip_grad_norm_` returns that norm; without clipping
        `get_total_norm` computes it. Gradients are reduced first, so the norm is the same
        on every rank."""
        params = list(self.master.parameters())
        if self.cfg.grad_clip:
            return torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    @torch.no_grad()
    def decay_weights(self) -> None:
        """--weight-decay: p <- p (1 - lr x weight_decay) for the `decayed` masters, at this
        step's lr -- what torch's AdamW does first to a parameter of a group with that
        weight_decay, with the same factor: the same bits (tested against AdamW with two
        groups). Why not AdamW's groups: the checkpoints record the optimizer's groups, and
        DCP maps a checkpoint's groups onto the optimizer's by parameter name, copying lr and
        weight_decay group by group (`_split_optim_state_dict`): a checkpoint of one group
        (any run without decay, any earlier version) loaded into two would leave one without
        an lr, and the scheduler's saved `base_lrs` would set one group's rate only. With
        one group every checkpoint resumes under any --weight-decay (this run's applies)."""
        if not self.decayed:
            return
        factor = 1 - self.optimizer.param_groups[0]["lr"] * self.cfg.weight_decay
        for p in self.decayed:
            if p.grad is not None:  # (AdamW leaves a parameter without gradient alone)
                p.mul_(factor)

    def update(self) -> None:
        """Decay the weights (`decay_weights`), step the optimizer and the learning rate,
        round the masters into the compute copy."""
        self.decay_weights()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.copy_to_model()

    def skip_update(self) -> None:
        """Drop the gradients without an update; the learning rate moves on (it stays the
        rate of the step index, as in a run without the skip)."""
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        """Clip, then `update`."""
        self.clip_gradients()
        self.update()

    def _nonfinite(self, step: int, loss: float, grad_norm: float) -> str | None:
        """None if the loss and the gradient norm of `step` are finite. Else what is not, if
        `cfg.skip_nonfinite_steps`; otherwise NonFiniteError (the same on every rank: the
        loss and the norm are global)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return None
        what = f"the loss is {loss:g}, the gradient norm {grad_norm:g}"
        if self.cfg.skip_nonfinite_steps:
            return what
        raise NonFiniteError(
            f"step {step + 1}: {what}; stopped before the update (weights, optimizer and "
            f"checkpoints hold no non-finite value: they are as after step {step}). Lower "
            "--lr, check the data, or pass --skip-nonfinite-steps to skip such steps"
        )

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return self.optimizer.param_groups[0]["lr"]

    def eval_batches(self) -> list[int]:
        """Indices of this rank's batches of the held-out stream (documents training never
        reads, `PackedTokens.eval_batch`): the first `cfg.eval_batches` per data-parallel
        rank, the same at every evaluation."""
        return [k * self.dp + self.dp_rank for k in range(self.cfg.eval_batches)]

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per valid token over the held-out batches of every rank.

        With FSDP the root unit is resharded at the end: FSDP2 keeps the root's gathered
        parameters after a forward (for the backward that would follow), and until the next
        step they would stand in for the masters -- the compute-dtype copies, which
        `save_hf_checkpoint` would then have written after a final evaluation."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for index in self.eval_batches():
            for ids, labels, pos, cu_seqlens in self.batch(index, held_out=True):
                sums[0] += self.model(ids, pos, labels, cu_seqlens=cu_seqlens).double()
                sums[1] += count_valid(labels).double()
        if self.cfg.fsdp:
            self.model.reshard()
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's training state by kind, counted by storage: "params" (the
        masters and the compute copy; with FSDP the local shards), "grads" (the masters'
        gradients: call between `forward_backward` and `optimizer_step`), "optimizer"."""
        params = [*self.master.parameters(), *self.model.parameters()]
        grads = [p.grad for p in self.master.parameters()]
        states = [t for s in self.optimizer.state.values() for t in s.values()]
        return {
            "params": _storage_bytes(params),
            "grads": _storage_bytes(grads),
            "optimizer": _storage_bytes(states),
        }

    def step(self, step: int) -> dict:
        """One training step, measured: loss, gradient norm, seconds, this rank's peak
        memory, and "skipped": None, or why the update was skipped.

        Memory: "peak_memory_bytes" is the device's (CUDA: `max_memory_allocated` over the
        step; CPU: the live tensor storages, persistent ones included -- there the device is
        the host, so offloaded state counts too). "host_state_bytes": with --fsdp-offload,
        the parameters, gradients and optimizer states held in host memory (after the
        backward, all gradients present; 0 without offload). A NaN or infinite loss
        or gradient norm raises NonFiniteError before the update, naming the step; with
        `cfg.skip_nonfinite_steps` the update is skipped instead (`skip_update`). One host
        read of the norm per step (the loss is read once per step already)."""
        persistent = _storage_bytes(
            [*self.model.parameters(), *self.master.parameters()]
            + [t for s in self.optimizer.state.values() for t in s.values()]
        )
        cuda = self.device.type == "cuda"
        dist.barrier()
        t0 = time.perf_counter()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with contextlib.nullcontext() if cuda else MemoryTracker() as mem:
            loss = self.forward_backward(step)
            host = sum(self.state_bytes().values()) if self.cfg.fsdp_offload else 0
            grad_norm = _full(self.clip_gradients()).item()
            skipped = self._nonfinite(step, loss, grad_norm)
            if skipped:
                self.skip_update()
            else:
                self.update()
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = persistent + mem.peak_bytes
        return {
            "loss": loss,
            "router_aux_loss": self.router_aux_loss,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "seconds": time.perf_counter() - t0,
            "peak_memory_bytes": peak,
            "host_state_bytes": host,
        }

    # checkpoints: torch distributed checkpoint, one directory per step (`checkpointing`)
    def save(self, step: int) -> Path:
        """Save the masters, the optimizer and the schedule after `step` steps."""
        return save_checkpoint(
            self.cfg.checkpoint_dir, step, self.master, self.optimizer, self.scheduler
        )

    def load_latest(self) -> tuple[int, list[str], str]:
        """Load the newest intact checkpoint (`load_latest_checkpoint`); returns its step (0
        if there is none and `cfg.resume_if_present`), one line per newer checkpoint skipped
        as damaged, and one line saying what goes on (which learning-rate schedule).

        The checkpoint's schedule (steps, warmup, floor, peak rate) goes on unless
        `cfg.reschedule`, which replaces it by this run's (the rate then jumps to this
        schedule's at the step reached). `cfg.resume` with no checkpoint in the directory is
        a `CheckpointError` naming it (the same on every rank: the listing is rank 0's)."""
        directory = self.cfg.checkpoint_dir
        step, skipped = load_latest_checkpoint(
            directory, self.master, self.optimizer, self.scheduler
        )
        if step is None:
            if not self.cfg.resume_if_present:
                raise CheckpointError(
                    f"--resume: no checkpoint in {directory} (a step_* directory written by "
                    "upipe train --checkpoint-dir): check the path, or pass "
                    "--resume-if-present to start from scratch when there is none"
                )
            return 0, skipped, f"no checkpoint in {directory}: starting from step 0"
        ours = LRSchedule(self.cfg.steps, self.cfg.warmup_steps, self.cfg.min_lr_ratio)
        saved, saved_lr = dataclasses.replace(self.schedule), self.scheduler.base_lrs[0]
        same = saved == ours and saved_lr == self.cfg.lr
        if self.cfg.reschedule and not same:
            self.schedule.__dict__.update(dataclasses.asdict(ours))
            self.scheduler.base_lrs = [self.cfg.lr] * len(self.scheduler.base_lrs)
            note = (
                f"rescheduled (--reschedule): lr {self.cfg.lr:g}, {ours}; the rate goes from "
                f"{saved_lr * saved(step):.4g} to {self.cfg.lr * ours(step):.4g} at step {step}"
            )
        elif same:
            note = f"the learning-rate schedule goes on: lr {saved_lr:g}, {saved}"
        else:
            note = (
                f"the checkpoint's learning-rate schedule goes on: lr {saved_lr:g}, {saved} "
                f"(this run asked for lr {self.cfg.lr:g}, {ours}; --reschedule replaces the "
                "schedule by this run's)"
            )
        # the next rate from the step reached and the schedule that goes on (the optimizer's
        # saved rate is that of the step before)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * self.schedule(step)
        if self.masters is not None:
            self.masters.copy_to_model()
        return step, skipped, f"resuming from step {step} in {directory}; {note}"


def _build(config: ModelConfig, dtype: torch.dtype, device) -> CausalLM:
    """A `CausalLM` of `config` with parameters of `dtype` on `device` (not initialised)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return CausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)


def check_same_options(cfg: TrainConfig) -> None:
    """Every rank was started with the same options (torchrun on several nodes starts one
    command per node); else the same `ValueError` on every rank, naming each option that
    differs and its value per rank. One all-gather of the options, before any other
    collective (a mismatch found later, e.g. in the attention's input check, names shapes,
    not the flag). `nproc` is exempt: torchrun ignores it."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dataclasses.asdict(cfg))
    lines = []
    for name in every[0]:
        if name == "nproc" or all(c[name] == every[0][name] for c in every):
            continue
        ranks = {}
        for r, c in enumerate(every):
            ranks.setdefault(repr(c[name]), []).append(str(r))
        where = "; ".join(
            f"{value} on rank{'s' * (len(rs) > 1)} {', '.join(rs)}" for value, rs in ranks.items()
        )
        lines.append(f"--{name.replace('_', '-')}: {where}")
    if lines:
        raise ValueError(
            "the ranks were started with different options: "
            + " | ".join(lines)
            + " (start every node with the same command)"
        )


def train(cfg: TrainConfig, device: torch.device | None = None) -> list[dict]:
    """Run `cfg` on this rank (default process group initialised); returns the per-step
    metrics on every rank (rank 0 also prints, logs and plots them).

    Faults: a resumed run starts from the newest intact checkpoint (damaged newer ones are
    skipped with a warning naming them) and rewrites the metrics file to the steps up to
    it; a NaN or infinite loss or gradient norm stops the run (`NonFiniteError`, naming the
    step) unless `cfg.skip_nonfinite_steps`. Output paths and --data are checked by the
    caller (`upipe.train.outputs.check_outputs`, `upipe.train.data.check_corpus`)."""
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_same_options(cfg)
    # every rank reads the metrics file, so that a bad one fails all of them, before any
    # collective (rank 0 alone rewrites it)
    rows, torn = read_metrics(cfg.metrics_file) if cfg.resume and cfg.metrics_file else ([], None)
    trainer = Trainer(cfg, device)
    resuming = cfg.resume or cfg.resume_if_present
    start, damaged, resumed = trainer.load_latest() if resuming else (0, [], None)
    history = [r for r in rows if r["step"] <= start] if rank == 0 else []
    tokens = cfg.seq_len * cfg.batch_size * trainer.dp * cfg.grad_accum
    bar = writer = None
    if rank == 0:
        from tqdm import tqdm

        # tqdm's default lock is a multiprocessing RLock, a named semaphore that leaks (and
        # multiprocessing's resource tracker warns about it) when this rank is killed, as
        # ranks are on Ctrl-C; the bar is written by this process alone, so a thread lock does
        tqdm.set_lock(threading.RLock())

        for line in damaged:
            print(f"warning: skipped damaged checkpoint {line}", file=sys.stderr)
        if resumed:
            print(resumed, file=sys.stderr)
        if torn:
            print(f"warning: metrics file {torn}", file=sys.stderr)
        if cfg.metrics_file:
            write_metrics(cfg.metrics_file, history)
        bar = tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.strategy}", unit="step")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # events of steps after `start` (an earlier run's) are hidden from TensorBoard
            writer = SummaryWriter(cfg.tensorboard, purge_step=start + 1)
    for step in range(start, cfg.steps):
        lr = trainer.lr
        m = trainer.step(step)
        memory = [None] * world
        dist.all_gather_object(memory, (m["peak_memory_bytes"], m["host_state_bytes"]))
        peaks = [peak for peak, _ in memory]
        row = {
            "step": step + 1,
            "loss": None if m["skipped"] else m["loss"],
            "grad_norm": None if m["skipped"] else m["grad_norm"],
            "lr": lr,
            "tokens_per_s": tokens / m["seconds"],
            "peak_memory_bytes": max(peaks),
            "peak_memory_bytes_per_rank": peaks,
            "seconds": m["seconds"],
            "strategy": cfg.strategy,
            "world_size": world,
        }
        if cfg.fsdp_offload:
            row["host_state_bytes"] = max(host for _, host in memory)
        if m["router_aux_loss"] is not None and not m["skipped"]:
            row["router_aux_loss"] = m["router_aux_loss"]
        if m["skipped"]:
            row["skipped"] = m["skipped"]
        last = step + 1 == cfg.steps
        if cfg.eval_every and (last or (step + 1) % cfg.eval_every == 0):
            row["eval_loss"] = trainer.evaluate()
        history.append(row)
        if rank == 0:
            bar.set_postfix(
                loss="skipped" if m["skipped"] else f"{m['loss']:.4f}",
                tok_s=f"{row['tokens_per_s']:.0f}",
                peak_MiB=f"{max(peaks) / 2**20:.0f}",
            )
            bar.update()
            if cfg.metrics_file:
                append_metrics(cfg.metrics_file, row)
            if writer is not None:
                keys = ("loss", "router_aux_loss", "eval_loss", "lr", "tokens_per_s")
                for key in (*keys, "peak_memory_bytes"):
                    if row.get(key) is not None:
                        writer.add_scalar(f"train/{key}", row[key], step + 1)
        every = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
        if cfg.checkpoint_dir and (last or every):
            trainer.save(step + 1)
    if cfg.save_hf:  # every rank (a sharded model is gathered); rank 0 writes
        save_hf(trainer, cfg)
    if rank == 0:
        bar.close()
        if writer is not None:
            writer.close()
        if cfg.plot and history:
            plot_loss(
                history, cfg.plot, f"{cfg.model}, {cfg.strategy}, S={cfg.seq_len}, {world} ranks"
            )
    return history


def save_hf(trainer: Trainer, cfg: TrainConfig) -> None:
    """--save-hf: the trained masters as a Hugging Face model directory (a collective: every
    rank gathers its shards, rank 0 writes) with the tokenizer it was trained with, so that
    `AutoModelForCausalLM` and `AutoTokenizer` both load it: --tokenizer's files
    (`copy_tokenizer`; the byte tokenizer has none), and config.json's `eos_token_id` the
    id that ended every training document where --init-from-hf's config names none."""
    base = read_hf_config(cfg.init_from_hf) if cfg.init_from_hf else {}
    if base.get("eos_token_id") is None:
        base["eos_token_id"] = trainer.data.tokenizer.eos_id
    save_hf_checkpoint(trainer.master, cfg.save_hf, base_config=base)
    if isinstance(trainer.data.tokenizer, HFTokenizer) and dist.get_rank() == 0:
        copy_tokenizer(cfg.tokenizer, cfg.save_hf)


def have_tensorboard() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def plot_loss(history: list[dict], path: str, title: str) -> None:
    """Loss (and the held-out loss, if evaluated) vs step as a PNG (`upipe.plot`: without
    matplotlib, an optional dependency, a warning and no plot); skipped steps are gaps."""
    trained = [r for r in history if r.get("loss") is not None]
    steps = [r["step"] for r in trained]
    train = Series(
        label="train",
        xs=steps,
        ys=[r["loss"] for r in trained],
        style={"marker": "." if len(steps) < 50 else None},
    )
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    series = [train]
    if evals:
        xs, ys = zip(*evals, strict=True)
        series.append(Series(label="held-out", xs=list(xs), ys=list(ys), style={"fmt": "o--"}))
    else:
        train.label = None
    panel = Panel(
        series=series, xlabel="step", ylabel="loss (nats/token)", title=title, integer_x=True
    )
    save_plot(path, [panel], size=(6, 3.5))


def summary(history: list[dict]) -> str:
    """The run in a few lines: first/last loss, median tokens/s, peak memory per rank, the
    steps skipped for a non-finite loss or gradient norm."""
    trained = [r for r in history if r.get("loss") is not None]
    skipped = [r["step"] for r in history if r.get("skipped")]
    note = (
        f"; skipped {len(skipped)} step(s) with a non-finite loss or gradient norm: {skipped}"
        if skipped
        else ""
    )
    if not trained:
        return ("no steps run" if not history else "no step was trained") + note
    tps = sorted(r["tokens_per_s"] for r in history)
    peak = max(r["peak_memory_bytes"] for r in history)
    return (
        f"steps {history[0]['step']}..{history[-1]['step']}: loss {trained[0]['loss']:.4f} -> "
        f"{trained[-1]['loss']:.4f} (ln 257 = {math.log(257):.3f}); median "
        f"{tps[len(tps) // 2]:.0f} tokens/s; peak memory per rank {peak / 2**20:.1f} MiB" + note
    )
