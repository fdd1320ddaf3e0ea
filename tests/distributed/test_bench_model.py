"""`upipe bench --whole-model` (upipe.bench.model): one Hugging Face model's training step
under DeepSpeed ALST's attention and upipe's, at a small size on the test session's 2 ranks."""

from __future__ import annotations

import dataclasses

import pytest

from upipe.bench import BenchConfig, model_config, run_bench, validate
from upipe.bench.model import MODEL_METHODS, ModelMethod, drive
from upipe.bench.recipes import FULL_METHODS
from upipe.bench.report import add_growth, table
from upipe.bench.run import judge

SMALL = dict(nproc=2, seq_lens=(512,), heads=8, kv_heads=2, head_dim=16, repeats=1, warmup_rounds=0)
# the whole recipes at two lengths: a vocabulary above the width, tiles and chunks of 64 of a
# rank's 128 / 256 tokens, checkpointing on
FULL = dict(
    SMALL,
    seq_lens=(256, 512),
    methods=FULL_METHODS,
    vocab_size=320,
    mlp_size=96,
    activation_checkpoint=True,
    mlp_tile=64,
    loss_chunk=64,
)


@pytest.mark.slow
def test_every_method_agrees_with_the_unsharded_model(clusters):
    pytest.importorskip("deepspeed")  # ALST's attention and tiled MLP
    cfg = model_config(BenchConfig(whole_model=True, **SMALL))
    assert cfg.methods == MODEL_METHODS
    rows = drive(clusters(2).run, cfg, [ModelMethod(n) for n in cfg.methods])
    judge(rows, "float32", "alst")
    assert [r["method"] for r in rows] == list(MODEL_METHODS)
    for r in rows:  # loss and summed gradients vs one process: fp32 rounding
        assert r["correct"] and r["max_rel_err"] < 1e-5, r
        assert len(r["peak_bytes_per_rank"]) == 2 and r["median_seconds"] > 0
    peak = {r["method"]: r["peak_units_BLD"] for r in rows}
    # ALST's tiled MLP (ceil(256 / 128) = 2 tiles) and upipe's fused stages each save memory
    assert peak["alst+tiled-mlp"] < peak["alst"] and peak["upipe"] < peak["alst"]
    assert peak["upipe+tiled-mlp"] < peak["alst+tiled-mlp"]


@pytest.mark.slow
def test_whole_recipes_agree_with_the_unsharded_model(clusters):
    """alst-full (ALST's attention, TiledMLP, TiledFusedLogitsLoss, HF checkpointing),
    upipe-full (apply_context_parallel's stack) and upipe-train (upipe's own model)."""
    pytest.importorskip("deepspeed")
    cfg = BenchConfig(whole_model=True, **FULL)
    assert validate(cfg, 2) is None
    rows = drive(clusters(2).run, cfg, [ModelMethod(n) for n in cfg.methods])
    judge(rows, "float32", "alst-full")
    assert [(r["seq_len"], r["method"]) for r in rows] == [
        (S, m) for S in (256, 512) for m in FULL_METHODS
    ]
    for r in rows:  # loss and summed gradients vs one process: fp32 rounding
        assert r["correct"] and r["max_rel_err"] < 1e-5, r
        assert r["rel_err"]["loss"] <= 1e-6, r
    at = {(r["seq_len"], r["method"]): r for r in rows}
    for m in FULL_METHODS:  # the growth column: from the peaks, per token added to a rank
        assert at[256, m]["kib_per_added_token"] is None
        grown = max(at[512, m]["peak_bytes_per_rank"]) - max(at[256, m]["peak_bytes_per_rank"])
        assert at[512, m]["kib_per_added_token"] == pytest.approx(grown / 1024 / 128)
        assert at[512, m]["kib_per_added_token"] > 0
    assert "KiB/token" in table(rows, {}, header="h", ratios="r")
    # upipe's stack holds less than ALST's at each length (fused staged attention, no
    # normalised [L, D] before the loss)
    for S in (256, 512):
        assert at[S, "upipe-full"]["peak_mib"] < at[S, "alst-full"]["peak_mib"]


def test_growth_is_the_peak_difference_over_the_tokens_added():
    MiB = 2**20
    rows = [
        {"seq_len": S, "method": m, "peak_bytes_per_rank": [p, p - MiB]}
        for m, peaks in {
            "a": (10 * MiB, 12 * MiB, 20 * MiB),
            "b": (5 * MiB, 5 * MiB, 6 * MiB),
        }.items()
        for S, p in zip((1024, 2048, 4096), peaks, strict=True)
    ]
    add_growth(rows, 4)
    got = {(r["method"], r["seq_len"]): r["kib_per_added_token"] for r in rows}
    assert got["a", 1024] is None and got["b", 1024] is None
    assert got["a", 2048] == 2 * 1024 / 256 and got["a", 4096] == 8 * 1024 / 512
    assert got["b", 2048] == 0 and got["b", 4096] == 1024 / 512


def test_model_options_are_checked():
    assert "--whole-model runs on CPU ranks in float32" in validate(
        BenchConfig(whole_model=True, layer=True, **SMALL), 2
    )
    cfg = dataclasses.replace(BenchConfig(whole_model=True, **SMALL), methods=("upipe", "ring"))
    assert "--whole-model: unknown methods ['ring']" in validate(cfg, 2)

    for option, value, message in (
        ("vocab_size", 1, "--vocab-size must be >= 2, got 1"),
        ("mlp_size", -1, "--mlp-size must be >= 0, got -1"),
        ("layers", 0, "--layers must be >= 1, got 0"),
        ("mlp_tile", 0, "--mlp-tile must be >= 1, got 0"),
        ("loss_chunk", -4, "--loss-chunk must be >= 1, got -4"),
    ):
        bad = BenchConfig(whole_model=True, **{**FULL, option: value})
        assert validate(bad, 2) == message
        with pytest.raises(ValueError, match=message):  # before any rank is spawned
            run_bench(bad, quiet=True)


@pytest.mark.slow  # (8 s)
def test_hybrid_model_agrees_with_the_unsharded_model(clusters):
    """--hybrid: a Qwen3-Next (a Gated DeltaNet layer, then gated full attention) under
    apply_context_parallel's methods; ALST's are skipped with the reason."""
    cfg = BenchConfig(whole_model=True, hybrid=True, **{**FULL, "seq_lens": (256,), "layers": 2,
                      "methods": ("upipe-ulysses", "upipe", "upipe-full", "alst")})  # fmt: skip
    assert validate(cfg, 2) is None
    assert "no Gated DeltaNet" in ModelMethod("alst").problem(H=8, G=2, C=2, hybrid=True)
    methods = [ModelMethod(n) for n in cfg.methods[:3]]
    rows = drive(clusters(2).run, cfg, methods)
    judge(rows, "float32", None)
    for r in rows:  # loss and summed gradients vs one process: fp32 rounding
        assert r["correct"] and r["max_rel_err"] < 1e-5, r
    assert validate(BenchConfig(hybrid=True, **SMALL), 2) == (
        "--hybrid is an option of --whole-model (a hybrid model's training step)"
    )
