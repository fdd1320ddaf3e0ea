"""The planner counts what mixed precision allocates: fp32 masters, gradients and AdamW
states, and the bf16 copies (FSDP2's unsharded parameters, or the compute model)."""

from __future__ import annotations

import dataclasses

import pytest
from plan_workers import assert_simulated_peak_equals_real
from train_workers import small_config

from upipe.model import get_config
from upipe.planner.plan import PlanConfig, candidates, plan
from upipe.planner.step import StepSimulator


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,kw",
    [
        ("upipe", {"fsdp": True}),  # MixedPrecisionPolicy(bf16, reduce fp32)
        ("ulysses", {}),  # MasterWeights: bf16 model + fp32 masters
    ],
)
def test_simulated_mixed_precision_equals_real_run(clusters, strategy, kw):
    """bf16 compute, fp32 masters: 2 gloo ranks for real vs simulated (CPU kernels), the
    simulated peak within 2% of the larger rank's (the bound of tests/runs/test_plan.py)."""
    cfg = small_config(strategy=strategy, nproc=2, dtype="bfloat16", **kw)
    assert_simulated_peak_equals_real(clusters, cfg)


@pytest.mark.slow
def test_fp32_masters_double_the_persistent_state():
    """Sharded over 4 ranks: fp32 masters + AdamW states are 12 bytes per parameter against
    6 in all-bf16 (AdamW's step counters aside); in the optimizer phase, when every
    gradient exists, the fp32 gradients add their 2 extra bytes."""
    base = small_config(strategy="upipe", nproc=4, fsdp=True, dtype="bfloat16")
    mem = {}
    for master in ("float32", "bfloat16"):
        with StepSimulator(dataclasses.replace(base, master_dtype=master), 4) as sim:
            mem[master] = sim.step(1024)
    local = get_config("tiny").num_params() / 4
    extra = mem["float32"].persistent_bytes - mem["bfloat16"].persistent_bytes
    assert 6 * local <= extra < 6 * local * 1.01
    optim = {k: m.phase_bytes["optimizer"] for k, m in mem.items()}
    assert optim["float32"] - optim["bfloat16"] >= extra + 2 * local


def test_plan_master_dtype_option():
    pc = PlanConfig(model="tiny", gpus=2, strategies=("ulysses",), features=("off",))
    (_, kw, problem), *_ = candidates(pc, get_config("tiny"))
    assert kw["master_dtype"] == "float32" and kw["dtype"] == "bfloat16" and problem is None
    with pytest.raises(ValueError, match="--master-dtype bfloat16 is less precise"):
        plan(dataclasses.replace(pc, dtype="float32", master_dtype="bfloat16"))
