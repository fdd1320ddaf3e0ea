"""`upipe plan`: the longest sequence each strategy can train on given GPUs, by simulation.

For every strategy (and with / without the memory features) the planner simulates rank 0's
training step (`upipe.planner.step.StepSimulator`: the code of `upipe train` under fake
tensors) and searches the longest sequence, a multiple of the granularity, whose device peak
plus the reserve fits the GPU memory. Peak memory grows with the sequence length, so the
search brackets the boundary (secant guesses on the measured peaks, then bisection) and
returns it exactly on the granularity.

The reserve (default 5 GiB of 80) stands for what no tensor shows: the CUDA context and
kernels (about 0.5-1 GiB), NCCL's communication buffers (about 1 GiB), kernel workspaces and
the caching allocator's fragmentation (a few per cent).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time

from upipe.attention.registry import STRATEGIES, get_strategy
from upipe.heads import stage_candidates, usp_ulysses_size
from upipe.kernels import KERNELS
from upipe.model import PRESETS, get_config
from upipe.planner.command import train_command
from upipe.planner.runner import cost, run_all
from upipe.planner.search import GROWTH, device_floor, max_fitting  # noqa: F401 (also from here)
from upipe.planner.step import StepSimulator
from upipe.plot import Panel, Series, save_plot
from upipe.train.config import TrainConfig, default_dtype, default_fsdp, validate

GiB = 2**30
# the first and last blocks differ from the others (FSDP prefetch, the loss after the last
# block), so the linear extrapolation needs two depths with an interior block: 2 and 3 blocks
# overestimate with the memory features (29.97 vs 19.66 GiB, llama3-8b at 512K on 8 ranks),
# 3 and 4 match the full depth exactly (tests/runs/test_plan.py, docs/plan.md)
EXTRAPOLATION_DEPTHS = (3, 4)
FEATURES = ("mlp", "loss", "recompute", "offload")  # the memory features "on" turns on
# --attention-outputs as feature tokens: kept on the GPU, or offloaded beside the inputs
ATTENTION_TOKENS = {"keep": "keep", "aoff": "offload"}


_TRAIN = TrainConfig()  # `upipe train`'s defaults, which the plan's shared options take


@dataclasses.dataclass(kw_only=True)
class PlanConfig:
    model: str = dataclasses.field(default="llama3-8b", metadata={"choices": sorted(PRESETS)})
    """Model preset of upipe's own model (Hugging Face models, among them the hybrid
    qwen3-next-80b-a3b: --hf-config)."""
    model_config: str | None = None
    """JSON file of ModelConfig fields (overrides the preset's)."""
    hf_config: str | None = None
    """Plan the Hugging Face path instead of upipe's own model: a transformers config.json
    (path) or a shipped one (llama-3.1-8b, qwen3-8b, qwen2.5-7b, mistral-7b-v0.3, and the
    hybrid qwen3-next-80b-a3b), its model class simulated with apply_context_parallel, FSDP2
    and AdamW, weights, gradients and AdamW states in --dtype (--master-dtype is not used;
    upipe.planner.hf; a hybrid's Gated DeltaNet layers scan with fla's kernel on cuda,
    upipe's own scan on cpu: docs/hybrid.md)."""
    gpus: int = 8
    """Number of GPUs (ranks)."""
    gpu_memory_gib: float | None = None
    """Memory per GPU in GiB (default: 80 with --device cuda; with --device cpu this
    machine's memory available now, MemAvailable capped by the container's cgroup, shared by
    the --gpus ranks as `upipe train` spawns them)."""
    reserve_gib: float | None = None
    """Memory per GPU that tensors cannot use (default: 5 GiB on CUDA for its context, NCCL
    buffers and fragmentation; 0.5 GiB per rank on CPU for the process and torch itself)."""
    host_memory_gib: float = 256.0
    """Host memory per GPU for the offloaded block inputs (and with fsdp-offload the sharded
    parameters, gradients and optimizer states), in GiB (256: 2 TiB per 8-GPU
    node; 128 for 1 TiB; inf: unlimited, the need is only reported)."""
    device: str = dataclasses.field(default="cuda", metadata={"choices": ("cuda", "cpu")})
    """The platform planned: cuda charges the CUDA kernels' memory (flash-attn's backward
    buffers, fused RMSNorm, out_dtype GEMMs) and offloads to host memory; cpu charges the CPU
    kernels' and offloads nothing, as `upipe train` runs on CPU (to check a plan against a
    real run on this machine)."""
    attention_kernel: str = dataclasses.field(default="auto", metadata={"choices": KERNELS})
    """The CUDA attention kernel whose backward workspace is charged (`upipe.kernels_cuda.
    backward_workspace_bytes`: cudnn and fa3/fa4 hold less than flash-attn 2 for GQA); auto
    is charged as flash, the largest for GQA with H / G >= 4."""
    granularity: int = 65536
    """Sequence lengths searched are multiples of this."""
    max_seq_len: int = 16 * 2**20
    """Longest sequence considered."""
    strategies: tuple[str, ...] = tuple(STRATEGIES)
    """Strategies to plan (upipe once per --heads-per-stage)."""
    heads_per_stage: tuple[int, ...] = ()
    """UPipe candidates' heads per stage U (as `upipe train --heads-per-stage`; multiples
    of the ulysses size). Default: the ulysses size C (one head per rank per stage) and 2C."""
    upipe_rings: tuple[int, ...] = ()
    """Ring degrees R of the upipe candidates (each stage a ring attention over R ranks,
    Ulysses over gpus / R). Default: 1, and with more than 8 GPUs also gpus / 8 (Ulysses
    inside an 8-GPU node, the ring across nodes, as USP)."""
    features: tuple[str, ...] = ("off", "on", "on+ckpt2+fsdp-offload")
    """Memory feature sets to plan (default: none; the four; the four with checkpoints of 2
    blocks and FSDP2's states in host memory): off, on (all four), or some of mlp (tiled MLP), loss
    (chunked loss), recompute (activation checkpointing), offload, on, ckpt<m> (m blocks per
    checkpoint), gpu<K> (the last K checkpoints' inputs stay on the GPU), fsdp-offload (FSDP2's
    sharded parameters, gradients and optimizer states in host memory), keep (the attention
    outputs kept for the recomputation, on the GPU), aoff (kept in host memory beside the
    offloaded inputs) joined by '+', e.g. mlp+loss+recompute, on+ckpt2 or on+aoff."""
    mlp_tile: int = 16384
    """Tokens per MLP tile (with features)."""
    loss_chunk: int = 8192
    """Tokens per cross-entropy chunk (with features)."""
    batch_size: int = 1
    """Sequences per step (per data-parallel rank: every GPU for `none`)."""
    fsdp: bool | None = None
    """Shard parameters, gradients and optimizer states (FSDP2) over all GPUs (default: on
    with --device cuda, off on cpu: the rule `upipe train` follows, one function for both)."""
    document_mask: bool = _TRAIN.document_mask
    """As `upipe train --document-mask` (the same default), for the command printed: the
    step is planned for one document per sequence, the most memory a batch can hold (with
    documents the trainer runs the rows one at a time; on CUDA a stage's documents are one
    varlen kernel call, no larger than the dense one)."""
    dtype: str | None = dataclasses.field(
        default=None, metadata={"choices": ("bfloat16", "float32")}
    )
    """Compute dtype (the weights forward and backward use, and the activations; default:
    bfloat16 with --device cuda, float32 on cpu: the rule `upipe train` follows, one function
    for both)."""
    master_dtype: str = dataclasses.field(
        default="float32", metadata={"choices": ("float32", "bfloat16")}
    )
    """Dtype of the master weights, their gradients and the AdamW states (as `upipe train
    --master-dtype`): float32 is mixed precision with a bf16 --dtype; bfloat16 keeps
    everything in bf16 (what the planner assumed before 2026-11-30)."""
    extrapolate: bool = True
    """Simulate 3 and 4 blocks and extrapolate linearly to the model's depth (exact in every
    configuration checked, about 5x faster); --no-extrapolate simulates every block."""
    jobs: int = 2
    """Candidates simulated at once, each in a process of its own (one per CPU core)."""
    json: str | None = None
    """Write the results here (JSON)."""
    plot: str | None = None
    """Write peak memory vs sequence length per strategy here (PNG)."""


def extrapolation_depths(cfg: TrainConfig, n_layers: int, period: int = 1) -> tuple[int, int]:
    """The two depths to simulate for `cfg`: `EXTRAPOLATION_DEPTHS` in checkpoints rather
    than blocks (m blocks per checkpoint), plus the K checkpoints kept on the GPU, plus the
    n_layers mod m blocks of the model's last, shorter checkpoint -- so that both depths
    differ from the model only by whole interior checkpoints, offloaded ones with offload:

        depths = ((3 + K) m + r, (4 + K) m + r),  r = n_layers mod m

    A model whose layers repeat a pattern of `period` p layers (a hybrid's Gated DeltaNet and
    attention layers, `upipe.planner.hf.layer_period`) steps by whole patterns and whole
    checkpoints, u = lcm(m, p) layers, from the first multiple of u that holds 3 + K
    checkpoints and 3 patterns (a first, an interior and a last one, as the blocks above):

        depths = (c u + r, (c + 1) u + r),  c = max(ceil((3 + K) m / u), 3),  r = n_layers mod u

    (the same as above for p = 1). One and two patterns do not extrapolate: Qwen3-Next at 1M
    tokens on 8 ranks (UPipe, every memory feature) peaks where FSDP2 holds one layer's
    gathered experts at 4 layers and two at 8, and 4 and 8 layers extrapolate to 136.0 GiB
    where 48 layers hold 105.3; 8, 12 and 16 layers lie on one line through 48's."""
    m = cfg.blocks_per_checkpoint if cfg.activation_checkpoint else 1
    keep = cfg.keep_on_gpu if cfg.offload else 0
    u = math.lcm(m, period)
    first = EXTRAPOLATION_DEPTHS[0]
    c, r = max(-(-(first + keep) * m // u), first), n_layers % u
    return c * u + r, (c + 1) * u + r


def simulated_depths(pc: PlanConfig, cfg: TrainConfig, model) -> tuple[int, ...]:
    """The depths the planner simulates for candidate `cfg` of `pc`: `extrapolation_depths`
    with the model's layer period (`upipe.planner.hf.layer_period` with --hf-config), or the
    model's own depth where its layers have no period."""
    period = 1
    if pc.hf_config:
        from upipe.planner.hf import layer_period, load_hf_config

        period = layer_period(load_hf_config(pc.hf_config))
    if period is None:
        return (model.n_layers,)
    return extrapolation_depths(cfg, model.n_layers, period)


def feature_set(name: str, pc: PlanConfig | None = None) -> dict:
    """The TrainConfig fields of a --features entry: off, on (the four memory features), or
    names joined by '+': mlp, loss, recompute, offload, on, and ckpt<m> (m blocks per
    checkpoint; needs recompute), gpu<K> (the last K checkpoints' inputs kept on the GPU;
    needs offload), keep / aoff (`--attention-outputs keep` / `offload`: the recomputation
    reuses the forward's attention outputs, kept on the GPU / beside the offloaded inputs;
    need recompute / offload). `pc` gives the tile and chunk sizes (default: PlanConfig's)."""
    pc = pc or PlanConfig()
    kw = {"activation_checkpoint": False, "offload": False}
    if name == "off":
        return kw
    for token in name.split("+"):
        counted = re.fullmatch(r"(ckpt|gpu)([1-9][0-9]*)", token)
        if token in ("on", "mlp"):
            kw.update(tiled_mlp=True, mlp_tile=pc.mlp_tile)
        if token in ("on", "loss"):
            kw.update(chunked_loss=True, loss_chunk=pc.loss_chunk)
        if token in ("on", "recompute"):
            kw["activation_checkpoint"] = True
        if token in ("on", "offload"):
            kw["offload"] = True
        if token == "fsdp-offload":
            kw["fsdp_offload"] = True
        if token in ATTENTION_TOKENS:
            kw["attention_outputs"] = ATTENTION_TOKENS[token]
        if counted:
            field = "blocks_per_checkpoint" if counted[1] == "ckpt" else "keep_on_gpu"
            kw[field] = int(counted[2])
        elif token not in ("on", "fsdp-offload", *FEATURES, *ATTENTION_TOKENS):
            raise ValueError(
                f"--features {name!r}: unknown {token!r}; use off, on, or some of "
                f"{', '.join(FEATURES)}, on, ckpt<m>, gpu<K>, fsdp-offload, keep, aoff joined "
                "by '+' (e.g. mlp+loss+recompute, on+ckpt2, on+aoff)"
            )
    return kw


def _step(pc: PlanConfig) -> int:
    """The lengths searched: multiples of the granularity that every layout can split (ring
    and zigzag layouts need 2 chunks per rank)."""
    return math.lcm(pc.granularity, 2 * pc.gpus)


def _stage_candidates(pc: PlanConfig, spec, model) -> tuple:
    """(ring degree, heads per stage) pairs to plan for a strategy: for upipe each of
    `pc.upipe_rings` with each of `pc.heads_per_stage`, by default C and 2C (C = gpus / ring,
    the ulysses size); (None, None) for strategies without stages."""
    if not spec.heads_per_stage:
        return ((None, None),)
    rings = pc.upipe_rings or ((1, pc.gpus // 8) if pc.gpus > 8 and pc.gpus % 8 == 0 else (1,))
    pairs = []
    for ring in rings:
        uly = pc.gpus // ring
        U = pc.heads_per_stage or stage_candidates(model.n_heads, uly)
        pairs += [(ring, heads) for heads in U]
    return tuple(pairs)


def candidates(pc: PlanConfig, model) -> list[tuple[str, dict, str | None]]:
    """(label, TrainConfig fields, problem or None) of each strategy x features asked for."""
    rows, strategies = [], pc.strategies
    if pc.hf_config and strategies == PlanConfig().strategies:  # those the HF path runs
        from upipe.planner.hf import HF_STRATEGIES

        strategies = tuple(s for s in strategies if s in HF_STRATEGIES)
    fsdp, dtype = _train_defaults(pc)
    for strategy in strategies:
        spec = get_strategy(strategy)
        for ring, U in _stage_candidates(pc, spec, model):
            for feat in pc.features:
                kw = {"strategy": strategy, "nproc": pc.gpus, "fsdp": fsdp, "dtype": dtype}
                kw["document_mask"] = pc.document_mask
                kw["master_dtype"] = dtype if pc.hf_config else pc.master_dtype
                kw["batch_size"] = pc.batch_size
                kw["model"], kw["seq_len"] = pc.model, _step(pc)
                label = strategy
                if not spec.context_parallel:
                    kw["dp"] = pc.gpus
                if spec.needs_ring_and_ulysses:  # ulysses over as many GPUs as kv heads allow
                    kw["ring"] = pc.gpus // usp_ulysses_size(pc.gpus, model.n_kv_heads)
                    label = f"{strategy} {kw['ring']}x{pc.gpus // kw['ring']}"
                if U is not None:
                    kw["heads_per_stage"] = U
                    label = f"{strategy} U={U}"
                if ring and ring > 1:
                    kw["ring"] = ring
                    label = f"{strategy} {ring}x{pc.gpus // ring} U={U}"
                kw.update(feature_set(feat, pc))
                if feat != "off":
                    label += " +features" if feat == "on" else f" +{feat}"
                cfg = TrainConfig(**kw, plot=None)
                problem = _hf_problem(cfg, pc) if pc.hf_config else None
                rows.append((label, kw, problem or validate(cfg, pc.gpus, model)))
    return rows


def _hf_problem(cfg: TrainConfig, pc: PlanConfig) -> str | None:
    from upipe.planner.hf import hf_problem, load_hf_config

    return hf_problem(cfg, load_hf_config(pc.hf_config), pc.gpus)


def simulator(pc: PlanConfig, cfg: TrainConfig, model, **kw):
    """The simulator of candidate `cfg`: of upipe's own trainer (`StepSimulator`), or with
    --hf-config of the Hugging Face path (`upipe.planner.hf.HFStepSimulator`)."""
    if pc.hf_config:
        from upipe.planner.hf import HFStepSimulator, load_hf_config

        return HFStepSimulator(cfg, pc.gpus, load_hf_config(pc.hf_config), **kw)
    return StepSimulator(cfg, pc.gpus, model, **kw)


def _hf_checked(pc: PlanConfig):
    """With --hf-config: the config's shapes (`upipe.planner.hf.shapes`), after checking the
    options the Hugging Face path refuses (ValueError naming them)."""
    from upipe.planner.hf import HF_STRATEGIES, load_hf_config, shapes

    if pc.model_config:
        raise ValueError("--model-config changes upipe's own model: leave it out with --hf-config")
    if not pc.fsdp:
        raise ValueError(
            "--no-fsdp: the Hugging Face path is planned with FSDP2 (the docs/hf.md recipe); "
            "leave --fsdp on"
        )
    if pc.strategies != PlanConfig().strategies:
        refused = [s for s in pc.strategies if s not in HF_STRATEGIES]
        if refused:
            raise ValueError(
                f"--strategies {' '.join(refused)}: the Hugging Face path "
                f"(apply_context_parallel) runs {', '.join(HF_STRATEGIES)}"
            )
    return shapes(load_hf_config(pc.hf_config))


CUDA_MEMORY_GIB, CUDA_RESERVE_GIB, CPU_RESERVE_GIB = 80.0, 5.0, 0.5


def resolved(pc: PlanConfig) -> PlanConfig:
    """`pc` with its device's defaults filled in (--gpu-memory-gib, --reserve-gib, --fsdp): on CPU
    the memory available now (`upipe.train.fits.available_host_bytes`, the one `upipe train`
    checks a CPU job against) divided among the ranks."""
    if pc.device == "cpu":
        from upipe.train.fits import available_host_bytes

        memory = available_host_bytes() / GiB / pc.gpus
        memory, reserve = pc.gpu_memory_gib or memory, CPU_RESERVE_GIB
    else:
        memory, reserve = pc.gpu_memory_gib or CUDA_MEMORY_GIB, CUDA_RESERVE_GIB
    reserve = reserve if pc.reserve_gib is None else pc.reserve_gib
    fsdp, dtype = _train_defaults(pc)
    return dataclasses.replace(
        pc, gpu_memory_gib=round(memory, 3), reserve_gib=reserve, fsdp=fsdp, dtype=dtype
    )


def _train_defaults(pc: PlanConfig) -> tuple[bool, str]:
    """(--fsdp, --dtype) of `pc`, `upipe train`'s defaults for its device where not given."""
    fsdp = default_fsdp(pc.device) if pc.fsdp is None else pc.fsdp
    return fsdp, pc.dtype or default_dtype(pc.device)


def checked(pc: PlanConfig):
    """The model `pc` plans (its preset, with --model-config's fields) and the device budget
    in bytes (GPU memory - reserve), after checking `pc` (ValueError naming the fix)."""
    pc = resolved(pc)
    model = _hf_checked(pc) if pc.hf_config else get_config(pc.model)
    if pc.model_config:
        with open(pc.model_config) as f:
            model = dataclasses.replace(model, **json.load(f))
    budget = (pc.gpu_memory_gib - pc.reserve_gib) * GiB
    if budget <= 0:
        raise ValueError(
            f"--reserve-gib {pc.reserve_gib} leaves nothing of --gpu-memory-gib "
            f"{pc.gpu_memory_gib} ({pc.device}): give a smaller --reserve-gib"
            + (" or fewer --gpus (ranks share this machine's memory)" if pc.device == "cpu" else "")
        )
    if not pc.host_memory_gib > 0:
        raise ValueError(f"--host-memory-gib must be positive (or inf), got {pc.host_memory_gib}")
    if pc.master_dtype == "bfloat16" and pc.dtype == "float32":
        raise ValueError("--master-dtype bfloat16 is less precise than --dtype float32")
    if pc.jobs < 1 or pc.batch_size < 1:
        raise ValueError(f"--jobs and --batch-size must be >= 1, got {pc.jobs}, {pc.batch_size}")
    return model, budget


def plan(pc: PlanConfig, progress=None) -> dict:
    """Search every candidate of `pc` (`pc.jobs` at a time, each in a process of its own,
    the longest first: `upipe.planner.runner`); returns the JSON-ready results.
    `progress(row, res)` is called after each finished candidate with its row and the
    results so far (the rows not searched yet have no "max_seq_len"), and first with row
    None (the rows to search)."""
    pc = resolved(pc)
    model, budget = checked(pc)
    out = {"config": dataclasses.asdict(pc), "budget_bytes": budget, "strategies": []}
    todo = []
    for label, kw, problem in candidates(pc, model):
        out["strategies"].append({"strategy": label, "train_config": kw, "problem": problem})
        if not problem:
            depths = simulated_depths(pc, TrainConfig(**kw, plot=None), model)
            todo.append(
                (len(out["strategies"]) - 1, (pc, model, budget, label, kw), cost(kw, depths))
            )
    todo.sort(key=lambda t: -t[2])
    if progress:
        progress(None, out)

    def done(i, result):
        out["strategies"][i].update(result)
        if progress:
            progress(out["strategies"][i], out)

    run_all(_search, [(i, args) for i, args, _ in todo], pc.jobs, done)
    found = [r for r in out["strategies"] if r.get("max_seq_len")]
    if found and not pc.hf_config:  # the longest context's `upipe train` (the first of ties)
        best = max(found, key=lambda r: r["max_seq_len"])
        out["longest"] = best["strategy"]
        out["command"] = train_command(
            best["train_config"], pc.gpus, best["max_seq_len"], pc.device
        )
    return out


def _search(pc: PlanConfig, model, budget: float, label: str, kw: dict) -> dict:
    """The longest fitting sequence of one candidate, with the peaks measured on the way
    (`search.max_fitting`: from `GROWTH` steps, or from 1 step and below the first length
    `device_floor` rules out)."""
    cfg = TrainConfig(**kw, plot=None)
    step = _step(pc)
    depths = simulated_depths(pc, cfg, model) if pc.extrapolate else None
    host_budget = pc.host_memory_gib * GiB
    mems, start = {}, time.perf_counter()
    sim_kw = dict(depths=depths, kernels=pc.device, attention_kernel=pc.attention_kernel)
    with simulator(pc, cfg, model, **sim_kw) as sim:

        def used(S):
            """The fractions of the budgets S needs: of the device memory, of the host
            memory (if that is budgeted), and of the device memory by phase (all grow with
            S; the phases are at most the peak, so they only guide the search)."""
            m = mems[S] = sim.step(S, explain=True)  # what is live at the peak: about free
            phases = [b / budget for b in m.phase_bytes.values()]
            return (m.peak_bytes / budget, m.host_peak_bytes / host_budget, *phases)

        probe = min(GROWTH, pc.max_seq_len // step)
        floors = (  # (k, the bound at k steps), up to the first length the bound rules out
            (k, device_floor(dataclasses.replace(cfg, seq_len=k * step), pc.gpus, model))
            for k in range(2, probe + 1)  # (one step is simulated whatever: its peak is shown)
        )
        over = next((k for k, floor in floors if floor > budget), None)
        first = probe if over is None else 1
        best, _ = max_fitting(used, 1.0, step, pc.max_seq_len, first=first, over=over)
    beyond = mems.get(best + step)  # measured unless best is the limit or the bound's `over`
    row = {
        "max_seq_len": best,
        "limited_by": (
            "max_seq_len"
            if best + step > pc.max_seq_len
            else "device memory"
            if beyond is None or beyond.peak_bytes > budget
            else "host memory"
        ),
        "seconds": round(time.perf_counter() - start, 2),
        "points": [
            {
                "seq_len": S,
                "peak_bytes": m.peak_bytes,
                "host_bytes": m.host_peak_bytes,
                "phase_bytes": m.phase_bytes,
            }
            for S, m in sorted(mems.items())
        ],
    }
    if best:
        row["host_bytes_at_max"] = mems[best].host_peak_bytes
        row["at_peak"] = [[n, what] for n, what in mems[best].at_peak[:6]]
    return row


def table(res: dict) -> str:
    """The results as a text table: max context, peak there, host RAM, top tensor."""
    w = max([24] + [len(r["strategy"]) for r in res["strategies"]])  # the label column
    lines = [
        f"budget per GPU: {res['budget_bytes'] / GiB:.2f} GiB of tensors "
        f"({res['config']['gpu_memory_gib']} GiB - {res['config']['reserve_gib']} GiB reserve), "
        f"{res['config']['host_memory_gib']:g} GiB of host memory for offload "
        f"({res['config']['device']} kernels)",
        f"{'strategy':{w}} {'max tokens':>12} {'peak GiB':>9} {'host GiB':>9}  largest at peak",
    ]
    if res["config"].get("hf_config"):
        lines.insert(0, f"Hugging Face path: {res['config']['hf_config']} (upipe.planner.hf)")
    waiting = 0
    for r in res["strategies"]:
        if r["problem"]:
            lines.append(f"{r['strategy']:{w}} {'n/a':>12}  {r['problem']}")
            continue
        if "max_seq_len" not in r:  # (a partial table: not searched yet)
            waiting += 1
            continue
        S = r["max_seq_len"]
        pts = {p["seq_len"]: p for p in r["points"]}
        if not S:
            shortest = min(pts)
            lines.append(
                f"{r['strategy']:{w}} {0:>12} {pts[shortest]['peak_bytes'] / GiB:>9.2f} "
                f"{'':>9}  does not fit: this is the peak at {shortest:,} tokens"
            )
            continue
        top = r["at_peak"][0][1] if r["at_peak"] else ""
        if r["limited_by"] != "device memory":
            top = f"({r['limited_by']}) {top}"
        lines.append(
            f"{r['strategy']:{w}} {S:>12,} {pts[S]['peak_bytes'] / GiB:>9.2f} "
            f"{r['host_bytes_at_max'] / GiB:>9.2f}  {top}"
        )
    if waiting:
        lines.append(f"({waiting} candidates not searched: stopped before they finished)")
    if res.get("command"):
        lines += [f"\nlongest: {res['longest']}, the command that trains it:", res["command"]]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    """Peak memory vs sequence length per strategy with memory features, with the budget
    line (PNG, `upipe.plot`): one color per strategy, one line style per feature set (the
    rows without features, all far left, are not drawn)."""
    colors, styles, series = {}, {}, []
    for r in res["strategies"]:
        base, _, feat = r["strategy"].partition(" +")
        if not r.get("points") or not feat:
            continue
        color = colors.setdefault(base, f"C{len(colors)}")
        fmt = styles.setdefault(feat, (".-", ".--", ".-.", ".:")[len(styles) % 4])
        pts = sorted((p["seq_len"], p["peak_bytes"]) for p in r["points"])
        xs, ys = [s / 1e6 for s, _ in pts], [b / GiB for _, b in pts]
        series.append(Series(label=r["strategy"], xs=xs, ys=ys, style={"fmt": fmt, "color": color}))
    c, budget = res["config"], res["budget_bytes"] / GiB
    panel = Panel(
        series=series,
        xlabel="sequence length (millions of tokens)",
        ylabel="peak memory per GPU (GiB)",
        title=f"{c.get('hf_config') or c['model']} on {c['gpus']} x {c['gpu_memory_gib']:g} GiB",
        ylim=(0, 1.5 * budget),
        hlines=[(budget, "budget")],
    )
    save_plot(path, [panel], size=(12, 6.5), legend_below=True)
