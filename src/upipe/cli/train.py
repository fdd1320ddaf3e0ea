"""`upipe train`: train on spawned CPU ranks, or on the ranks torchrun launched.

    upipe train                                   # CPU demo: 4 spawned gloo ranks, tiny model
    upipe train --strategy ulysses --seq-len 16384 --metrics-file m.jsonl
    torchrun --nproc-per-node 8 -m upipe.train --model llama3-8b --device cuda --fsdp ...

The launch is decided here, from the environment torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK); the training itself is `upipe.train.train`.

Before any rank starts: the options are validated, every --data record is read once
(`check_corpus`) and every output path is checked writable (`check_outputs`); a problem is
one line and exit status 2. A run that fails ends with one line saying what happened to
which rank (raised, killed, frozen; `upipe.launch.DistributedError`) and exit status 1;
the traceback is printed above it only for an error that is not one of upipe's explained
ones (`EXPLAINED`). Under torchrun each rank dies with its torchrun agent (even on kill -9)
and prints an explained error as one line; torchrun's summary names the failed ranks with
their errors and tracebacks (`torch.distributed.elastic.multiprocessing.errors.record`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from upipe.cli.options import add_dataclass_options, config_from_args
from upipe.cli.stops import stopped
from upipe.launch import DistributedError, LocalCluster, die_with_parent
from upipe.plot import have_matplotlib
from upipe.train import peers
from upipe.train.checkpointing import CheckpointError
from upipe.train.config import TrainConfig, model_config, padded_length, validate
from upipe.train.data import check_corpus
from upipe.train.fits import GiB, available_host_bytes, check_fits, oom_kills, state_bytes
from upipe.train.loop import NonFiniteError, have_tensorboard, summary, train
from upipe.train.outputs import check_outputs

# errors whose message says what happened and what to do: printed without a traceback
EXPLAINED = (ValueError, CheckpointError, NonFiniteError)


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


# how `upipe train --help` groups its options (every TrainConfig field; tests/runs/test_cli.py)
OPTION_GROUPS = {
    "model and parallelism": (
        "model", "strategy", "nproc", "dp", "ring", "heads_per_stage", "device",
        "attention_kernel", "fsdp", "fsdp_offload", "timeout",
    ),
    "data": (
        "data", "skip_bad_records", "tokenizer", "seq_len", "batch_size", "document_mask", "seed",
    ),
    "optimization": (
        "steps", "lr", "warmup_steps", "min_lr_ratio", "grad_accum", "grad_clip",
        "weight_decay", "skip_nonfinite_steps", "router_aux_loss_coef",
    ),
    "precision": ("dtype", "master_dtype"),
    "memory features": (
        "tiled_mlp", "mlp_tile", "chunked_loss", "loss_chunk", "activation_checkpoint",
        "blocks_per_checkpoint", "offload", "keep_on_gpu", "attention_outputs", "check_memory",
    ),
    "evaluation": ("eval_every", "eval_batches", "eval_fraction"),
    "logging": ("metrics_file", "tensorboard", "plot"),
    "checkpoints and weights": (
        "checkpoint_dir", "checkpoint_every", "resume", "resume_if_present", "reschedule",
        "init_from_hf", "save_hf",
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
    corpus = None
    if problem is None and cfg.data is not None:  # the default corpus is upipe's own
        try:
            corpus = check_corpus(cfg.data, skip_bad=cfg.skip_bad_records)
        except (ValueError, ImportError) as e:
            problem = str(e)
    if problem is None:
        problem = check_outputs(cfg)
    if problem is None and cfg.tensorboard and not have_tensorboard():
        problem = (
            "--tensorboard needs the tensorboard package: pip install 'upipe[train]' "
            "(or pip install tensorboard)"
        )
    if problem is None and cfg.device == "cpu" and not _under_torchrun():
        problem = check_fits(
            cfg, world, available_host_bytes(), sharing=world, where="this machine"
        )
    if problem is None and cfg.check_memory:
        problem = _simulated_fit(cfg, world)
    if problem:
        parser.error(problem)
    if cfg.plot and not have_matplotlib():
        print(
            f"note: no loss plot ({cfg.plot}): matplotlib is not installed "
            "(pip install 'upipe[train]'; --plot '' silences this)",
            file=sys.stderr,
        )
        cfg = dataclasses.replace(cfg, plot=None)
    if corpus is not None and int(os.environ.get("RANK", 0)) == 0:
        line = f"data: {corpus.documents} documents in {corpus.sources} sources checked"
        if corpus.skipped:
            line += (
                f"; left out {len(corpus.skipped)} bad records (--skip-bad-records), the "
                f"first: {corpus.skipped[0]}"
            )
        print(line, flush=True)
    return run(cfg)


def _simulated_fit(cfg: TrainConfig, world: int) -> str | None:
    """--check-memory: the planner's simulation of one step of this job (rank 0, the worst
    rank's loops; `upipe.planner.step`) against the memory of this machine (spawned CPU ranks:
    all of them) or of this rank's GPU; None if it fits, else the message."""
    from upipe.planner.plan import extrapolation_depths
    from upipe.planner.step import StepSimulator

    model = model_config(cfg)
    kernels = "cpu" if cfg.device == "cpu" else "cuda"
    depths = extrapolation_depths(cfg, model.n_layers)
    with StepSimulator(cfg, world, model, kernels=kernels, depths=depths) as sim:
        peak = sim.step(cfg.seq_len).peak_bytes
    if cfg.device == "cpu":
        sharing = 1 if _under_torchrun() else world
        budget, where = available_host_bytes(), "this machine"
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        sharing, where = 1, f"GPU {local}"
        budget = torch.cuda.get_device_properties(local).total_memory
    line = (
        f"--check-memory: one step peaks at {peak / GiB:.2f} GiB per rank (simulated), "
        f"{sharing * peak / GiB:.2f} GiB for {sharing} rank(s) on {where}, which has "
        f"{budget / GiB:.1f} GiB"
    )
    if sharing * peak > budget:
        return f"{line}: it does not fit; upipe plan --model {cfg.model} finds what does"
    print(f"{line}: it fits", flush=True)
    return None


def run(cfg: TrainConfig) -> int:
    """Train `cfg`: in this process under torchrun, else on `cfg.nproc` spawned CPU ranks."""
    if _under_torchrun():
        try:
            history = _run_torchrun(cfg)
        except EXPLAINED as e:
            print(
                f"upipe train: rank {os.environ['RANK']}: {type(e).__name__}: {e}", file=sys.stderr
            )
            return 1
        if history is None:
            return 0
    else:
        print(banner(cfg, cfg.nproc), flush=True)
        kills = oom_kills()
        try:  # (SIGTERM raises as Ctrl-C does: `upipe.cli.stops`)
            with LocalCluster(cfg.nproc, timeout_s=24 * 3600, pg_timeout_s=cfg.timeout) as cluster:
                history = cluster.run(_spawned_rank, cfg)[0]
        except DistributedError as e:
            return _failed(e, cfg, kills)
        except KeyboardInterrupt as e:
            ck = cfg.checkpoint_dir
            resume = f"; --resume continues from {ck}" if ck else ""
            return stopped("train", e, f": the ranks were stopped{resume}")
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


def banner(cfg: TrainConfig, world: int, ranks_per_node: int | None = None) -> str:
    """What this run is, printed by rank 0 before the first step: model, strategy, mesh
    (with node placement under torchrun: the mesh is (dp, ring, ulysses) over consecutive
    ranks, so a Ulysses group stays inside a node when the node's rank count is a multiple of
    its size), sequence length, memory features, precision, schedule."""
    m = model_config(cfg)
    dp, ring, uly = cfg.degrees(world)
    names = ("tiled_mlp", "chunked_loss", "activation_checkpoint", "offload", "fsdp")
    features = [n for n in names if getattr(cfg, n)]
    if cfg.activation_checkpoint and cfg.blocks_per_checkpoint > 1:
        features.append(f"blocks_per_checkpoint={cfg.blocks_per_checkpoint}")
    if cfg.attention_outputs != "recompute":
        features.append(f"attention_outputs={cfg.attention_outputs}")
    if ranks_per_node is None:
        where = f"{world} CPU ranks (dp {dp} x ring {ring} x ulysses {uly})"
    else:
        nodes = -(-world // ranks_per_node)
        inside = "inside" if ranks_per_node % uly == 0 else "ACROSS"
        where = (
            f"{world} {cfg.device.upper()} ranks on {nodes} node(s) of {ranks_per_node} (dp "
            f"{dp} x ring {ring} x ulysses {uly}: each Ulysses group of {uly} consecutive "
            f"ranks is {inside} a node; kernel {cfg.attention_kernel})"
        )
    name = cfg.init_from_hf or cfg.model
    padded = padded_length(cfg, world)
    precision = f"{cfg.dtype} compute"
    if cfg.master_dtype != cfg.dtype:
        precision += f", {cfg.master_dtype} master weights, gradients and AdamW states"
    return (
        f"{name} ({m.num_params() / 1e6:.2f}M parameters), strategy {cfg.strategy}, {where}, "
        f"{cfg.seq_len} tokens per sequence, memory features: {features or 'none'}\n"
        f"precision: {precision}; lr {cfg.lr:g} (warmup {cfg.warmup_steps} steps, cosine "
        f"to {cfg.min_lr_ratio:g}x); {cfg.grad_accum} micro-batch(es) per step"
        + (f"; sequences padded to {padded} (the tail ignored)" if padded > cfg.seq_len else "")
        + ("; documents masked" if cfg.document_mask else "; attention across documents")
    )


def _failed(e: DistributedError, cfg: TrainConfig, oom_kills_before: int | None) -> int:
    """Say in one line what happened to which rank; above it the traceback of the first
    error, if that is not an explained one and no rank died or froze (which explains the
    errors of its peers). A rank killed by SIGKILL that nobody sent it: probably the
    kernel's out-of-memory killer, said with the job's lower bound (`upipe.train.fits`)."""
    explained = {f"{c.__module__}.{c.__qualname__}" for c in EXPLAINED}
    first = next((f for f in e.failures if f.what == "raised"), None)
    died = any(f.what in ("killed", "exited", "frozen") for f in e.failures)
    if first is not None and first.error_type not in explained and not died:
        print(first.traceback, file=sys.stderr)
    print(f"upipe train: {e.summary}", file=sys.stderr)
    killed = any(f.what == "killed" and "SIGKILL" in f.message for f in e.failures)
    now = oom_kills()
    if killed and (now is None or oom_kills_before is None or now > oom_kills_before):
        need = cfg.nproc * state_bytes(cfg, cfg.nproc)
        why = (
            "was stopped by the kernel's out-of-memory killer (its oom_kill count rose)"
            if now is not None and oom_kills_before is not None
            else "was probably stopped by the kernel's out-of-memory killer, if nobody sent it"
        )
        print(
            f"upipe train: the rank killed by SIGKILL {why}: this job needs at least "
            f"{need / GiB:.1f} GiB before activations, {available_host_bytes() / GiB:.1f} GiB "
            "are available now; try the memory features (--tiled-mlp --chunked-loss "
            "--activation-checkpoint), --fsdp, a shorter --seq-len or a smaller --model "
            "(upipe plan --device cpu plans it)",
            file=sys.stderr,
        )
    return 1


def _spawned_rank(rank: int, world_size: int, cfg: TrainConfig):
    return train(cfg)


@record
def _run_torchrun(cfg: TrainConfig):
    """This process is one torchrun rank: initialise, train, tear down; rank 0 returns.
    What torchrun does on a fault: its agent watches its ranks; when one exits with an error
    or is killed it stops the others (SIGTERM, then SIGKILL) and reports each failed rank
    (exit code or signal, and with `record` the exception). Ranks run in their own session,
    so a torchrun killed by SIGKILL would leave them running: `die_with_parent` ends each
    with it. A frozen rank is not seen by torchrun; its peers time out after --timeout."""
    die_with_parent()
    if cfg.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        # before any collective; the same verdict on every rank of a job on one GPU type
        total = torch.cuda.get_device_properties(device).total_memory
        problem = check_fits(cfg, int(os.environ["WORLD_SIZE"]), total, sharing=1,
                             where=f"GPU {device.index}")  # fmt: skip
        if problem:
            raise ValueError(problem)
        # --fsdp-offload: the gradient norm, checkpoints and --save-hf reduce CPU tensors
        backend = "cuda:nccl,cpu:gloo" if cfg.fsdp_offload else "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    placements = peers.gather_placements()
    if dist.get_rank() == 0:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        print(banner(cfg, dist.get_world_size(), per_node), flush=True)
    try:
        history = train(cfg, device)
    except RuntimeError as e:
        if not peers.is_peer_loss(e):
            raise
        # one line, the traceback in a file (`upipe.train.peers`); then os._exit: the
        # process group cannot be torn down with a peer gone, and `record` writes no error
        # file, so torchrun's summary shows the exit code, not the traceback once more
        me = placements[dist.get_rank()]
        print(peers.report(e, placements, me, cfg.checkpoint_dir or "."), file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return history if int(os.environ["RANK"]) == 0 else None
