"""`upipe bench`: upipe against the real peers, side by side, on identical inputs in one run.

    upipe bench                                         # CPU, 4 gloo ranks, a few minutes
    upipe bench --seq-lens 4096 8192 16384 --json r.json --plot r.png
    torchrun --nproc-per-node 8 -m upipe bench --device cuda      # GPUs, NCCL

Compares attention *ops* (q, k, v already projected, `[B, L, H, d]` shards): upipe's own
ulysses, upipe (several heads_per_stage), ring and usp, and the peers installed from the
optional `bench` extra (DeepSpeed-Ulysses) or by hand (yunchang, GPU only), plus PyTorch's
`context_parallel` where the device supports it. A missing or unsupported peer is skipped
with the reason. Reports per-rank peak memory (`upipe.MemoryTracker`), median
forward+backward time over interleaved rounds, and each method's error against a float64
reference; a wrong method is flagged and not ranked. Writes a table, one JSON document and
a PNG plot. The methods live in `upipe.bench.peers`, the measurement in `upipe.bench.run`;
only upipe's public API (plus `upipe.launch` and the float64 kernels) is used.
"""

from __future__ import annotations

import dataclasses
import os

from upipe.bench.layer import UpipeLayer, result_names
from upipe.bench.model import MODEL_METHODS
from upipe.bench.peers import DEFAULT_METHODS, PEERS, Method, UpipeMethod, make_method
from upipe.bench.run import TOLERANCE
from upipe.heads import kv_problem
from upipe.kernels import KERNELS

__all__ = ["BenchConfig", "DemoConfig", "PEERS", "run_bench"]

# the ratios' default baseline: the op benchmark's Ulysses-like methods, the first that ran
# (then --methods in order; `upipe.bench.run.baseline_candidates`)
BASELINES = ("ulysses", "deepspeed-ulysses", "yunchang-ulysses")


@dataclasses.dataclass(kw_only=True)
class BenchConfig:
    nproc: int = 4
    """CPU ranks (gloo) to spawn; ignored under torchrun (the world size is used)."""
    seq_lens: tuple[int, ...] = (2048, 4096, 8192)
    """Full sequence lengths S to measure (each divisible by 2 * nproc)."""
    methods: tuple[str, ...] = DEFAULT_METHODS
    """Methods, in table order: ulysses, upipe (U = nproc), upipe:U, ring, usp (ring 2 x
    ulysses nproc/2), and the peers deepspeed-ulysses, yunchang-ulysses, yunchang-usp,
    torch-cp."""
    baseline: str = ""
    """The method the ratios divide by: memory and time ratio = this method's / the
    baseline's (< 1: leaner / faster than it), one of --methods (with --layer --variants each
    variant against the baseline's same variant). Default: the run's Ulysses-like method,
    the first that ran of ulysses, deepspeed-ulysses, yunchang-ulysses (--whole-model: alst,
    alst-full, upipe-ulysses; with --hybrid upipe-ulysses), else the first of --methods."""
    heads: int = 16
    """Query heads H."""
    kv_heads: int = 4
    """Key/value heads G (G < H: grouped-query attention)."""
    head_dim: int = 32
    """Head dimension d."""
    batch_size: int = 1
    """Batch size B."""
    dtype: str = dataclasses.field(
        default="float32", metadata={"choices": ("float32", "bfloat16", "float16")}
    )
    """Input dtype, the same for every method."""
    causal: bool = True
    """Causal masking, the same for every method."""
    repeats: int = 3
    """Timed rounds (each method once per round, interleaved); the median is reported."""
    warmup_rounds: int = 1
    """Untimed rounds before the timed ones."""
    seed: int = 0
    """Seed of the random inputs."""
    device: str = dataclasses.field(default="cpu", metadata={"choices": ("cpu", "cuda")})
    """cpu: spawn nproc gloo ranks here. cuda: run under torchrun (NCCL), one GPU a rank."""
    attention_kernel: str = dataclasses.field(default="auto", metadata={"choices": KERNELS})
    """upipe's local attention kernel on CUDA (`upipe.kernels`; auto: by GPU and dtype); the
    peers keep their own."""
    json: str = "upipe-bench.json"
    """Write the JSON document here ('' to skip)."""
    plot: str = "upipe-bench.png"
    """Write the PNG plot here ('' to skip)."""
    layer: bool = False
    """Benchmark upipe's strategies as the whole attention layer (ContextParallelAttention:
    projections, RoPE, attention, o_proj; x and weight gradients; `upipe.bench.layer`)
    instead of the attention op on q/k/v. The peers are ops and are skipped."""
    window: int = 0
    """--layer: the layer's causal sliding window (token i sees keys i-window+1 .. i, as
    gpt-oss / Mistral sliding layers; `upipe.attention.window`); 0: full attention."""
    sinks: bool = False
    """--layer: the layer has attention sinks (gpt-oss: a learned logit per head in every
    softmax denominator; `upipe.attention.sinks`), and their gradient is checked too."""
    variants: bool = False
    """--layer with --window and/or --sinks: run every layer method also without them -- each
    variant of full causal, window, sinks, window + sinks that those flags name is a method
    of its own (its name says which), against its own float64 reference, in one run."""
    whole_model: bool = False
    """Benchmark a whole Hugging Face model's training step (`upipe.bench.model`): DeepSpeed
    ALST's attention against upipe's ulysses, upipe and the ALST drop-in, each also with
    ALST's tiled MLP, and each side's whole memory stack (alst-full, upipe-full, and
    upipe-train: upipe's own model); --methods from those (default: all of them). CPU, fp32."""
    vocab_size: int = 256
    """--whole-model: vocabulary V of the model (a real one: >= 32000)."""
    mlp_size: int = 0
    """--whole-model: MLP width (intermediate_size; 0: twice the width H * d)."""
    layers: int = 2
    """--whole-model: decoder layers."""
    activation_checkpoint: bool = False
    """--whole-model: every method checkpoints its decoder layers (transformers' gradient
    checkpointing; upipe's activation_checkpoint for upipe-full and upipe-train), as
    `upipe train --activation-checkpoint`."""
    mlp_tile: int = 1024
    """--whole-model: tokens per MLP tile of alst-full, upipe-full and upipe-train."""
    loss_chunk: int = 1024
    """--whole-model: tokens per loss chunk of alst-full, upipe-full and upipe-train."""
    reference_up_to: int = 0
    """Check the results against the float64 reference (--whole-model: the unsharded model) at the
    lengths up to this one only (0: at every length; the one-process reference costs about
    as much as a method's step, more in float64); unchecked rows show "-" as their error."""
    hybrid: bool = False
    """--whole-model: a hybrid Qwen3NextForCausalLM instead of a Llama -- Gated DeltaNet layers
    (--heads value heads over --kv-heads key heads of --head-dim) and, every fourth layer
    and the last, gated full attention (--heads query and --kv-heads kv heads), dense MLPs;
    only upipe's HF methods run (upipe, upipe-ulysses, upipe-full: ALST has no Gated
    DeltaNet)."""


@dataclasses.dataclass(kw_only=True)
class DemoConfig(BenchConfig):
    """`upipe demo`: the benchmark with upipe's own strategies at one length, once."""

    seq_lens: tuple[int, ...] = (16384,)
    """Full sequence lengths S (each divisible by 2 * nproc)."""
    methods: tuple[str, ...] = ("ulysses", "upipe", "ring")
    """Methods, in table order (see `upipe bench --help`)."""
    repeats: int = 1
    """Timed rounds; the median is reported."""
    warmup_rounds: int = 0
    """Untimed rounds before the timed ones."""
    json: str = ""
    """Write the JSON document here ('' to skip)."""
    plot: str = ""
    """Write the PNG plot here ('' to skip)."""


def validate(cfg: BenchConfig, nproc: int) -> str | None:
    """The first problem with `cfg` on `nproc` ranks as a one-line message, or None."""
    if nproc < 1:
        return f"--nproc must be >= 1, got {nproc}"
    bad = [S for S in cfg.seq_lens if S < 1 or S % (2 * nproc)]
    if bad:
        fix = [max(S, 1) + (-max(S, 1)) % (2 * nproc) for S in bad]
        return f"--seq-lens {bad} must be multiples of 2 * nproc = {2 * nproc}; try {fix}"
    problem = kv_problem(cfg.heads, cfg.kv_heads, query="--heads", kv="--kv-heads")
    if problem:
        return problem
    least = 0 if cfg.whole_model else 1  # --whole-model: the tracked step's time is reported too
    if cfg.repeats < least or cfg.warmup_rounds < 0:
        return (
            f"--repeats must be >= {least} and --warmup-rounds >= 0, got {cfg.repeats}, "
            f"{cfg.warmup_rounds}"
        )
    if cfg.attention_kernel != "auto" and cfg.device != "cuda":
        return f"--attention-kernel {cfg.attention_kernel} runs on CUDA (--device cuda)"
    if cfg.whole_model:
        return _model_problem(cfg)
    if cfg.hybrid:
        return "--hybrid is an option of --whole-model (a hybrid model's training step)"
    if cfg.window < 0:
        return f"--window must be >= 0 (0: none), got {cfg.window}"
    if cfg.reference_up_to < 0:
        return f"--reference-up-to must be >= 0, got {cfg.reference_up_to}"
    if (cfg.window or cfg.sinks) and not cfg.layer:
        return "--window and --sinks are options of the layer: add --layer"
    if cfg.window and not cfg.causal:
        return "--window needs causal attention (sliding windows look back only)"
    if cfg.variants and not (cfg.window or cfg.sinks):
        return "--variants runs the layer with and without --window / --sinks: give one of them"
    for spec in cfg.methods:
        try:
            _methods(cfg, spec, nproc)
        except ValueError as exc:
            return str(exc)
    if cfg.baseline:
        try:
            wanted = {m.name for m in _methods(cfg, cfg.baseline, nproc)}
        except ValueError as exc:
            return f"--baseline: {exc}"
        if not wanted & {m.name for spec in cfg.methods for m in _methods(cfg, spec, nproc)}:
            return baseline_problem(cfg.baseline, cfg.methods)
    return None


def baseline_problem(baseline: str, methods) -> str:
    return (
        f"--baseline {baseline} is not among --methods ({' '.join(methods)}): add it there "
        "or name one of them"
    )


def _model_problem(cfg: BenchConfig) -> str | None:
    if cfg.layer or cfg.device != "cpu" or cfg.dtype != "float32":
        return "--whole-model runs on CPU ranks in float32, without --layer"
    methods = model_config(cfg).methods
    unknown = set(methods) - set(MODEL_METHODS)
    if unknown:
        return f"--whole-model: unknown methods {sorted(unknown)}; choose from {MODEL_METHODS}"
    if cfg.baseline and cfg.baseline not in methods:
        return baseline_problem(cfg.baseline, methods)
    least = {
        "vocab_size": 2,
        "mlp_size": 0,
        "layers": 1,
        "mlp_tile": 1,
        "loss_chunk": 1,
        "reference_up_to": 0,
    }
    for name, low in least.items():
        if getattr(cfg, name) < low:
            flag = "--" + name.replace("_", "-")
            return f"{flag} must be >= {low}, got {getattr(cfg, name)}"
    return None


def model_config(cfg: BenchConfig) -> BenchConfig:
    """`cfg` with the model methods when --methods was left at the op benchmark's default."""
    if cfg.methods == DEFAULT_METHODS:
        return dataclasses.replace(cfg, methods=MODEL_METHODS)
    return cfg


def layer_variants(cfg: BenchConfig) -> tuple[tuple[int | None, bool], ...]:
    """(window, sinks) of each layer variant the run measures: the flags' one, or with
    --variants each combination of them and none (full causal first)."""
    window, sinks = cfg.window or None, cfg.sinks
    if not cfg.variants:
        return ((window, sinks),)
    return tuple(
        (w, s) for w in dict.fromkeys((None, window)) for s in dict.fromkeys((False, sinks))
    )


def _methods(cfg: BenchConfig, spec: str, nproc: int) -> list[Method]:
    """The method named `spec`; with `cfg.layer` upipe's strategies run as the layer, one
    method per variant (`layer_variants`)."""
    m = make_method(spec, nproc, backend=cfg.attention_kernel)
    if not (cfg.layer and isinstance(m, UpipeMethod)):
        return [m]
    shape = (cfg.heads, cfg.kv_heads, cfg.head_dim)
    kw = dict(shape=shape, seed=cfg.seed, causal=cfg.causal, backend=cfg.attention_kernel)
    return [UpipeLayer(m.kind, m.U, **kw, window=w, sinks=s) for w, s in layer_variants(cfg)]


def plan_methods(cfg: BenchConfig, nproc: int, extra=()) -> tuple[list, dict[str, str]]:
    """The methods that can run here, and {name: reason} for those skipped (static checks:
    peer installed, device supported, shape allowed at every sequence length)."""
    methods, skipped = [], {}
    for m in [m for spec in cfg.methods for m in _methods(cfg, spec, nproc)] + list(extra):
        reason = None
        if cfg.layer and m.inputs != "layer":
            skipped[m.name] = "an attention op on q, k, v, not a layer: run it without --layer"
            continue
        for S in cfg.seq_lens:
            reason = m.problem(H=cfg.heads, G=cfg.kv_heads, C=nproc, S=S, device=cfg.device)
            if reason:
                break
        if reason:
            skipped[m.name] = reason
        elif m.name not in {x.name for x in methods}:
            methods.append(m)
    return methods, skipped


def run_bench(cfg: BenchConfig, *, extra_methods=(), quiet: bool = False) -> dict:
    """Run the benchmark; print the table, write the JSON and the plot; return the document.

    `extra_methods`: more `upipe.bench.peers.Method` instances (importable classes) to run
    after `cfg.methods` -- e.g. a test's deliberately wrong one.
    """
    import torch.distributed as dist
    from tqdm import tqdm

    from upipe.bench import report
    from upipe.bench.run import RESULTS, Plan, baseline_candidates, drive, in_process_runner, judge

    under_torchrun = cfg.device == "cuda"
    if under_torchrun:
        if not dist.is_initialized():
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        nproc = dist.get_world_size()
    else:
        nproc = cfg.nproc
    problem = validate(cfg, nproc)
    if problem:
        raise ValueError(problem)
    if cfg.whole_model:
        from upipe.bench.model import run_model_bench

        return run_model_bench(model_config(cfg), quiet=quiet)
    lead = not under_torchrun or dist.get_rank() == 0
    say = print if lead and not quiet else (lambda *a, **k: None)
    methods, skipped = plan_methods(cfg, nproc, extra_methods)
    for name, why in skipped.items():
        say(f"skipping {name}: {why}", flush=True)
    if any(m.peer == "deepspeed" for m in methods):
        say("deepspeed: its first use compiles a CPU extension (minutes, once)", flush=True)
    plan = Plan(
        seq_lens=tuple(cfg.seq_lens),
        nproc=nproc,
        B=cfg.batch_size,
        H=cfg.heads,
        G=cfg.kv_heads,
        d=cfg.head_dim,
        dtype=cfg.dtype,
        causal=cfg.causal,
        device=cfg.device,
        warmup_rounds=cfg.warmup_rounds,
        repeats=cfg.repeats,
        seed=cfg.seed,
        methods=methods,
        layer=cfg.layer,
        variants=layer_variants(cfg),
        reference_up_to=cfg.reference_up_to,
    )
    steps = 1 + len(cfg.seq_lens) * (1 + len(methods) + cfg.warmup_rounds + cfg.repeats)
    bar = tqdm(total=steps, disable=not lead or quiet, desc="upipe bench", unit="step")

    def tick(text):
        bar.set_postfix_str(text)
        bar.update()

    threads = 1
    if under_torchrun:
        rows, failed = drive(in_process_runner, plan, tick)
    else:
        from upipe.launch import LocalCluster

        with LocalCluster(nproc, timeout_s=3600, pg_timeout_s=600, threads=threads) as cluster:
            rows, failed = drive(cluster.run, plan, tick)
    bar.close()
    skipped.update(failed)
    ran = {m.name: m for m in methods if m.name not in failed}
    baseline, baselines = None, {}
    for spec in baseline_candidates(cfg, BASELINES):
        family = [m for m in _methods(cfg, spec, nproc) if m.name in ran]
        if family:  # (with --layer one method per variant: each variant's own baseline)
            of_variant = {getattr(m, "variant", None): m.name for m in family}
            baselines = {n: of_variant.get(getattr(m, "variant", None)) for n, m in ran.items()}
            baseline = family[0].name
            break
    judge(rows, cfg.dtype, baselines)
    header = (
        f"{nproc} ranks ({'NCCL' if under_torchrun else 'gloo, CPU'}), B={cfg.batch_size} "
        f"H={cfg.heads} G={cfg.kv_heads} d={cfg.head_dim} {cfg.dtype} causal={cfg.causal}"
        + (" variants:" if cfg.variants else "")
        + (f" window={cfg.window}" if cfg.window else "")
        + (" sinks" if cfg.sinks else "")
        + "; "
        f"peak = per-rank max of tensors allocated in fwd+bwd ([B,L,D] = one "
        f"[B, S/{nproc}, H*d] tensor); median of {cfg.repeats} interleaved rounds; max err = "
        f"max|x - ref| / max|ref| over "
        f"{', '.join(result_names(cfg.sinks) if cfg.layer else RESULTS['op'])} "
        f"vs float64 (tolerance "
        f"{TOLERANCE[cfg.dtype]:.0e}); # = rank among correct methods"
    )
    doc = {
        "config": dataclasses.asdict(cfg),
        "machine": report.machine(cfg.device, nproc, threads, methods),
        "baseline": baseline,
        "methods": {
            **{m.name: {"status": "ran", "version": m.version()} for m in methods},
            **{n: {"status": "skipped", "reason": why} for n, why in skipped.items()},
        },
        "results": rows,
    }
    if not lead:
        return doc
    title = header[: header.index("; peak")]
    report.publish(doc, skipped, cfg, say, header=header, title=title)
    return doc
