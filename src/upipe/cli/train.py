"""`upipe train`: train on spawned CPU ranks, or on the ranks torchrun launched.

    upipe train                                   # CPU demo: 4 spawned gloo ranks, tiny model
    upipe train --strategy ulysses --seq-len 16384 --metrics-file m.jsonl
    torchrun --nproc-per-node 8 -m upipe.train --model llama3-8b --device cuda --fsdp ...

The launch is decided here, from the environment torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK); the training itself is `upipe.train.train`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist

from upipe.cli.options import add_dataclass_options, config_from_args
from upipe.launch import LocalCluster
from upipe.plot import have_matplotlib
from upipe.train.config import TrainConfig, model_config, padded_length, validate
from upipe.train.data import corpus_files
from upipe.train.loop import have_tensorboard, summary, train


def add_command(sub) -> None:
    """`upipe train` (see `upipe.cli`)."""
    parser = sub.add_parser(
        "train",
        help="train a Llama/Qwen-style model with context parallelism (CPU demo by default)",
        description=(
            "Train a decoder on packed documents with its attention split across ranks. "
            "Without torchrun it spawns --nproc gloo ranks on this machine; under torchrun "
            "(`torchrun --nproc-per-node N -m upipe.train ...`) it uses the launched ranks. "
            "Shows loss, tokens/s and per-rank peak memory; writes metrics (JSON lines), "
            "checkpoints and a loss plot when asked."
        ),
    )
    add_dataclass_options(parser, TrainConfig, groups=OPTION_GROUPS)
    parser.set_defaults(handler=_handle)


# how `upipe train --help` groups its options (every TrainConfig field; tests/test_cli.py)
OPTION_GROUPS = {
    "model and parallelism": (
        "model", "strategy", "nproc", "dp", "ring", "heads_per_stage", "device", "fsdp",
    ),
    "data": ("data", "tokenizer", "seq_len", "batch_size", "document_mask", "seed"),
    "optimization": (
        "steps", "lr", "warmup_steps", "min_lr_ratio", "grad_accum", "grad_clip",
    ),
    "precision": ("dtype", "master_dtype"),
    "memory features": (
        "tiled_mlp", "mlp_tile", "chunked_loss", "loss_chunk", "activation_checkpoint", "offload",
    ),
    "evaluation": ("eval_every", "eval_batches", "eval_fraction"),
    "logging": ("metrics_file", "tensorboard", "plot"),
    "checkpoints and weights": (
        "checkpoint_dir", "checkpoint_every", "resume", "init_from_hf", "save_hf",
    ),
}  # fmt: skip


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _handle(ns, parser) -> int:
    cfg = config_from_args(TrainConfig, ns, plot=ns.plot or None)
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else cfg.nproc
    problem = validate(cfg, world)
    if problem is None and cfg.device == "cuda" and not _under_torchrun():
        problem = (
            "--device cuda runs one process per GPU: torchrun --nproc-per-node N -m upipe.train"
        )
    if problem is None:
        try:
            corpus_files(cfg.data)
        except ValueError as e:
            problem = str(e)
    if problem is None and cfg.tensorboard and not have_tensorboard():
        problem = (
            "--tensorboard needs the tensorboard package: pip install 'upipe[train]' "
            "(or pip install tensorboard)"
        )
    if problem:
        parser.error(problem)
    if cfg.plot and not have_matplotlib():
        print(
            f"note: no loss plot ({cfg.plot}): matplotlib is not installed "
            "(pip install 'upipe[train]'; --plot '' silences this)",
            file=sys.stderr,
        )
        cfg = dataclasses.replace(cfg, plot=None)
    return run(cfg)


def run(cfg: TrainConfig) -> int:
    """Train `cfg`: in this process under torchrun, else on `cfg.nproc` spawned CPU ranks."""
    m = model_config(cfg)
    if _under_torchrun():
        history = _run_torchrun(cfg)
        if history is None:
            return 0
    else:
        dp, ring, uly = cfg.degrees(cfg.nproc)
        features = [
            n
            for n in ("tiled_mlp", "chunked_loss", "activation_checkpoint", "offload", "fsdp")
            if getattr(cfg, n)
        ]
        name = cfg.init_from_hf or cfg.model
        print(
            f"{name} ({m.num_params() / 1e6:.2f}M parameters), strategy {cfg.strategy}, "
            f"{cfg.nproc} CPU ranks (dp {dp} x ring {ring} x ulysses {uly}), "
            f"{cfg.seq_len} tokens per sequence, memory features: {features or 'none'}",
            flush=True,
        )
        padded = padded_length(cfg, cfg.nproc)
        precision = f"{cfg.dtype} compute"
        if cfg.master_dtype != cfg.dtype:
            precision += f", {cfg.master_dtype} master weights, gradients and AdamW states"
        print(
            f"precision: {precision}; lr {cfg.lr:g} (warmup {cfg.warmup_steps} steps, cosine "
            f"to {cfg.min_lr_ratio:g}x); {cfg.grad_accum} micro-batch(es) per step"
            + (f"; sequences padded to {padded} (the tail ignored)" if padded > cfg.seq_len else "")
            + ("; documents masked" if cfg.document_mask else "; attention across documents"),
            flush=True,
        )
        with LocalCluster(cfg.nproc, timeout_s=24 * 3600, pg_timeout_s=1800) as cluster:
            history = cluster.run(_spawned_rank, cfg)[0]
    print(summary(history))
    for what, path in (
        ("metrics", cfg.metrics_file),
        ("loss plot", cfg.plot),
        ("tensorboard", cfg.tensorboard),
        ("checkpoints", cfg.checkpoint_dir),
        ("Hugging Face model", cfg.save_hf),
    ):
        if path:
            print(f"{what}: {path}")
    return 0


def _spawned_rank(rank: int, world_size: int, cfg: TrainConfig):
    return train(cfg)


def _run_torchrun(cfg: TrainConfig):
    """This process is one torchrun rank: initialise, train, tear down; rank 0 returns."""
    if cfg.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    try:
        history = train(cfg, device)
    finally:
        dist.destroy_process_group()
    return history if int(os.environ["RANK"]) == 0 else None
