"""`upipe bench`: a tiny run on 2 gloo ranks; verdicts, skipped peers, the CLI's validation."""

from __future__ import annotations

import json

import pytest

import upipe.bench.peers as peers
from upipe.bench import BenchConfig, plan_methods, run_bench
from upipe.bench.layer import UpipeLayer
from upipe.bench.peers import UpipeMethod
from upipe.bench.run import judge
from upipe.cli import main


class WrongUlysses(UpipeMethod):
    """Ulysses with its output scaled by 1.5: a method that computes a wrong answer."""

    def __init__(self):
        super().__init__("ulysses")
        self.name = "wrong-ulysses"

    def __call__(self, q_BLHd, k_BLGd, v_BLGd, *, causal):
        return 1.5 * super().__call__(q_BLHd, k_BLGd, v_BLGd, causal=causal)


@pytest.mark.slow
def test_tiny_run(tmp_path):
    pytest.importorskip("matplotlib")  # (its PNG is checked)
    cfg = BenchConfig(
        nproc=2,
        seq_lens=(64, 128),
        methods=("ulysses", "upipe", "upipe:4", "ring", "usp", "yunchang-usp", "torch-cp"),
        heads=4,
        kv_heads=2,
        head_dim=8,
        repeats=1,
        warmup_rounds=0,
        json=str(tmp_path / "bench.json"),
        plot=str(tmp_path / "bench.png"),
    )
    doc = run_bench(cfg, extra_methods=[WrongUlysses()], quiet=True)
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(doc))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"config", "machine", "methods", "results", "baseline"} <= set(doc)
    assert doc["machine"]["torch"] and doc["machine"]["backend"] == "gloo"
    assert doc["baseline"] == "ulysses"  # the default: the Ulysses-like method

    ours = ["ulysses", "upipe(U=2)", "upipe(U=4)", "ring", "usp"]
    for name in [*ours, "wrong-ulysses"]:
        assert doc["methods"][name]["status"] == "ran", name
    # on CPU the peers that cannot run are skipped with the reason, not an error
    assert doc["methods"]["yunchang-usp"] == {
        "status": "skipped",
        "reason": peers.YUNCHANG_CPU_REASON,
    }
    assert doc["methods"]["torch-cp"]["status"] == "skipped"
    assert "context_parallel" in doc["methods"]["torch-cp"]["reason"]

    rows = doc["results"]
    assert {(r["seq_len"], r["method"]) for r in rows} == {
        (S, m) for S in (64, 128) for m in [*ours, "wrong-ulysses"]
    }
    for r in rows:
        assert len(r["peak_bytes_per_rank"]) == 2 and r["median_seconds"] > 0
        if r["method"] == "wrong-ulysses":
            assert not r["correct"] and r["rel_err"]["out"] > 0.1
            assert r["rank_memory"] is None and r["rank_time"] is None
            assert r["memory_over_baseline"] is None
        else:
            assert r["correct"] and r["max_rel_err"] < 1e-5, r
            assert r["rank_memory"] in range(1, 6) and r["rank_time"] in range(1, 6)
            assert r["baseline"] == "ulysses"
        if r["method"] == "ulysses":
            assert r["memory_over_baseline"] == r["time_over_baseline"] == 1.0
    # this method / the baseline: below 1 where it holds less
    at = {(r["seq_len"], r["method"]): r for r in rows}
    upipe_row, ulysses_row = at[128, "upipe(U=2)"], at[128, "ulysses"]
    assert upipe_row["memory_over_baseline"] == (
        upipe_row["peak_units_BLD"] / ulysses_row["peak_units_BLD"]
    )
    assert upipe_row["time_over_baseline"] == (
        upipe_row["median_seconds"] / ulysses_row["median_seconds"]
    )


class WrongLayer(UpipeLayer):
    """The Ulysses layer whose o_proj weight gradient is doubled: right output, wrong dWo."""

    def __init__(self):
        super().__init__("ulysses", shape=(4, 2, 8), seed=0, causal=True)
        self.name = "wrong-layer"

    def results(self, out, leaves):
        *rest, dWo = super().results(out, leaves)
        return [*rest, 2 * dWo]


@pytest.mark.slow
def test_layer_mode(tmp_path):
    """--layer: upipe's strategies as ContextParallelAttention vs the float64 layer (y, dx
    and all weight gradients); a peer is skipped; a wrong weight gradient is caught; past
    --reference-up-to a length is measured, not checked."""
    cfg = BenchConfig(
        nproc=2,
        seq_lens=(64, 128),
        reference_up_to=64,
        methods=("ulysses", "upipe", "ring", "usp", "deepspeed-ulysses"),
        heads=4,
        kv_heads=2,
        head_dim=8,
        repeats=1,
        warmup_rounds=0,
        json="",
        plot="",
        layer=True,
    )
    doc = run_bench(cfg, extra_methods=[WrongLayer()], quiet=True)
    assert doc["baseline"] == "layer:ulysses"
    assert "without --layer" in doc["methods"]["deepspeed-ulysses"]["reason"]
    assert "1-D group" in doc["methods"]["layer:usp"]["reason"]
    unchecked = [r for r in doc["results"] if r["seq_len"] == 128]
    assert len(unchecked) == 4 and all(r["correct"] is None for r in unchecked), unchecked
    assert all(r["rel_err"] == {} and r["median_seconds"] > 0 for r in unchecked)
    rows = {r["method"]: r for r in doc["results"] if r["seq_len"] == 64}
    assert set(rows) == {"layer:ulysses", "layer:upipe(U=2)", "layer:ring", "wrong-layer"}
    for name, r in rows.items():
        assert set(r["rel_err"]) == {"y", "dx", "dWq", "dWk", "dWv", "dWo"}
        if name == "wrong-layer":
            assert not r["correct"] and r["rel_err"]["y"] < 1e-5 < 0.5 < r["rel_err"]["dWo"]
        else:
            assert r["correct"] and r["max_rel_err"] < 1e-5, r


def test_missing_peer_is_skipped_with_a_message(monkeypatch):
    monkeypatch.setattr(peers, "installed_version", lambda package: None)
    cfg = BenchConfig(nproc=2, seq_lens=(64,), methods=("ulysses", "deepspeed-ulysses"))
    methods, skipped = plan_methods(cfg, 2)
    assert [m.name for m in methods] == ["ulysses"]
    assert "deepspeed is not installed" in skipped["deepspeed-ulysses"]
    assert "pip install 'upipe[bench]'" in skipped["deepspeed-ulysses"]


def test_judge_ranks_only_correct_methods():
    def row(method, err, units, seconds):
        return {
            "seq_len": 8,
            "method": method,
            "max_rel_err": err,
            "peak_units_BLD": units,
            "median_seconds": seconds,
        }

    rows = [row("upipe(U=2)", 1e-7, 4.0, 2.0), row("fast-wrong", 0.5, 1.0, 1.0)]
    rows.append(row("peer", 1e-7, 8.0, 1.0))
    judge(rows, "float32", "upipe(U=2)")
    upipe_row, wrong, peer = rows
    assert not wrong["correct"] and wrong["rank_memory"] is None and wrong["rank_time"] is None
    assert upipe_row["rank_memory"] == 1 and peer["rank_memory"] == 2
    assert peer["rank_time"] == 1 and upipe_row["rank_time"] == 2
    # this / baseline: the peer holds twice the memory in half the time
    assert peer["memory_over_baseline"] == 2.0 and peer["time_over_baseline"] == 0.5
    assert wrong["memory_over_baseline"] is None and upipe_row["memory_over_baseline"] == 1.0


def test_the_ratios_line_names_the_baseline():
    from upipe.bench.report import ratios_line

    line = ratios_line("ulysses", "", False)
    assert line.startswith("mem ratio, time ratio = this method / ulysses (< 1: leaner / ")
    assert ratios_line(None, "ring", False) == "no ratios: the baseline ring did not run"
    assert "each variant over its own variant" in ratios_line("layer:ulysses", "", True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-lens", "100"], "multiples of 2 * nproc"),
        (["--methods", "megatron"], "unknown method 'megatron'"),
        (["--kv-heads", "3"], "must divide --heads"),
        (
            ["--methods", "ulysses", "upipe", "--baseline", "ring"],
            "--baseline ring is not among --methods (ulysses upipe): add it there or name one",
        ),
        (["--baseline", "megatron"], "--baseline: unknown method 'megatron'"),
        (
            ["--whole-model", "--methods", "upipe", "--baseline", "alst"],
            "--baseline alst is not among --methods (upipe)",
        ),
    ],
)
def test_cli_rejects_bad_options(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
