"""The time model's hardware presets (`upipe.planner.hardware`): complete and sourced, the
attention time set by the chosen kernel's rates, `auto` as kernels_select picks it, measured
rates from a gpu_check.json in place of the published ones, and clear refusals."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

from upipe.kernels_select import CUDA_KERNELS, IMPL_MAJORS, auto_order
from upipe.planner.hardware import (
    HARDWARE,
    RATE_FIELDS,
    STOCK_KERNELS,
    Hardware,
    get_hardware,
    measured_rates,
    resolve_kernel,
    with_measured_rates,
)
from upipe.planner.plan import PlanConfig
from upipe.planner.recommend import RecommendConfig, recommend
from upipe.planner.timing import predict

H100 = get_hardware("h100")


@pytest.mark.parametrize("name", list(HARDWARE))
def test_presets_are_complete_and_sourced(name):
    hw = HARDWARE[name]
    assert set(hw.sources) == set(RATE_FIELDS)
    for field in RATE_FIELDS:
        assert getattr(hw, field) > 0 and len(hw.sources[field]) > 20, field
    assert hw.kernels and set(hw.kernels) <= set(CUDA_KERNELS)
    for kernel, rate in hw.kernels.items():
        assert len(rate.source) > 20, kernel
        for value in (rate.forward, rate.backward):
            assert value is None or value > 0, kernel
    # FA3 / FA4 exactly where torch's impls run them (kernels_select.IMPL_MAJORS)
    for kernel, majors in IMPL_MAJORS.items():
        assert (kernel in hw.kernels) == (hw.capability[0] in majors), kernel
    assert set(STOCK_KERNELS) <= set(hw.kernels)  # torch's own kernels run everywhere here


def test_every_field_rated_is_listed():
    """RATE_FIELDS covers every float field of Hardware (a new rate needs its source)."""
    floats = {f.name for f in dataclasses.fields(Hardware) if f.type == "float"}
    assert floats == set(RATE_FIELDS)


def _counts(forward: float, backward: float) -> dict:
    counts = dict.fromkeys(
        ("gemm_flops", "memory_bytes", "host_to_device_bytes", "device_to_host_bytes"), 0
    )
    counts.update(host_compute_bytes=0, fsdp_host_to_device_bytes=0, fsdp_device_to_host_bytes=0)
    counts.update(gemm_flops=1e15, attention_forward_flops=forward)
    counts["attention_backward_flops"] = backward
    return counts


@pytest.mark.parametrize("name", [n for n, hw in HARDWARE.items() if len(hw.rated()) >= 2])
def test_kernel_choice_scales_attention_by_the_rates(name):
    """Attention seconds = F_fwd / R_fwd + F_bwd / R_bwd of the kernel chosen: each direction
    alone scales by the ratio of two kernels' rates, and nothing else moves."""
    hw = HARDWARE[name]
    F = 3.7e17
    rated = hw.rated()
    for kernel in rated:
        rate = hw.kernel_rate(kernel)
        t = predict(_counts(F, 2.5 * F), hw, kernel)
        assert t["attention"] == pytest.approx(F / rate.forward + 2.5 * F / rate.backward)
    for a, b in zip(rated, rated[1:], strict=False):
        ra, rb = hw.kernel_rate(a), hw.kernel_rate(b)
        fwd = [predict(_counts(F, 0), hw, k)["attention"] for k in (a, b)]
        bwd = [predict(_counts(0, F), hw, k)["attention"] for k in (a, b)]
        assert fwd[0] / fwd[1] == pytest.approx(rb.forward / ra.forward)
        assert bwd[0] / bwd[1] == pytest.approx(rb.backward / ra.backward)
        ta, tb = (predict(_counts(F, F), hw, k) for k in (a, b))
        assert ta["gemm"] == tb["gemm"] and ta["step"] - ta["attention"] == pytest.approx(
            tb["step"] - tb["attention"]
        )


@pytest.mark.parametrize("name", list(HARDWARE))
def test_auto_is_the_stock_kernel_auto_picks(name):
    hw = HARDWARE[name]
    line = [k for k in auto_order(hw.capability[0], torch.bfloat16) if k in STOCK_KERNELS]
    assert resolve_kernel("auto", hw) == line[0]


def test_unknown_absent_and_unrated_kernels_are_refused():
    with pytest.raises(ValueError, match="unknown attention kernel 'fa5'"):
        resolve_kernel("fa5", H100)
    with pytest.raises(ValueError, match="unknown attention kernel 'fa5'"):
        predict(_counts(1, 1), H100, "fa5")
    a100, b200 = get_hardware("a100"), get_hardware("b200")
    with pytest.raises(ValueError, match="'fa3' does not run on a100 .*Hopper-only"):
        predict(_counts(1, 1), a100, "fa3")
    with pytest.raises(ValueError, match="'fa3' does not run on b200"):
        resolve_kernel("fa3", b200)
    with pytest.raises(ValueError, match="'fa4' does not run on a100"):
        a100.kernel_rate("fa4")
    unrated = next(k for k, r in H100.kernels.items() if r.forward is None)
    with pytest.raises(ValueError, match=f"no published '{unrated}' attention rate on h100"):
        predict(_counts(1, 1), H100, unrated)
    with pytest.raises(ValueError, match="--rates-from"):
        predict(_counts(1, 1), b200)  # auto: cudnn, which has no published rate there


def _gpu_check(path, device="NVIDIA H100 80GB HBM3", dry_run=False):
    """A gpu_check.json as benchmarks/gpu_check.py writes it (part "kernels": one row per
    kernel and shape, `_speed_case`'s fields; part "block": `_copy_rates`'): cudnn timed at
    two shapes, fa4 at one, flash failing its check, efficient skipped."""
    kernels = [
        dict(kernel="cudnn", S=131072, h=4, g=1, runs=5, ok=True,
             fwd_ms=100.0, fwd_tflops=400.0, bwd_ms=300.0, bwd_tflops=350.0),
        dict(kernel="cudnn", S=1048576, h=1, g=1, runs=3, ok=True,
             fwd_ms=1600.0, fwd_tflops=500.0, bwd_ms=4400.0, bwd_tflops=450.0),
        dict(kernel="fa4", S=131072, h=4, g=1, runs=5, ok=True,
             fwd_ms=90.0, fwd_tflops=600.0, bwd_ms=260.0, bwd_tflops=520.0),
        dict(kernel="flash", S=131072, h=4, g=1, runs=5, ok=False,
             fwd_ms=10.0, fwd_tflops=9999.0, bwd_ms=10.0, bwd_tflops=9999.0),
        dict(kernel="efficient", skipped="time box: needs ~9 s"),
    ]  # fmt: skip
    block = [dict(offloaded=False), dict(offloaded=True, d2h_gbps=41.0, h2d_gbps=37.5)]
    doc = {
        "date": "2026-12-02",
        "dry_run": dry_run,
        "environment": {"device": device},
        "parts": {"kernels": {"rows": kernels}, "block": {"rows": block}},
    }
    path.write_text(json.dumps(doc))
    return str(path)


def test_rates_from_replace_the_published_ones(tmp_path):
    path = _gpu_check(tmp_path / "gpu_check.json")
    hw = with_measured_rates(H100, path)
    # each kernel's FLOPs over its time: (400 x 100 + 500 x 1600) / 1700 TFLOP/s forward
    cudnn = hw.kernel_rate("cudnn")
    assert cudnn.forward == pytest.approx((400 * 100 + 500 * 1600) / 1700 * 1e12)
    assert cudnn.backward == pytest.approx((350 * 300 + 450 * 4400) / 4700 * 1e12)
    assert "measured by benchmarks/gpu_check.py on NVIDIA H100" in cudnn.source
    fa4 = hw.kernel_rate("fa4")  # unrated in the preset, measured here
    assert (fa4.forward, fa4.backward) == pytest.approx((600e12, 520e12))
    assert hw.kernels["flash"] == H100.kernels["flash"]  # failed its check: published kept
    assert hw.kernels["fa3"] == H100.kernels["fa3"]  # not measured: published kept
    assert hw.host_link == pytest.approx(37.5e9) and "host-to-device" in hw.sources["host_link"]
    assert hw.gemm == H100.gemm and hw.sources["gemm"] == H100.sources["gemm"]
    assert set(measured_rates(json.loads(pathlib.Path(path).read_text()))) == {"cudnn", "fa4"}
    F = 1e18
    t0, t1 = (predict(_counts(F, 2.5 * F), h, "cudnn")["attention"] for h in (H100, hw))
    assert t1 / t0 == pytest.approx(
        (F / cudnn.forward + 2.5 * F / cudnn.backward)
        / (F / H100.kernel_rate("cudnn").forward + 2.5 * F / H100.kernel_rate("cudnn").backward)
    )


def test_rates_from_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="is a dry run"):
        with_measured_rates(H100, _gpu_check(tmp_path / "a.json", device="cpu", dry_run=True))
    with pytest.raises(ValueError, match="measured on NVIDIA H200, not on h100.*h200"):
        with_measured_rates(H100, _gpu_check(tmp_path / "b.json", device="NVIDIA H200"))
    empty = tmp_path / "c.json"
    empty.write_text(json.dumps({"environment": {"device": "NVIDIA H100"}, "parts": {}}))
    with pytest.raises(ValueError, match="nothing to replace"):
        with_measured_rates(H100, str(empty))
    with pytest.raises(ValueError, match="cannot read a gpu_check.json"):
        with_measured_rates(H100, str(tmp_path / "missing.json"))


def test_recommend_times_the_kernel_with_measured_rates(tmp_path):
    """`--recommend --attention-kernel cudnn --rates-from`: every fitting row's attention time
    is its counts over the measured cudnn rates, and the JSON says which kernel and rates."""
    path = _gpu_check(tmp_path / "gpu_check.json")
    pc = PlanConfig(model="tiny", gpus=2, strategies=("ulysses",), features=("off",))
    pc = dataclasses.replace(pc, granularity=64, jobs=1, attention_kernel="cudnn")
    res = recommend(pc, RecommendConfig(recommend=True, seq_len=2048, rates_from=path))
    rate = with_measured_rates(H100, path).kernel_rate("cudnn")
    assert res["attention_kernel"] == "cudnn" and res["attention_rates"]["forward"] == rate.forward
    rows = [r for r in res["candidates"] if r.get("fits")]
    assert rows and "--attention-kernel cudnn" in res["command"]
    for r in rows:
        c = r["counts"]
        want = c["attention_forward_flops"] / rate.forward
        want += c["attention_backward_flops"] / rate.backward
        assert r["seconds"]["attention"] == pytest.approx(want)
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / pc.gpus)
    with pytest.raises(ValueError, match="'fa3' does not run on a100"):
        pc3 = dataclasses.replace(pc, attention_kernel="fa3")
        recommend(pc3, RecommendConfig(recommend=True, seq_len=2048, hardware="a100"))


def test_attention_counts_are_torchs_and_take_gqa():
    """The planner's SDPA counts equal torch.utils.flop_counter's where torch's apply (equal
    query and kv heads; torch 2.11's assert otherwise), and count the query heads under GQA."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from upipe.planner.timing import _attention_backward, _attention_forward

    q, kv = (2, 8, 256, 64), (2, 8, 192, 64)
    assert _attention_forward(q, kv, kv) == sdpa_flop_count(q, kv, kv)
    assert _attention_backward(q, q, kv, kv, q, None) == sdpa_backward_flop_count(q, q, kv, kv)
    assert _attention_forward(q, kv, kv, is_causal=True) == sdpa_flop_count(q, kv, kv) // 2
    gqa = (2, 2, 192, 64)  # 2 kv heads for 8 query heads: the same work per query head
    assert _attention_forward(q, gqa, gqa) == sdpa_flop_count(q, kv, kv)
    assert _attention_backward(q, q, gqa, gqa, q, None) == sdpa_backward_flop_count(q, q, kv, kv)
