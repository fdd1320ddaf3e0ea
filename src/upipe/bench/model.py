"""`upipe bench --whole-model`: one Hugging Face model's whole training step under each
context-parallel attention, DeepSpeed ALST's beside upipe's, on identical inputs in the same
processes.

Legend: B batch, S full sequence, L = S / C local tokens, D = H*d model width, H query heads,
G kv heads, d head dim, V vocabulary, C ranks.

The model: a `LlamaForCausalLM` from a config (--layers layers, D = H*d, MLP width --mlp-size,
default 2D, a vocabulary of --vocab-size), the same random weights on every rank; with
--activation-checkpoint every method checkpoints its decoder layers. With --hybrid a
`Qwen3NextForCausalLM` instead (`HYBRID_METHODS` only): Gated DeltaNet layers, H value
heads over G key heads of d, and gated full attention (H query / G kv heads of d) as every
fourth layer and the last, dense MLPs; its DeltaNet layers run through
`upipe.integrations.hf_deltanet`. Its step: forward on this rank's
block of the sequence (`upipe.integrations.hf.shard_batch`), the loss (`causal_lm_loss`: mean
over the whole sequence), backward. The methods (MODEL_METHODS):
  alst            DeepSpeed's ALST attention, `UlyssesSPAttentionHF` (as its
                  `register_with_transformers` builds it) around transformers' sdpa
  upipe-ulysses   `apply_context_parallel(strategy="ulysses")`
  upipe           `apply_context_parallel(strategy="upipe")`: the fused UPipe module
  upipe-dropin    `upipe.integrations.deepspeed.UPipeSPAttentionHF`, the drop-in for ALST's
  ...+tiled-mlp   the same with ALST's `TiledMLP` in every MLP, ceil(L / D) tiles (ALST's rule)
  alst-full, upipe-full, upipe-train   each side's whole memory stack, tiles and chunks of
                  --mlp-tile / --loss-chunk tokens (`upipe.bench.recipes`)
Each ALST-style module is registered with transformers' `AttentionInterface` under its own
name (what `register_with_transformers` does by overriding "sdpa", which would allow only one
of them per process); no mask function, so transformers builds no mask, as ALST's wrapper
drops it.

For each sequence length: rank 0 runs the unsharded model on the full sequence (fp32, sdpa;
its loss in checkpointed chunks of REFERENCE_CHUNK tokens, so no `[S, V]` logits are held)
for the reference loss and gradients (if S <= --reference-up-to, or always); each method
then runs one step under `upipe.MemoryTracker` (per-rank peak of the tensors allocated in
the step: activations, communication buffers, logits, gradients; the weights excluded; its
time is kept too), its loss and its gradients summed over the ranks are compared with the
reference, and `warmup_rounds` + `repeats` interleaved timed rounds follow (a round's time
is the slowest rank's; the median is reported).
Ratios are this method / the baseline (--baseline; default `BASELINES`: `alst`, ALST's
Ulysses attention, else `alst-full`, else `upipe-ulysses`; with --hybrid `upipe-ulysses`;
else the first of --methods that ran). One memory unit is one
`[B, L, D]` fp32 tensor; "KiB/token" (from the second length on) is the growth of the
per-rank peak from the previous length, per token added to each rank's shard: (peak(S) -
peak(S')) / ((S - S') / C), what decides the longest context, free of fixed costs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import upipe
from upipe.attention.registry import check_heads
from upipe.bench import report
from upipe.bench.peers import TESTED, installed_version
from upipe.bench.recipes import (
    FULL_METHODS,
    build_full,
    full_context,
    full_loss,
    gradient_checkpointing,
)
from upipe.heads import contiguous_stages, even_problem, kv_problem

MODEL_METHODS = (
    "alst",
    "alst+tiled-mlp",
    "upipe-ulysses",
    "upipe",
    "upipe+tiled-mlp",
    "upipe-dropin",
    "upipe-dropin+tiled-mlp",
    *FULL_METHODS,
)
HYBRID_METHODS = ("upipe-ulysses", "upipe", "upipe-full")
"""What runs on --hybrid: apply_context_parallel's (ALST and upipe's own model have no
Gated DeltaNet)."""
# the ratios' default baseline, the first that ran: the Ulysses-like methods of each model
BASELINES = {False: ("alst", "alst-full", "upipe-ulysses"), True: ("upipe-ulysses",)}
TILED = "+tiled-mlp"
REFERENCE_CHUNK = 4096
_STATE: dict = {}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The benchmarked model and batch."""

    B: int
    H: int
    G: int
    d: int
    seed: int
    vocab: int = 256
    mlp: int = 0
    """MLP width F (0: 2D)."""
    layers: int = 2
    activation_checkpoint: bool = False
    mlp_tile: int = 1024
    loss_chunk: int = 1024
    hybrid: bool = False
    """A Qwen3NextForCausalLM (module doc) instead of a Llama."""


class ModelMethod:
    """One way to make the model context-parallel; picklable (sent to the ranks)."""

    def __init__(self, name: str):
        if name not in MODEL_METHODS:
            raise ValueError(f"unknown model method {name!r}; choose from {MODEL_METHODS}")
        self.name, self.attention = name, name.removesuffix(TILED)
        self.peer = "deepspeed" if name.startswith("alst") else None
        self.needs_deepspeed = name.endswith(TILED) or self.attention in (
            "alst",
            "alst-full",
            "upipe-dropin",
        )
        self.full = name in FULL_METHODS

    def version(self) -> str:
        return (installed_version(self.peer) or "") if self.peer else upipe.__version__

    def problem(self, *, H: int, G: int, C: int, hybrid: bool = False) -> str | None:
        """Why this method cannot run H query and G kv heads on C ranks, or None: each side's
        own head rule (`upipe.heads`) -- ALST's `UlyssesSPAttentionHF` the even split, the
        drop-in its contiguous stages, upipe's modules the library's (any G | H, C <= H).
        `hybrid`: a hybrid model, which only upipe's HF methods run."""
        if hybrid and self.name not in HYBRID_METHODS:
            return f"no Gated DeltaNet layers (--hybrid runs {', '.join(HYBRID_METHODS)})"
        if self.needs_deepspeed and installed_version("deepspeed") is None:
            return f"needs deepspeed=={TESTED['deepspeed']} (pip install 'upipe[integrations]')"
        problem = kv_problem(H, G, query="--heads", kv="--kv-heads")
        if problem is None and self.peer == "deepspeed":
            problem = even_problem(H, G, C, size="number of ranks")
        elif problem is None and self.attention == "upipe-dropin":
            try:
                contiguous_stages(H, G, C, None)
            except ValueError as e:
                problem = str(e)
        elif problem is None:
            strategy = "ulysses" if self.attention == "upipe-ulysses" else "upipe"
            words = dict(size="number of ranks", query="--heads", whole="ring attention")
            problem = check_heads(strategy, H, G, C, **words)
        return problem and f"{self.name}: {problem}"

    def build(self, base, group):
        """This method's copy of the base model, converted."""
        shape = _STATE["shape"]
        if self.full:
            return build_full(self.name, base, group, shape, _register, _TiledForward)
        model = copy.deepcopy(base)
        if self.attention in ("upipe", "upipe-ulysses"):
            from upipe.integrations.hf import apply_context_parallel

            strategy = "ulysses" if self.attention == "upipe-ulysses" else "upipe"
            apply_context_parallel(model, group=group, strategy=strategy)
        else:
            _register(model, self.attention, group)
        if self.name.endswith(TILED):
            for layer in model.model.layers:
                layer.mlp.forward = _TiledForward(layer.mlp)
        if shape.activation_checkpoint:
            gradient_checkpointing(model)
        return model

    def step(self, model, batch, group) -> torch.Tensor:
        """One training step (forward, loss, backward) on this rank's block; the loss."""
        from upipe.integrations.hf import causal_lm_loss

        if self.full:
            shape = _STATE["shape"]
            with full_context(self.name, shape):
                objective, loss = full_loss(self.name, model, batch, group, shape)
                objective.backward()
            return loss.detach()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = causal_lm_loss(logits, batch["labels"], group=group)
        loss.backward()
        return loss.detach()


def _register(model, name: str, group) -> None:
    """An ALST-style attention module registered under `name`, the model set to use it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if name.startswith("alst"):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF as cls

        extra = {}
    else:
        from upipe.integrations.deepspeed import UPipeSPAttentionHF as cls

        extra = {"heads_per_stage": None}
    cfg = model.config
    attn = cls(
        attn=sdpa_attention_forward,
        batch_size=_STATE["shape"].B,
        attn_head_count=cfg.num_attention_heads,
        attn_head_size=cfg.head_dim,
        kv_head_count=cfg.num_key_value_heads,
        num_hidden_layers=cfg.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True,
        **extra,
    )

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        return attn(module, query, key, value, None, *args, **kwargs)

    key = f"bench-{name}"
    AttentionInterface.register(key, wrapper)
    model.set_attn_implementation(key)


class _TiledForward:
    """ALST's `TiledMLP` around a transformers MLP, as ALST's docstring patches LlamaMLP:
    ceil(L / tile) tiles, `tile` tokens (None: ALST's rule, tiles of D tokens)."""

    def __init__(self, mlp, tile: int | None = None):
        self.mlp, self.tile = mlp, tile

    @staticmethod
    def _mlp(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def __call__(self, x):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        shards = math.ceil(x.shape[-2] / (self.tile or x.shape[-1]))
        params = [self.mlp.gate_proj.weight, self.mlp.up_proj.weight, self.mlp.down_proj.weight]
        return TiledMLP.apply(self._mlp, self.mlp, x, shards, params)


def base_model(shape: ModelShape, max_positions: int):
    """The benchmarked Llama (fp32, random weights from the seed, sdpa attention), or with
    `shape.hybrid` the Qwen3-Next (module doc)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    D = shape.H * shape.d
    if shape.hybrid:
        return _hybrid_model(shape, max_positions)
    config = LlamaConfig(
        hidden_size=D,
        intermediate_size=shape.mlp or 2 * D,
        num_attention_heads=shape.H,
        num_key_value_heads=shape.G,
        head_dim=shape.d,
        num_hidden_layers=shape.layers,
        vocab_size=shape.vocab,
        max_position_embeddings=max_positions,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(shape.seed)
    return LlamaForCausalLM(config).float().train()


def _hybrid_model(shape: ModelShape, max_positions: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    D, n = shape.H * shape.d, shape.layers
    types = ["full_attention" if i % 4 == 3 or i == n - 1 else "linear_attention" for i in range(n)]
    config = Qwen3NextConfig(
        hidden_size=D,
        intermediate_size=shape.mlp or 2 * D,
        num_attention_heads=shape.H,
        num_key_value_heads=shape.G,
        head_dim=shape.d,
        linear_num_value_heads=shape.H,
        linear_num_key_heads=shape.G,
        linear_key_head_dim=shape.d,
        linear_value_head_dim=shape.d,
        num_hidden_layers=n,
        layer_types=types,
        num_experts=0,
        vocab_size=shape.vocab,
        max_position_embeddings=max_positions,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(shape.seed)
    model = Qwen3NextForCausalLM(config).float().train()
    # decays A = exp(A_log) from (0.01, 0.2), not the init's (0.01, 16): with decays of up to
    # exp(-16) per token the state forgets within a few tokens and the gradients of A_log and
    # dt_bias are 1e-5 of the others' -- fp32 noise, relative to their own size 1e-3 (measured),
    # which the per-parameter error below would flag as wrong
    gen = torch.Generator().manual_seed(shape.seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                A_log = layer.linear_attn.A_log
                A_log.copy_(torch.empty(A_log.shape).uniform_(0.01, 0.2, generator=gen).log())
    return model


def _ce_sum(lm_head, h_BTD, labels_BT):
    logits = lm_head(h_BTD).float()
    return F.cross_entropy(logits.flatten(0, 1), labels_BT.flatten(), reduction="sum")


def reference(base, ids_BS):
    """The unsharded model's loss and gradients on the full sequence: its decoder, then its
    `lm_head` and transformers' loss (fp32 cross-entropy summed, over the count of labels:
    its `fixed_cross_entropy`) in checkpointed chunks of REFERENCE_CHUNK tokens."""
    from upipe.loss import count_valid, shift_labels

    model = copy.deepcopy(base)
    labels_BS = shift_labels(ids_BS)
    h_BSD = model.model(input_ids=ids_BS).last_hidden_state
    S = ids_BS.shape[1]
    sums = [
        checkpoint(
            _ce_sum, model.lm_head, h_BSD[:, a : a + REFERENCE_CHUNK],
            labels_BS[:, a : a + REFERENCE_CHUNK], use_reentrant=False,
        )
        for a in range(0, S, REFERENCE_CHUNK)
    ]  # fmt: skip
    loss = torch.stack(sums).sum() / count_valid(labels_BS)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def step_setup(rank, world_size, shape: ModelShape, methods, max_positions: int):
    """Build every method's model on this rank (deepspeed's comm first, for ALST's)."""
    import logging

    group = dist.group.WORLD
    _STATE.clear()
    _STATE["shape"] = shape
    if any(m.needs_deepspeed for m in methods):
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        # ALST only all-to-alls: skip the shared-memory all-reduce extension that deepspeed
        # would otherwise compile on first use (minutes on a CPU)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    _STATE["base"] = base_model(shape, max_positions)
    _STATE["models"] = {m.name: (m, m.build(_STATE["base"], group)) for m in methods}


def step_inputs(rank, world_size, S: int, check: bool = True):
    """This length's batch (the same on every rank) and its block; rank 0: the reference
    (if `check`)."""
    from upipe.integrations.hf import shard_batch

    shape = _STATE["shape"]
    gen = torch.Generator().manual_seed(shape.seed + S)
    ids_BS = torch.randint(0, shape.vocab, (shape.B, S), generator=gen)
    _STATE["batch"] = shard_batch(ids_BS, group=dist.group.WORLD)
    _STATE["few"] = shard_batch(ids_BS[:, : 8 * world_size], group=dist.group.WORLD)
    _STATE["reference"] = None
    _STATE["check"] = check
    if rank == 0 and check:
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, world_size))  # the other ranks wait meanwhile
        _STATE["reference"] = reference(_STATE["base"], ids_BS)
        torch.set_num_threads(threads)
    dist.barrier()


def step_measure(rank, world_size, name: str) -> dict:
    """One tracked step of `name` after a warm-up on a few tokens; rank 0 returns the peaks
    and seconds of every rank and (with a reference) the errors of the loss and of the
    summed gradients."""
    group, batch = dist.group.WORLD, _STATE["batch"]
    method, model = _STATE["models"][name]
    method.step(model, _STATE["few"], group)  # warm-up: caches, connections, the tracker
    model.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    with upipe.MemoryTracker() as mem:
        loss = method.step(model, batch, group)
    seconds = time.perf_counter() - t0
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (mem.peak_bytes, seconds), group=group)
    errors = {}
    for n, p in model.named_parameters() if _STATE["check"] else ():
        dist.all_reduce(p.grad, group=group)  # each rank holds its tokens' share
        if rank == 0:
            ref = _STATE["reference"][1][n]
            errors[n] = ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    model.zero_grad(set_to_none=True)
    if rank != 0:
        return {}
    out = {
        "peak_bytes_per_rank": [peak for peak, _ in everyone],
        "tracked_step_seconds": max(s for _, s in everyone),
        "loss": loss.item(),
        "rel_err": {},
    }
    if _STATE["check"]:
        ref_loss = _STATE["reference"][0]
        out["rel_err"] = {
            "loss": abs(loss.item() - ref_loss) / ref_loss,
            "grads": max(errors.values()),
        }
    return out


def step_round(rank, world_size, names: list[str]) -> dict[str, float]:
    """One timing round: each method's step in turn; this rank's seconds."""
    group, seconds = dist.group.WORLD, {}
    for name in names:
        method, model = _STATE["models"][name]
        dist.barrier(group)
        t0 = time.perf_counter()
        method.step(model, _STATE["batch"], group)
        seconds[name] = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
    return seconds


def drive(run, cfg, methods, tick=lambda text: None, partial=lambda rows: None) -> list[dict]:
    """Rows of the table, one per (sequence length, method), through `run(fn, *args)`;
    `partial(rows)` after each method's memory step (the rows so far, unjudged)."""
    shape = model_shape(cfg)
    run(step_setup, shape, methods, max(cfg.seq_lens))
    tick("set up")
    names, rows = [m.name for m in methods], []
    for S in cfg.seq_lens:
        check = not cfg.reference_up_to or cfg.reference_up_to >= S
        run(step_inputs, S, check)
        tick(f"S={S}: reference" if check else f"S={S}: inputs (no reference)")
        unit = cfg.batch_size * (S // cfg.nproc) * cfg.heads * cfg.head_dim * 4  # [B, L, D] fp32
        measured = {}
        for name in names:
            measured[name] = run(step_measure, name)[0]
            tick(f"S={S}: {name} memory+error")
            done = [report.result_row(S, n, measured[n], [], unit) for n in measured]
            partial(rows + done)
        rounds = {name: [] for name in names}
        for i in range(cfg.warmup_rounds + cfg.repeats):
            per_rank = run(step_round, names)
            if i >= cfg.warmup_rounds:
                for name in names:
                    rounds[name].append(max(r[name] for r in per_rank))
            tick(f"S={S}: round {i + 1}")
        for name in names:
            rows.append(report.result_row(S, name, measured[name], rounds[name], unit))
    report.add_growth(rows, cfg.nproc)
    return rows


def model_shape(cfg) -> ModelShape:
    """The `ModelShape` of a `upipe.bench.BenchConfig`."""
    return ModelShape(
        B=cfg.batch_size,
        H=cfg.heads,
        G=cfg.kv_heads,
        d=cfg.head_dim,
        seed=cfg.seed,
        vocab=cfg.vocab_size,
        mlp=cfg.mlp_size,
        layers=cfg.layers,
        activation_checkpoint=cfg.activation_checkpoint,
        mlp_tile=cfg.mlp_tile,
        loss_chunk=cfg.loss_chunk,
        hybrid=cfg.hybrid,
    )


def run_model_bench(cfg, *, quiet: bool = False) -> dict:
    """`upipe bench --whole-model` on `cfg.nproc` spawned CPU ranks: prints the table, writes the
    JSON and the plot; returns the document."""
    from tqdm import tqdm

    from upipe.bench.run import baseline_candidates, judge
    from upipe.launch import LocalCluster

    say = (lambda *a, **k: None) if quiet else print
    methods, skipped = [], {}
    for m in (ModelMethod(n) for n in cfg.methods):
        reason = m.problem(H=cfg.heads, G=cfg.kv_heads, C=cfg.nproc, hybrid=cfg.hybrid)
        if reason:
            skipped[m.name] = reason
            say(f"skipping {m.name}: {reason}", flush=True)
        else:
            methods.append(m)
    steps = 1 + len(cfg.seq_lens) * (1 + len(methods) + cfg.warmup_rounds + cfg.repeats)
    bar = tqdm(total=steps, disable=quiet, desc="upipe bench --whole-model", unit="step")

    def tick(text):
        bar.set_postfix_str(text)
        bar.update()

    def partial(rows):  # what a run stopped midway leaves: the rows measured so far
        if cfg.json:
            with open(cfg.json, "w") as f:
                json.dump({"config": dataclasses.asdict(cfg), "partial": True, "results": rows}, f)

    with LocalCluster(cfg.nproc, timeout_s=3600 * 4, pg_timeout_s=3600) as cluster:
        rows = drive(cluster.run, cfg, methods, tick, partial)
    bar.close()
    ran = {m.name for m in methods}
    candidates = baseline_candidates(cfg, BASELINES[cfg.hybrid])
    baseline = next((n for n in candidates if n in ran), None)
    judge(rows, "float32", baseline)
    D = cfg.heads * cfg.head_dim
    shape = model_shape(cfg)
    tiles = (
        f", tiles/chunks {cfg.mlp_tile}/{cfg.loss_chunk} tokens" if ran & set(FULL_METHODS) else ""
    )
    what = (
        f"Qwen3NextForCausalLM, {cfg.layers} layers (Gated DeltaNet: H={cfg.heads} value / "
        f"G={cfg.kv_heads} key heads, d={cfg.head_dim}; every 4th and the last gated full "
        f"attention), D={D}"
        if cfg.hybrid
        else f"LlamaForCausalLM, {cfg.layers} layers, D={D} (H={cfg.heads} G={cfg.kv_heads} "
        f"d={cfg.head_dim})"
    )
    header = (
        f"{cfg.nproc} ranks (gloo, CPU); {what}, MLP {shape.mlp or 2 * D}, "
        f"vocabulary {cfg.vocab_size}, B={cfg.batch_size}, fp32, activation checkpointing "
        f"{'on' if cfg.activation_checkpoint else 'off'}{tiles}; one training step (forward, loss, "
        f"backward); peak = per-rank max of tensors allocated in the step ([B,L,D] = one "
        f"[B, S/{cfg.nproc}, {D}] fp32 tensor); KiB/token = growth of that peak from the "
        f"previous length per token added to a rank; step s = the tracked step's time (the "
        f"slowest rank's; under the tracker); median of {cfg.repeats} interleaved rounds; "
        "loss err, max err = relative error of the loss, and of the loss and the summed "
        "gradients, vs the unsharded model on one process"
        + (
            f" (checked up to S = {cfg.reference_up_to}; -: not checked)"
            if cfg.reference_up_to
            else ""
        )
    )
    doc = {
        "config": dataclasses.asdict(cfg),
        "machine": report.machine("cpu", cfg.nproc, 1, methods),
        "baseline": baseline,
        "methods": {
            **{m.name: {"status": "ran", "version": m.version()} for m in methods},
            **{n: {"status": "skipped", "reason": why} for n, why in skipped.items()},
        },
        "results": rows,
    }
    title = header[: header.index("; one training step")]
    report.publish(doc, skipped, cfg, say, header=header, title=title)
    return doc
