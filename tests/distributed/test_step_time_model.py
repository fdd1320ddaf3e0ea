"""benchmarks/step_time_model.py runs, and its numbers hold together: formulas against counts
taken from the layer shapes and `plan_rounds`, totals against parts, printed ratios against
printed step times, the fixed code never slower than the old."""

import dataclasses
import importlib.util
import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

from upipe.heads import plan_rounds

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "step_time_model.py"
_spec = importlib.util.spec_from_file_location("step_time_model", SCRIPT)
stm = sys.modules.setdefault("step_time_model", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(stm)  # registered first: dataclasses look their module up
M, C, U = stm.M, stm.C, stm.U


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_time_model") / "model.json"
    cmd = [sys.executable, str(SCRIPT), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_totals_are_the_sums_of_their_parts(run):
    _, doc = run
    assert len(doc["rows"]) == 8
    for r in doc["rows"]:
        assert all(v >= 0 for v in r["parts"].values()), r
        assert r["step_s"] == pytest.approx(sum(r["parts"].values()), rel=1e-12), r
    c = doc["claims"]
    t = {(r["strategy"], r["version"], r["seq"]): r for r in doc["rows"]}
    old = t["upipe", "before", "128K"]
    assert c["fp32_share_128K"] == pytest.approx(old["parts"]["fp32_acc"] / old["step_s"])


@pytest.mark.parametrize("scenario", list(stm.SCENARIOS))
def test_after_never_slower_and_ulysses_differs_only_in_syncs(scenario):
    hw = dataclasses.replace(stm.Hardware(), **stm.SCENARIOS[scenario])
    rows, _, t = stm.evaluate(hw)
    for st in ("ulysses", "upipe"):
        for seq in stm.SEQS:
            assert t[st, "after", seq] <= t[st, "before", seq], (st, seq)
    parts = {(r["strategy"], r["version"], r["seq"]): r["parts"] for r in rows}
    for seq in stm.SEQS:
        old, new = parts["ulysses", "before", seq], parts["ulysses", "after", seq]
        assert {k: v for k, v in old.items() if k != "syncs"} == {
            k: v for k, v in new.items() if k != "syncs"
        }
        assert new["syncs"] == 0 < old["syncs"]


@pytest.mark.slow
def test_printed_ratios_are_the_printed_steps_divided(run):
    stdout, doc = run
    steps = {
        (m[1], m[2], m[3]): float(m[4])
        for m in re.finditer(r"^(ulysses|upipe)\s+(before|after)\s+(\S+)\s+([\d.]+)", stdout, re.M)
    }
    assert len(steps) == 8
    seqs = list(stm.SEQS)
    printed = {
        m[1]: dict(zip(seqs, map(float, m[2].split()), strict=True))
        for m in re.finditer(r"^  (before|after)\s+((?:[\d.]+\s*){2})$", stdout, re.M)
    }
    assert set(printed) == {"before", "after"}
    for v, ratios in printed.items():
        for seq, ratio in ratios.items():
            assert ratio == pytest.approx(
                steps["upipe", v, seq] / steps["ulysses", v, seq], abs=1e-3
            ), (v, seq)
            assert ratio == pytest.approx(doc["ratios"][v][seq], abs=6e-4)


def test_attention_flops_match_a_count_from_the_stages():
    """Per rank, each stage's U / C query heads attend over all S tokens: Q K^T and P V are
    2 d FLOPs per (query, key) pair each, and a causal mask keeps S (S + 1) / 2 pairs."""
    d = M["d"]
    for S in stm.SEQS.values():
        stages = [st for r in plan_rounds(M["H"], M["G"], C, U) for st in r.stages]
        count = sum(len(st) // C for st in stages) * 2 * (2 * d) * S * (S + 1) // 2
        assert stm.attention_flops(S, M["H"] // C, d) == pytest.approx(count, rel=1e-5)


@pytest.mark.parametrize(
    "H,G,C_,U_", [(32, 8, 8, 8), (32, 8, 8, 16), (32, 8, 8, 32), (32, 2, 8, 8), (8, 2, 2, 4)]
)
def test_schedule_matches_plan_rounds(H, G, C_, U_):
    rounds = plan_rounds(H, G, C_, U_)
    assert stm.schedule(H, G, C_, U_) == (len(rounds), sum(len(r.stages) for r in rounds))


def test_exchange_bytes_match_a_count_from_the_schedule():
    """Heads a rank sends per layer call: forward each round's k and v (C k heads each), each
    stage's q and out (U each); backward k and v again and dk, dv back, each stage's q, out,
    dout and dq back."""
    rounds = plan_rounds(M["H"], M["G"], C, U)
    fwd = sum(2 * len(r.kv_heads) + 2 * U * len(r.stages) for r in rounds)
    bwd = sum(4 * len(r.kv_heads) + 4 * U * len(r.stages) for r in rounds)
    L = stm.SEQS["1M"] // C
    unit = L * M["d"] * 2
    assert stm.a2a_bytes("upipe", L) == (fwd * unit, bwd * unit)
    q, kv = M["H"] * unit, M["G"] * unit  # Ulysses: q, k, v there and out back, reversed
    assert stm.a2a_bytes("ulysses", L) == (2 * q + 2 * kv, 2 * q + 2 * kv)


def test_fp32_accumulation_flops_and_sync_counts():
    """With memory traffic free, the accumulation time is its FLOPs over the GEMM rate: per
    layer per step 2 L D d (2H for y in the two forward passes + H + 2G' for dx)."""
    hw = dataclasses.replace(stm.Hardware(), hbm=math.inf)
    L, D, d, Gv = 4096, M["D"], M["d"], max(M["G"], C)
    flops = 2 * L * D * d * (3 * M["H"] + 2 * Gv)
    assert stm.accumulation(L, hw, "before", 2) * hw.fp32 == pytest.approx(flops)
    assert stm.accumulation(L, hw, "after", 2) * hw.bf16 == pytest.approx(flops)
    # one second per host sync, agreements free of their own: count the syncs
    hw = dataclasses.replace(stm.Hardware(), op_cpu=1.0, sync_ops=1, agree=0.0)
    rounds = plan_rounds(M["H"], M["G"], C, U)
    index = 3 * (len(rounds) + sum(len(r.stages) for r in rounds))  # fwd, recomputed fwd, bwd
    assert stm.syncs("upipe", "before", hw, 2) == index + 2 * 1 * 2  # 1 agreement a call
    assert stm.syncs("ulysses", "before", hw, 2) == 2 * 2 * 2  # 2 agreements a call
    assert stm.syncs("upipe", "after", hw, 2) == stm.syncs("ulysses", "after", hw, 2) == 0
