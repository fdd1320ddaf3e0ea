"""Attention sinks (`sinks=`, gpt-oss) in every strategy, against a float64 reference that
appends each head's sink logit as an explicit extra score column (sink_workers.py).

S = 32; documents and a sliding window (5) where marked. The sink gradient of each rank is
its share (its heads, or on a ring its rows): the tests sum the shares over the ranks, as
the trainer sums every replicated parameter's gradient.
"""

from __future__ import annotations

import pytest
import torch
from sink_workers import (
    bad_sinks,
    checkpointed,
    module_reference,
    one_device,
    reference,
    run,
    run_mesh,
    run_module,
    run_module_mesh,
)
from tolerances import TOL, bf16_bound, rel_err

S = 32
CU = [0, 1, 3, 14, 15, 29, S]
NAMES = ("out", "dq", "dk", "dv", "dsinks")


def _check(got, ref, names=NAMES):
    errs = {n: rel_err(a, r) for n, a, r in zip(names, got, ref, strict=True)}
    for n, e in errs.items():
        assert e < TOL[torch.float32]["fwd" if n in ("out", "y") else "bwd"], (n, errs)


def _check_bf16(got, single, ref):
    """Each result within `bf16_bound` of one device's bf16 error, which itself stays under
    the bf16 kernel's (so a mistake shared with the one-device baseline fails too)."""
    for name, a, s, r in zip(NAMES, got, single, ref, strict=True):
        assert rel_err(s, r) < TOL[torch.bfloat16]["fwd" if name == "out" else "bwd"], name
        assert rel_err(a, r) <= bf16_bound(rel_err(s, r)), name


def _summed(results):
    """(rank 0's gathered [out, dq, dk, dv], the sink gradient summed over the ranks)."""
    return [*results[0][0], sum(r[1] for r in results)]


FUNCTIONAL = [  # (strategy, world, H, G, kwargs)
    ("ulysses", 2, 4, 2, {}),
    ("ulysses", 4, 4, 1, {}),  # MQA (the kv head shared by the ranks)
    ("ulysses", 4, 6, 2, {}),  # uneven heads
    ("upipe", 2, 8, 2, {"heads_per_stage": 2}),
    ("upipe", 4, 8, 1, {}),  # MQA: the kv head replicated
    ("upipe", 4, 8, 2, {"heads_per_stage": 8, "layout": "zigzag"}),
    ("upipe", 4, 6, 2, {"heads_per_stage": 4}),  # uneven heads, two stages
    ("ring", 2, 4, 2, {}),
    ("ring", 4, 4, 1, {"layout": "contiguous"}),
]


@pytest.mark.parametrize("masks", ["none", "documents+window"])
@pytest.mark.parametrize("strategy,world,H,G,kwargs", FUNCTIONAL)
def test_functional_matches_reference(clusters, strategy, world, H, G, kwargs, masks):
    shape = dict(B=2, S=S, H=H, G=G, d=8)
    cu, w = (None, None) if masks == "none" else (CU, 5)
    got = clusters(world).run(run, strategy, shape, {**kwargs, "window": w}, cu)
    _check(_summed(got), reference(shape, cu, window=w))


@pytest.mark.parametrize("strategy,kwargs", [("usp", {}), ("upipe", {}),
                                             ("usp", {"layout": "contiguous"})])  # fmt: skip
def test_mesh_matches_reference(clusters, strategy, kwargs):
    """Ring 2 x ulysses 2: the sinks are applied after each ring's merge."""
    shape = dict(B=1, S=S, H=4, G=2, d=8)
    got = clusters(4).run(run_mesh, (1, 2, 2), strategy, shape, {**kwargs, "window": 5}, CU)
    ref = reference(shape, CU, window=5)
    for pos, res, _ in got:
        _check(res, [r[:, pos] for r in ref[:4]], NAMES[:4])
    assert rel_err(sum(r[2] for r in got), ref[4]) < TOL[torch.float32]["bwd"]


MODULE = [  # (world, strategy kwargs, kv heads)
    (2, {"strategy": "upipe"}, 2),
    (4, {"strategy": "upipe", "heads_per_stage": 8}, 1),
    (4, {"strategy": "upipe"}, 2),  # H = 6 below: uneven
    (2, {"strategy": "ulysses"}, 2),
    (4, {"strategy": "ring"}, 2),
]
MODULE_NAMES = ("y", "dx", "q_proj", "k_proj", "v_proj", "o_proj", "sinks")


@pytest.mark.parametrize("world,kwargs,G", MODULE)
def test_module_matches_reference(clusters, world, kwargs, G):
    """ContextParallelAttention(sinks=True, window=5) with documents: y, dx, the weights' and
    the sinks' gradients (shares summed over the ranks)."""
    H = 6 if world == 4 and G == 2 and kwargs["strategy"] == "upipe" else 8
    cfg = dict(B=2, S=S, dim=48 if H == 6 else 32, num_heads=H, num_kv_heads=G)
    got = clusters(world).run(run_module, cfg, {**kwargs, "window": 5}, CU)
    ref = module_reference(cfg, CU, window=5)
    summed = {n: sum(r[n] for r in got) for n in MODULE_NAMES[2:]}
    _check([got[0]["y"], got[0]["dx"], *summed.values()], [ref[n] for n in MODULE_NAMES],
           MODULE_NAMES)  # fmt: skip


@pytest.mark.parametrize("strategy", ["upipe", "ulysses"])
def test_module_on_mesh_matches_reference(clusters, strategy):
    cfg = dict(B=1, S=S, dim=32, num_heads=8, num_kv_heads=2)
    kwargs = {"strategy": strategy, "window": 6}
    got = clusters(4).run(run_module_mesh, (1, 2, 2), cfg, kwargs, CU)
    ref = module_reference(cfg, CU, window=6)
    for r in got:
        _check([r["y"], r["dx"]], [ref["y"][:, r["pos"]], ref["dx"][:, r["pos"]]], ("y", "dx"))
    for n in MODULE_NAMES[2:]:
        assert rel_err(sum(r[n] for r in got), ref[n]) < TOL[torch.float32]["bwd"], n


def test_module_has_the_transformers_parameter(clusters):
    """`sinks=True` makes the parameter `sinks` `[H]` in the layer's dtype (gpt-oss's name);
    without, there is none."""
    got = clusters(2).run(_parameters)
    assert all(r == [("sinks", (4,), "torch.bfloat16")] for r in got), got


def _parameters(rank, world_size):
    import torch.distributed as dist

    import upipe

    with_, without = (
        upipe.ContextParallelAttention(
            32, 4, 2, group=dist.group.WORLD, sinks=s, dtype=torch.bfloat16
        )  # fmt: skip
        for s in (True, False)
    )
    names = {n for n, _ in without.named_parameters()}
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in with_.named_parameters()
            if n not in names]  # fmt: skip


@pytest.mark.parametrize("strategy", ["upipe", "ulysses", "ring"])
def test_checkpoint_keeping_outputs_is_exact(clusters, strategy):
    """Inside an activation checkpoint that keeps attention outputs, the recomputation reuses
    out' and lse' (the sinks are not applied twice): every gradient equals recompute's."""
    cfg = dict(B=1, S=S, dim=32, num_heads=4, num_kv_heads=2)
    assert all(clusters(2).run(checkpointed, cfg, {"strategy": strategy, "window": 5}, CU))


@pytest.mark.parametrize("strategy,world,kwargs", [("ulysses", 2, {}),
                                                   ("upipe", 4, {"heads_per_stage": 4}),
                                                   ("ring", 2, {})])  # fmt: skip
def test_bf16_within_bound(clusters, strategy, world, kwargs):
    """bf16 error at most `bf16_bound` of one device running the same calls in bf16."""
    shape, w = dict(B=1, S=S, H=4, G=2, d=8), 5
    ref = reference(shape, CU, window=w)
    single = one_device(shape, CU, torch.bfloat16, window=w)
    got = _summed(clusters(world).run(run, strategy, shape, {**kwargs, "window": w}, CU,
                                      torch.bfloat16))  # fmt: skip
    _check_bf16(got, single, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strategy", ["ulysses", "upipe", "ring"])
def test_cuda_path_emulated(clusters, strategy, dtype):
    """backend="cuda" under the emulated CUDA contracts (bf16: the varlen flash kernel with
    its native window; fp32: the memory-efficient kernel): the sinks sit outside them."""
    shape, w = dict(B=2, S=S, H=4, G=2, d=8), 5
    ref = reference(shape, CU, window=w)
    kwargs = {"backend": "cuda", "window": w}
    got = _summed(clusters(2).run(run, strategy, shape, kwargs, CU, dtype, True))
    if dtype == torch.float32:
        _check(got, ref)
    else:
        single = one_device(shape, CU, dtype, window=w)
        _check_bf16(got, single, ref)


# --- bad input ---------------------------------------------------------------------------


def _wrong_shape(H, rank):
    return torch.zeros(H + 1)


def _two_d(H, rank):
    return torch.zeros(1, H)


def _integers(H, rank):
    return torch.zeros(H, dtype=torch.long)


def _other_device(H, rank):
    return torch.zeros(H, device="meta")


def _on_rank_1_only(H, rank):
    return torch.zeros(H) if rank == 1 else None


@pytest.mark.parametrize("make,match", [
    (_wrong_shape, r"shape \[num_heads\] = \(4,\).*got \(5,\)"),
    (_two_d, r"got \(1, 4\)"),
    (_integers, "floating-point"),
    (_other_device, "sinks is on meta but q is on cpu"),
    (_on_rank_1_only, "sinks: rank 0 has False, rank 1 has True"),
])  # fmt: skip
def test_bad_sinks_raise_on_every_rank(clusters, make, match):
    import re

    got = clusters(2).run(bad_sinks, dict(B=1, S=S, H=4, G=2, d=8), make)
    for errors in got:
        assert all(e is not None and re.search(match, e) for e in errors), got
    assert len({e for errors in got for e in errors}) <= 2, got  # a rank's own or its peer's


# --- upipe bench --layer --window --sinks ------------------------------------------------


@pytest.mark.slow  # its own spawned ranks (run_bench), not the session's clusters
def test_bench_layer_with_window_and_sinks():
    """`upipe bench --layer --window 5 --sinks --variants`: every strategy's layer in each
    variant (full causal, window, sinks, both) right against the float64 layer of that
    variant, the sinks' gradient among the results where it has sinks; the options need
    --layer, --variants a window or sinks."""
    from upipe.bench import BenchConfig, run_bench, validate

    kw = dict(nproc=2, seq_lens=(64,), heads=4, kv_heads=2, head_dim=8, json="", plot="")
    assert "add --layer" in validate(BenchConfig(**kw, sinks=True), 2)
    assert "causal" in validate(BenchConfig(**kw, layer=True, window=5, causal=False), 2)
    assert "give one of them" in validate(BenchConfig(**kw, layer=True, variants=True), 2)
    cfg = BenchConfig(**kw, methods=("upipe", "ring"), repeats=1, warmup_rounds=0,
                      layer=True, window=5, sinks=True, variants=True)  # fmt: skip
    doc = run_bench(cfg, quiet=True)
    rows = {r["method"]: r for r in doc["results"]}
    names = ("layer:upipe(U=2)", "layer:ring")
    suffixes = ("", " sinks", " w=5", " w=5 sinks")
    assert set(rows) == {n + v for n in names for v in suffixes}, doc["methods"]
    for name, r in rows.items():
        assert ("dsinks" in r["rel_err"]) == name.endswith("sinks"), r
        assert r["correct"] and r["max_rel_err"] < 1e-5, r
    # no Ulysses ran: the first of --methods is the baseline, each variant over its own
    assert doc["baseline"] == "layer:upipe(U=2)"
    for v in suffixes:
        ring, base = rows["layer:ring" + v], rows["layer:upipe(U=2)" + v]
        assert ring["baseline"] == base["method"]
        assert ring["memory_over_baseline"] == ring["peak_units_BLD"] / base["peak_units_BLD"]
