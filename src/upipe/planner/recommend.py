"""`upipe plan --recommend`: the fastest configuration that fits at one sequence length, and
the command that trains it.

For every candidate of the planner (`plan.candidates`: strategies x heads per stage x memory
feature sets, by default `GRID`) at `--seq-len` N:
- does it fit: one simulated step at N (`StepSimulator`, as `upipe plan` searches: loops cut
  short, depth extrapolated), device peak <= GPU memory - reserve and host bytes <= the host
  budget;
- how fast, if it fits: the step's exact counts (`timing.count_step`) through the time
  model of the chosen GPU (`timing.predict`); tokens/s = B * N * dp / step time.
The pick is the fitting candidate with the shortest predicted step (never one that does not
fit), or, among those within 1% of it, the one with the most device memory to spare; its
`torchrun ... -m upipe.train ...` command carries every option that differs from
`upipe train`'s defaults, plus the ones a reader looks for (device, model, strategy, length,
dtype, FSDP). Candidates run `pc.jobs` at a time, each in a process of its own (the
simulator needs the process's default process group).

With --hf-config the memory is the Hugging Face path's (`upipe.planner.hf`), the time that
of upipe's own trainer counted on the same shapes and features (the same GEMMs, attention
calls and exchanges; not the memory-bound work of transformers' fp32 norms) -- or, for a
hybrid model (Qwen3-Next: Gated DeltaNet layers, MoE experts), counted in the Hugging Face
model itself (`timing.count_step(..., hf=)`: its GEMMs, grouped expert GEMMs, attention,
fla's DeltaNet kernels by formula, every exchange), on CUDA only -- and the pick
comes as the Trainer's settings (`hf.hf_settings`: TrainingArguments, `context_parallel=`,
the accelerate FSDP2 config) with its torchrun command.
"""

from __future__ import annotations

import dataclasses
import time

from upipe.planner import plan
from upipe.planner.command import SHOWN, torchrun_command  # noqa: F401 (also from here)
from upipe.planner.counts import count_in
from upipe.planner.hardware import HARDWARE, get_hardware, resolve_kernel, with_measured_rates
from upipe.planner.runner import cost, run_all
from upipe.planner.timing import count_step, predict
from upipe.train.config import TrainConfig, padded_length, validate

GiB = plan.GiB
# memory feature sets tried by default (as --features): from none to all, each trading time
# (recomputation, host copies) for memory; and the attention outputs kept for the
# recomputation (one attention forward less per layer, for one [L, H*d] tensor per layer on
# the GPU, or on the host beside the offloaded inputs)
GRID = (
    *("off", "mlp+loss", "loss+recompute", "mlp+loss+recompute", "loss+recompute+offload"),
    *("on", "on+gpu4", "on+ckpt2", "on+fsdp-offload", "on+ckpt2+fsdp-offload"),
    *("on+keep", "on+aoff", "on+fsdp-offload+aoff"),
)
TIE = 0.01  # predicted steps this close to the fastest count as as fast (`_pick`)


@dataclasses.dataclass(kw_only=True)
class RecommendConfig:
    recommend: bool = False
    """Recommend the fastest configuration that fits at --seq-len: simulate every strategy x
    heads per stage x memory feature set (--features if given, else off, mlp+loss,
    loss+recompute, mlp+loss+recompute, loss+recompute+offload, on, on+gpu4, on+ckpt2,
    on+fsdp-offload, on+ckpt2+fsdp-offload, on+keep, on+aoff, on+fsdp-offload+aoff), predict
    its step time on --hardware, print the table and the torchrun command of the pick."""
    seq_len: int | None = None
    """Tokens per sequence for --recommend."""
    hardware: str = dataclasses.field(default="h100", metadata={"choices": tuple(HARDWARE)})
    """GPU whose rates the time model uses (--recommend; h100 and a100 SXM, h200, b200; the
    rates and their sources: upipe.planner.hardware). The attention rates are those of
    --attention-kernel on it (auto: the kernel torch's own build picks there for bf16: cudnn
    on h100, h200 and b200, flash on a100)."""
    rates_from: str | None = None
    """A gpu_check.json (benchmarks/gpu_check.py --out, run on a GPU of --hardware's model):
    its measured attention rates per kernel and host-to-device copy rate replace the
    published ones where it has them."""


def recommend(pc: plan.PlanConfig, rc: RecommendConfig, progress=None) -> dict:
    """Every candidate of `pc` at `rc.seq_len` (fits?, counts, predicted time), the pick and
    its command, JSON-ready. `progress(row, res)` is called after each simulated candidate
    with its row and the results so far (rows not simulated yet have no "fits"), and first
    with row None (the rows to simulate)."""
    hw, N = get_hardware(rc.hardware), rc.seq_len
    if rc.rates_from:
        hw = with_measured_rates(hw, rc.rates_from)
    kernel = resolve_kernel(pc.attention_kernel, hw)
    hw.kernel_rate(kernel)  # (a kernel without rates is refused before any simulation)
    named = {} if pc.attention_kernel == "auto" else {"attention_kernel": kernel}
    # the memory of the kernel timed; the device's memory defaults filled in; bf16 compute
    # unless --dtype says otherwise (refused below: the rates are bf16's), on any --device
    pc = dataclasses.replace(pc, attention_kernel=kernel, dtype=pc.dtype or "bfloat16")
    pc = plan.resolved(pc)
    if N is None or N < 1:
        raise ValueError(f"--recommend needs --seq-len N >= 1 (tokens per sequence), got {N}")
    if pc.dtype != "bfloat16":
        raise ValueError(
            f"--recommend times bf16 compute (the presets' rates are bf16 GEMM and flash "
            f"attention): use --dtype bfloat16, not {pc.dtype}"
        )
    model, budget = plan.checked(pc)
    hybrid = _hybrid_config(pc)
    if hybrid and pc.device != "cuda":
        raise ValueError(
            "--recommend for a hybrid model times fla's Gated DeltaNet kernels on CUDA: use "
            "--device cuda (the CPU's scan is not timed)"
        )
    host_budget = pc.host_memory_gib * GiB
    rows, todo = [], []
    for label, kw, problem in plan.candidates(pc, model):
        problem = problem or validate(
            TrainConfig(**{**kw, "seq_len": N}, plot=None), pc.gpus, model
        )
        rows.append({"strategy": label, "train_config": kw, "problem": problem})
        if not problem:
            todo.append(rows[-1])
    args = (pc, model, N, budget, host_budget)

    def done(row, result):
        row.update(result)
        if progress:
            progress(row, out)

    def expected(row):  # (the longest first: `runner.cost`)
        kw = row["train_config"]
        return -cost(kw, plan.simulated_depths(pc, TrainConfig(**kw, plot=None), model))

    out = {"config": dataclasses.asdict(pc), "seq_len": N, "budget_bytes": budget}
    out["candidates"] = rows
    tasks = [(row, (*args, row["train_config"])) for row in sorted(todo, key=expected)]
    if progress:
        progress(None, out)
    run_all(_evaluate, tasks, pc.jobs, done)
    fit = [r for r in todo if r["fits"]]
    for row in fit:
        cfg = TrainConfig(**row["train_config"], plot=None)
        row["seconds"] = predict(row["counts"], hw, kernel)
        dp = cfg.degrees(pc.gpus)[0]
        row["tokens_per_s"] = cfg.batch_size * N * dp / row["seconds"]["step"]
        row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / pc.gpus
    fit.sort(key=lambda r: r["seconds"]["step"])
    rows = (
        fit
        + sorted((r for r in todo if not r["fits"]), key=lambda r: r["peak_bytes"])
        + [r for r in rows if r["problem"]]
    )
    pick = _pick(fit)
    out.update(
        {
            "hardware": dataclasses.asdict(hw),
            "attention_kernel": kernel,
            "attention_rates": dataclasses.asdict(hw.kernel_rate(kernel)),
            "budget_bytes": budget,
            "candidates": rows,
            "fastest": fit[0]["strategy"] if fit else None,
            "pick": pick and pick["strategy"],
            "command": pick
            and torchrun_command({**pick["train_config"], **named}, pc.gpus, N, hw.gpus_per_node),
        }
    )
    if pc.hf_config and pick:
        from upipe.planner.hf import hf_settings

        out["hf_settings"] = hf_settings(pick["train_config"], pc.gpus, N)
        out["command"] = out["hf_settings"]["torchrun"]
    return out


def _hybrid_config(pc) -> dict | None:
    """With --hf-config of a hybrid model (`upipe.planner.hf.is_hybrid`): its config, whose
    Hugging Face model is counted for the time model; else None."""
    if not pc.hf_config:
        return None
    from upipe.planner.hf import is_hybrid, load_hf_config

    hf = load_hf_config(pc.hf_config)
    return hf if is_hybrid(hf) else None


def _pick(fit: list[dict]) -> dict | None:
    """Of the fitting candidates, fastest first: the one with the smallest device peak among
    those within `TIE` of the fastest predicted step (the model does not resolve smaller
    differences -- it leaves out launch overheads and the like -- and the planner's peaks are
    an upper bound for the reserve: headroom is worth more)."""
    if not fit:
        return None
    near = [r for r in fit if r["seconds"]["step"] <= (1 + TIE) * fit[0]["seconds"]["step"]]
    return min(near, key=lambda r: r["peak_bytes"])


def _evaluate(pc, model, N: int, budget: float, host_budget: float, kw: dict) -> dict:
    """One candidate at N: its memory (fits, and why not) and, if it fits, its exact
    counts (a candidate that cannot run is not timed: that would double the search)."""
    start = time.perf_counter()
    cfg = TrainConfig(**kw, plot=None)
    depths = plan.simulated_depths(pc, cfg, model)
    memory_depths = depths if pc.extrapolate else None
    sim_kw = dict(depths=memory_depths, kernels=pc.device, attention_kernel=pc.attention_kernel)
    with plan.simulator(pc, cfg, model, **sim_kw) as sim:
        m = sim.step(N)  # (what is live at the peak is not reported here: not explained)
        too_much = []
        if m.peak_bytes > budget:
            too_much.append(f"device peak {m.peak_bytes / GiB:.1f} > {budget / GiB:g} GiB")
        if m.host_peak_bytes > host_budget:
            too_much.append(f"host {m.host_peak_bytes / GiB:.1f} > {host_budget / GiB:g} GiB")
        row = {
            "fits": not too_much,
            "reason": "; ".join(too_much),
            "peak_bytes": m.peak_bytes,
            "host_bytes": m.host_peak_bytes,
        }
        if too_much:
            return {**row, "simulated_s": round(time.perf_counter() - start, 2)}
        padded = padded_length(dataclasses.replace(cfg, seq_len=N), pc.gpus)
        # the planner's shortest searched length (a valid length of every candidate) as the
        # unit; counted in this simulator where it can be (`counts.count_in`)
        fit = dict(unit=kw["seq_len"], depths=depths)
        counts = None if pc.hf_config else count_in(sim, cfg, pc.gpus, model, padded, **fit)
    if counts is None:  # the HF path: a hybrid's own time, a dense one's upipe trainer's
        hf = _hybrid_config(pc)
        counts = count_step(cfg, pc.gpus, model, padded, **fit, kernels=pc.device, hf=hf)
    return {**row, "counts": counts, "simulated_s": round(time.perf_counter() - start, 2)}


def table(res: dict) -> str:
    """The candidates, fastest first (those that fit, then those that do not, then those
    that cannot run), the pick and its command."""
    c, hw = res["config"], res["hardware"]
    model = c.get("hf_config") or c["model"]
    lines = [
        f"{model} on {c['gpus']} x {hw['name']} ({c['gpu_memory_gib']:g} GiB, "
        f"{res['budget_bytes'] / GiB:g} GiB of tensors; {c['host_memory_gib']:g} GiB host "
        f"memory per GPU), {res['seq_len']:,} tokens per sequence; predicted by the "
        f"{hw['name']} time model, {res['attention_kernel']} attention (not validated on a GPU)",
        f"{'candidate':38} {'fits':>4} {'peak GiB':>8} {'host GiB':>8} {'step s':>9} "
        f"{'tokens/s':>9} {'/GPU':>7} {'attn s':>8} {'gemm s':>7} {'a2a s':>6} {'h2d s':>6}"
        "  why not",
    ]
    for r in res["candidates"]:
        if r["problem"]:
            lines.append(f"{r['strategy']:38} {'n/a':>4}  {r['problem']}")
            continue
        cells = f"{r['strategy']:38} {'yes' if r['fits'] else 'no':>4} "
        cells += f"{r['peak_bytes'] / GiB:8.1f} {r['host_bytes'] / GiB:8.1f} "
        if not r["fits"]:
            lines.append(
                f"{cells}{'':>9} {'':>9} {'':>7} {'':>8} {'':>7} {'':>6} {'':>6}  {r['reason']}"
            )
            continue
        t = r["seconds"]
        lines.append(
            f"{cells}{t['step']:9,.1f} {r['tokens_per_s']:9,.0f} "
            f"{r['tokens_per_s_per_gpu']:7,.1f} {t['attention']:8,.1f} "
            f"{t['gemm']:7.1f} {t['all_to_all']:6.2f} {t['host_to_device']:6.2f}"
        )
    if res["pick"]:
        why = (
            ""
            if res["pick"] == res["fastest"]
            else f" (within {TIE:.0%} of the fastest, less memory)"
        )
        lines.append(f"\npick: {res['pick']}{why}")
        lines.append(
            "\n".join(res["hf_settings"]["lines"]) if "hf_settings" in res else res["command"]
        )
    else:
        lines.append("\nno candidate fits: shorten --seq-len, add GPUs or host memory")
    return "\n".join(lines)
