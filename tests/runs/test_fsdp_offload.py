"""FSDP2's CPUOffloadPolicy (`upipe train --fsdp --fsdp-offload`): training with the sharded
parameters, gradients and AdamW states in host memory computes exactly what training
without does -- on the CPU (gloo) the policy's copies are to the same device, so losses,
gradient norms, weights and optimizer states are bit for bit those without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fsdp_offload_workers import steps_and_state, train_rows
from train_workers import small_config


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: fp32 masters, mixed
def test_offload_computes_what_fsdp_computes(clusters, dtype):
    """3 steps of 2 micro-batches, clipped, step 2's gradient poisoned with a NaN and
    skipped (--skip-nonfinite-steps), then an evaluation: identical with and without
    --fsdp-offload, and the offloaded state is on the CPU and reported as host bytes."""
    cfg = small_config(
        strategy="upipe", fsdp=True, dtype=dtype, grad_accum=2, grad_clip=0.5,
        skip_nonfinite_steps=True, eval_every=3, eval_batches=1,
    )  # fmt: skip
    runs = {
        off: clusters(2).run(steps_and_state, dataclasses.replace(cfg, fsdp_offload=off), 1)[0]
        for off in (False, True)
    }
    rows, held_out, weights, states, where = runs[False]
    o_rows, o_held_out, o_weights, o_states, o_where = runs[True]
    assert [r["skipped"] is not None for r in rows] == [False, True, False]
    same = lambda rs: [repr([r[k] for k in ("loss", "grad_norm", "skipped")]) for r in rs]  # noqa: E731
    assert same(o_rows) == same(rows)  # (repr: the skipped step's norm is nan)
    assert o_held_out == held_out
    assert weights.keys() == o_weights.keys() and states.keys() == o_states.keys()
    assert all(torch.equal(weights[n], o_weights[n]) for n in weights)
    assert all(torch.equal(states[k], o_states[k]) for k in states)
    assert where == o_where == ["cpu"]
    assert all(r["host_state_bytes"] == 0 for r in rows)
    # host state: fp32 masters and gradients, from the first update on two AdamW moments:
    # 8, then 16 bytes per parameter over 2 ranks (+ FSDP's padding of uneven shards, and
    # the step counters)
    n = sum(w.numel() for w in weights.values())
    per_param = [2 * r["host_state_bytes"] / n for r in o_rows]
    assert 8 <= per_param[0] < 8.01 and all(16 <= b < 16.01 for b in per_param[1:]), per_param


@pytest.mark.slow
def test_offload_checkpoint_resume_and_hf_save(clusters, tmp_path):
    """`upipe.train.train` with --fsdp-offload and mixed precision: held-out losses and a
    Hugging Face save as without offload (the same bytes); a run killed after step 2 and
    resumed from its offloaded checkpoint continues the same curve, bit for bit."""
    from safetensors.torch import load_file

    cfg = small_config(
        strategy="upipe", steps=4, fsdp=True, dtype="bfloat16", eval_every=2, eval_batches=1
    )
    plain = clusters(2).run(train_rows, dataclasses.replace(cfg, save_hf=str(tmp_path / "a")))[0]
    ckpt = dataclasses.replace(
        cfg, fsdp_offload=True, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2
    )
    offload = clusters(2).run(train_rows, dataclasses.replace(ckpt, save_hf=str(tmp_path / "b")))
    (tmp_path / "ckpt" / "step_00000004").rename(tmp_path / "ckpt" / ".killed")
    resumed = clusters(2).run(
        train_rows, dataclasses.replace(ckpt, resume=True, save_hf=str(tmp_path / "c"))
    )[0]
    keys = ("step", "loss", "grad_norm", "eval_loss")
    rows = lambda history: [tuple(r.get(k) for k in keys) for r in history]  # noqa: E731
    assert rows(offload[0]) == rows(plain)
    assert rows(resumed) == rows(plain)[2:]
    assert all(r["host_state_bytes"] > 0 for r in offload[0] + resumed)
    saved = [load_file(tmp_path / d / "model.safetensors") for d in "abc"]
    # the fp32 masters, also after the final evaluation (which leaves FSDP's root unit with
    # its bf16 gathered parameters unless resharded)
    assert {t.dtype for s in saved for t in s.values()} == {torch.float32}
    assert all(torch.equal(saved[0][k], s[k]) for s in saved[1:] for k in saved[0])


def test_offload_needs_fsdp():
    from upipe.train.config import validate

    problem = validate(small_config(fsdp_offload=True), 2)
    assert problem is not None and "add --fsdp" in problem


@pytest.mark.slow
def test_planner_counts_the_offloaded_state_as_host_memory():
    """`StepSimulator` (CUDA memory) of FSDP2 with fp32 masters and bf16 compute on 2 ranks,
    with and without --fsdp-offload. Let n be rank 0's shard of the parameters (FSDP pads
    uneven shards to the first rank's size) and t the number of parameter tensors:
    - the masters and AdamW's two moments, 12 n bytes, and AdamW's 4-byte step counters, 4 t,
      leave the device between steps and are host memory;
    - the device peak (the backward's first op: no gradient yet, no shard being copied
      in) drops by exactly that;
    - the optimizer phase allocates nothing on the device, and all it held without offload
      -- the same 12 n + 4 t, the 4 n bytes of gradients and AdamW's temporaries -- is the
      host peak with offload."""
    from upipe.model import CausalLM, get_config
    from upipe.planner.step import StepSimulator

    with torch.device("meta"):
        shapes = [p.shape for p in CausalLM(get_config("tiny")).parameters()]
    n = sum(-(-s[0] // 2) * s[1:].numel() for s in shapes)
    state = 12 * n + 4 * len(shapes)
    cfg = small_config(strategy="upipe", nproc=2, fsdp=True, dtype="bfloat16")
    steps = {}
    for offload in (False, True):
        with StepSimulator(dataclasses.replace(cfg, fsdp_offload=offload), 2) as sim:
            steps[offload] = [sim.step(S) for S in (512, 2048)]
    for off, on in zip(steps[False], steps[True], strict=True):
        assert off.host_peak_bytes == 0
        assert off.persistent_bytes - on.persistent_bytes == state
        assert off.peak_bytes - on.peak_bytes == state
        assert on.phase_bytes["optimizer"] == on.persistent_bytes
        assert on.host_peak_bytes == off.phase_bytes["optimizer"] - on.persistent_bytes
        assert on.host_peak_bytes >= state + 4 * n


@pytest.mark.slow
def test_simulated_offload_step_equals_a_real_one_on_cpu(clusters):
    """On the CPU the offloaded state is in the same memory as everything else (the device
    is the host): the simulator with CPU kernels and a real 2-rank step with --fsdp-offload
    count the same bytes, within 2% (`plan_workers.assert_simulated_peak_equals_real`)."""
    from plan_workers import assert_simulated_peak_equals_real

    cfg = small_config(
        strategy="upipe", nproc=2, fsdp=True, fsdp_offload=True, dtype="bfloat16",
        activation_checkpoint=True,
    )  # fmt: skip
    assert_simulated_peak_equals_real(clusters, cfg)


def test_plan_feature_token():
    """`upipe plan --features on+fsdp-offload`: the four memory features and the offload of
    FSDP's state; without --fsdp the candidate is refused with the fix."""
    from upipe.model import get_config
    from upipe.planner.plan import PlanConfig, candidates, feature_set

    kw = feature_set("on+fsdp-offload")
    assert kw["fsdp_offload"] and kw["offload"] and kw["activation_checkpoint"]
    assert "fsdp_offload" not in feature_set("on")
    pc = PlanConfig(model="tiny", gpus=2, strategies=("ulysses",), features=("on+fsdp-offload",))
    ((label, _, problem),) = candidates(pc, get_config("tiny"))
    assert label == "ulysses +on+fsdp-offload" and problem is None
    ((_, _, problem),) = candidates(dataclasses.replace(pc, fsdp=False), get_config("tiny"))
    assert "add --fsdp" in problem
