"""`upipe bench --model` (upipe.bench.model): one Hugging Face model's training step under
DeepSpeed ALST's attention and upipe's, at a small size on the test session's 2 ranks."""

from __future__ import annotations

import dataclasses

import pytest

from upipe.bench import BenchConfig, model_config, validate
from upipe.bench.model import MODEL_METHODS, ModelMethod, drive
from upipe.bench.run import judge

SMALL = dict(nproc=2, seq_lens=(512,), heads=8, kv_heads=2, head_dim=16, repeats=1, warmup=0)


@pytest.mark.slow
def test_every_method_agrees_with_the_unsharded_model(clusters):
    pytest.importorskip("deepspeed")  # ALST's attention and tiled MLP
    cfg = model_config(BenchConfig(model=True, **SMALL))
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


def test_model_options_are_checked():
    assert "--model runs on CPU ranks in float32" in validate(
        BenchConfig(model=True, layer=True, **SMALL), 2
    )
    cfg = dataclasses.replace(BenchConfig(model=True, **SMALL), methods=("upipe", "ring"))
    assert "--model: unknown methods ['ring']" in validate(cfg, 2)
