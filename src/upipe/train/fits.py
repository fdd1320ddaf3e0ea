"""Will the job fit? A lower bound of each rank's memory, checked before any rank starts.

`upipe train --model llama3-8b` on a CPU machine used to be killed by the kernel's OOM
killer with nothing said about memory. `state_bytes` is what every rank holds for certain,
by arithmetic on the config (well under a millisecond): with P parameters, master dtype of
e_m bytes and compute dtype of e_c bytes, world W,

    weights + gradients + AdamW's two moments   4 P e_m        (/ W with --fsdp)
    the compute copy without FSDP (bf16 over fp32 masters: weights and their gradients)
                                                2 P e_c
    the logits without --chunked-loss           B (S / cp) V e_c  (cp: context-parallel ranks)

It leaves out the activations, buffers and allocator slack, so a job refused by it cannot
fit; one it accepts may still not (`upipe train --check-memory` simulates the whole step
with the planner first). On spawned CPU ranks every rank is on this machine: their sum is
held against the memory available now (`/proc/meminfo`'s MemAvailable). The message names
the need, the budget and the options that would bring the bound under it."""

from __future__ import annotations

import dataclasses
import os

from upipe.model import PRESETS
from upipe.train.config import DTYPES, TrainConfig, model_config

GiB = 2**30


def state_bytes(cfg: TrainConfig, world: int) -> int:
    """The lower bound of one rank's memory (module docstring)."""
    m = model_config(cfg)
    P = m.num_params()
    e_m, e_c = DTYPES[cfg.master_dtype].itemsize, DTYPES[cfg.dtype].itemsize
    state = 4 * P * e_m // (world if cfg.fsdp else 1)
    if cfg.dtype != cfg.master_dtype and not cfg.fsdp:
        state += 2 * P * e_c
    dp, ring, uly = cfg.degrees(world)
    if not cfg.chunked_loss:
        state += cfg.batch_size * (cfg.seq_len // (ring * uly)) * m.vocab_size * e_c
    return state


# this process's memory cgroup, as containers mount it: cgroup v2, then v1
CGROUP_V2, CGROUP_V1 = "/sys/fs/cgroup", "/sys/fs/cgroup/memory"


def _read_ints(path: str) -> dict[str, int]:
    """`name value` lines of a kernel file ({} if unreadable); a lone number as key ''."""
    try:
        with open(path) as f:
            words = [line.split() for line in f if line.strip()]
    except OSError:
        return {}
    out = {}
    for w in words:
        if len(w) == 1 and w[0].isdigit():
            out[""] = int(w[0])
        elif len(w) >= 2 and w[1].isdigit():  # ("MemAvailable:", "16301176", "kB")
            out[w[0]] = int(w[1])
    return out


def available_host_bytes() -> int:
    """Memory new processes can have now: the kernel's MemAvailable (else all RAM), capped
    by what this process's memory cgroup (a container's limit) has left."""
    meminfo = _read_ints("/proc/meminfo")
    if "MemAvailable:" in meminfo:
        free = meminfo["MemAvailable:"] * 1024
    else:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit, usage in (
        (f"{CGROUP_V2}/memory.max", f"{CGROUP_V2}/memory.current"),
        (f"{CGROUP_V1}/memory.limit_in_bytes", f"{CGROUP_V1}/memory.usage_in_bytes"),
    ):
        cap, used = _read_ints(limit).get(""), _read_ints(usage).get("")
        if cap is not None and used is not None:
            return min(free, max(0, cap - used))
    return free


def oom_kills() -> int | None:
    """How many processes the out-of-memory killer has killed in this memory cgroup so far
    (its `oom_kill` count; None where the kernel does not say)."""
    for path in (f"{CGROUP_V2}/memory.events", f"{CGROUP_V1}/memory.oom_control"):
        count = _read_ints(path).get("oom_kill")
        if count is not None:
            return count
    return None


def check_fits(
    cfg: TrainConfig, world: int, budget: int, *, sharing: int, where: str
) -> str | None:
    """None if `sharing` ranks of a `world`-rank job of `cfg` may fit in `budget` bytes
    together (spawned CPU ranks: all of them on this machine; one per GPU: 1), else the
    message: the need, the budget, the options that would bring the bound under it."""
    need = sharing * state_bytes(cfg, world)
    if need <= budget:
        return None
    tried = []
    for change in (
        {"fsdp": True},
        {"chunked_loss": True},
        {"fsdp": True, "chunked_loss": True},
    ):
        if all(getattr(cfg, k) == v for k, v in change.items()):
            continue
        other = dataclasses.replace(cfg, **change)
        if sharing * state_bytes(other, world) <= budget:
            tried.append(" ".join(f"--{k.replace('_', '-')}" for k in change))
    smaller = [
        name
        for name in sorted(PRESETS, key=lambda n: PRESETS[n].num_params())
        if cfg.init_from_hf is None
        and PRESETS[name].num_params() < model_config(cfg).num_params()
        and sharing * state_bytes(dataclasses.replace(cfg, model=name), world) <= budget
    ]
    fix = []
    if tried:
        fix.append("add " + " or ".join(tried))
    if smaller:
        fix.append("a smaller --model (" + ", ".join(smaller) + ")")
    fix.append("more memory")
    return (
        f"this job needs at least {need / GiB:.1f} GiB ({sharing} rank(s) x "
        f"{state_bytes(cfg, world) / GiB:.2f} GiB: weights, gradients, AdamW states"
        f"{'' if cfg.chunked_loss else ', logits'}) but {where} has {budget / GiB:.1f} GiB "
        f"available: {'; '.join(fix)}"
    )
