"""transformers' Trainer and TRL's SFTTrainer training a context-parallel model
(`examples/trainer_hf.py`, launched by torchrun or `accelerate launch`): every step's loss,
the held-out loss and the saved checkpoint equal those of the unmodified model trained by
transformers' Trainer on one process -- with upipe's memory features too, whose checkpoints
resume to the uninterrupted run's losses; and the trainer mixin's errors."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerances import TOL, grad_errors

pytest.importorskip("trl")
pytest.importorskip("accelerate")  # (the `integrations` extra; accelerate launch)

import trainer_workers as W  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trainer_hf.py"
COUNTING = ROOT / "tests" / "helpers" / "trainer_run.py"  # the example, counting attention calls
ACCELERATE_CONFIG = ROOT / "examples" / "accelerate_fsdp2.yaml"
TOL32 = TOL[torch.float32]
STEPS = 4
# upipe's memory features at tiles below the tokens per rank (2 ranks: about 128 per padded
# row, 250 per packed one); transformers' checkpointing on as well (upipe takes it over); the
# reference's 4 documents per step in 2 micro-batches (the mixin averages DDP's gradients at
# the second)
FEATURES = ("--memory-features", "--mlp-tile", "24", "--loss-chunk", "40")
FEATURES += ("--activation-checkpointing", "--save-steps", "2", "--batch", "2", "--grad-accum", "2")


def _example():
    spec = importlib.util.spec_from_file_location("trainer_hf_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The example's small Llama and byte tokenizer, saved as a local Hugging Face model."""
    example, path = _example(), tmp_path_factory.mktemp("model")
    example.small_model().save_pretrained(path)
    example.byte_tokenizer().save_pretrained(path)
    return path


def _launch(cmd, timeout_s):
    """Run `cmd` in a session of its own; past `timeout_s` the whole session (launcher and
    ranks) is killed, so no rank outlives the test."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[:6]}... ran past {timeout_s} s\n{out[-2000:]}{err[-4000:]}")
    return proc.returncode, out, err


def _train(model_dir, out: Path, *args, nproc=None, launcher="torchrun", script=EXAMPLE):
    """Run the example (on `nproc` ranks, under torchrun or accelerate launch with its FSDP2
    config): {trainer: (run, the model of its checkpoint at step STEPS)}."""
    cmd = [sys.executable]
    if launcher == "torchrun" and nproc:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    elif nproc:
        cmd += ["-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG)]
        cmd += ["--num_processes", str(nproc), "--main_process_port", "0"]
    cmd += [str(script), "--model-dir", str(model_dir), "--output-dir", str(out)]
    cmd += ["--losses", str(out / "losses.json"), "--steps", str(STEPS)]
    cmd += ["--optim", "sgd", "--lr", "0.1", "--timeout", "120", *args]
    rc, stdout, stderr = _launch(cmd, 600)
    if rc and "terminate called without an active exception" in stderr:
        # known, unexplained: under load a rank sometimes aborts in C++ at interpreter exit,
        # after its work is done (about 1 run in 6-10, 2026-11-30/12-01): run once more
        rc, stdout, stderr = _launch(cmd, 600)
    assert rc == 0, stdout[-3000:] + stderr[-6000:]
    from transformers import AutoModelForCausalLM

    runs = json.loads((out / "losses.json").read_text())
    return {
        name: (run, AutoModelForCausalLM.from_pretrained(out / name / f"checkpoint-{STEPS}"))
        for name, run in runs.items()
    }


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The unmodified model under transformers' Trainer on one process."""
    return _train(model_dir, tmp_path_factory.mktemp("ref"), "--no-context-parallel")["trainer"]


@pytest.fixture(scope="module")
def with_features(model_dir, tmp_path_factory):
    """accelerate launch (the FSDP2 config; DDP on the CPU), 2 ranks, UPipe with every memory
    feature and transformers' checkpointing, 2 micro-batches per step: the Trainer (packed
    rows), then the SFTTrainer (padded rows); checkpoints at steps 2 and 4. Returns (runs,
    output dir, attention calls per layer and micro-batch)."""
    out = tmp_path_factory.mktemp("features")
    calls = out / "calls.json"
    runs = _train(
        model_dir, out, *FEATURES, "--trainer", "trainer", "sft", "--calls", str(calls),
        nproc=2, launcher="accelerate", script=COUNTING,
    )  # fmt: skip
    return runs, out, json.loads(calls.read_text())


def _check_against(reference, runs):
    """Every step's loss, the held-out loss and the checkpoint's weights vs the reference's."""
    ref, ref_model = reference
    ref_state = ref_model.state_dict()
    for name, (got, model) in runs.items():
        assert len(got["losses"]) == len(ref["losses"]) == STEPS
        for step, loss in ref["losses"].items():
            assert abs(got["losses"][step] - loss) / loss < TOL32["fwd"], (name, got, ref)
        assert abs(got["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"] < TOL32["fwd"], name
        # the checkpoint the Trainer saved loads into the unmodified model: the same weights
        state = model.state_dict()
        assert state.keys() == ref_state.keys()
        errors = grad_errors(state, ref_state)  # (weights: the same judgement)
        assert max(errors.values()) < TOL32["bwd"], (name, errors)


@pytest.mark.slow
@pytest.mark.exhaustive  # (the default run: the same check with the memory features, below)
def test_losses_and_checkpoints_match_the_unmodified_model(model_dir, reference, tmp_path):
    """Under torchrun, 2 ranks, UPipe, no memory features (the model returns the logits, its
    loss function is upipe's): the Trainer with the documents of a batch packed into one row
    (DataCollatorWithFlattening: the position ids restart per document). SGD, so that the
    weights differ by the gradients' rounding only (AdamW divides by sqrt(v) and lifts it
    where v is tiny)."""
    runs = _train(model_dir, tmp_path, "--trainer", "trainer", nproc=2)
    assert list(runs) == ["trainer"]
    _check_against(reference, runs)


@pytest.mark.slow
def test_memory_features_match_the_unmodified_model(reference, with_features):
    """The same with upipe's tiled MLP, chunked loss and checkpointing, 2 ranks, under
    accelerate launch, each step in 2 micro-batches (DDP's gradients averaged by the mixin at
    the second): the Trainer (packed rows; upipe's chunked loss), then the SFTTrainer
    with padded rows (TRL's collator) and TRL's own loss (its fused LM head on upipe's
    decoder stack) -- the same documents, the same mean over their tokens. With transformers'
    checkpointing also on, each layer is recomputed once (by upipe)."""
    runs, _, calls = with_features
    assert list(runs) == ["trainer", "sft"]
    _check_against(reference, runs)
    assert calls == {"trainer": [2, 2], "sft": [2, 2]}  # forward + one recompute


@pytest.mark.slow
@pytest.mark.exhaustive  # (the default run: upipe's own trainer resumes, tests/runs/test_train.py)
def test_checkpoint_with_memory_features_resumes(model_dir, with_features, tmp_path):
    """torchrun, 2 ranks, the Trainer with the features resumed from the step-2 checkpoint of
    the uninterrupted run: steps 3 and 4 give its losses, and the same weights at step 4."""
    runs, out, _ = with_features
    (full, full_model) = runs["trainer"]
    resume = ("--resume-from-checkpoint", str(out / "trainer" / "checkpoint-2"))
    resumed = _train(model_dir, tmp_path, *FEATURES, *resume, nproc=2)
    got, model = resumed["trainer"]
    for step in ("3", "4"):
        assert (
            abs(got["losses"][step] - full["losses"][step]) <= TOL32["fwd"] * full["losses"][step]
        )
    assert abs(got["eval_loss"] - full["eval_loss"]) <= TOL32["fwd"] * full["eval_loss"]
    full_state = full_model.state_dict()
    errors = grad_errors(model.state_dict(), full_state)
    assert max(errors.values()) < TOL32["bwd"], errors


MIXIN_ERRORS = {
    "converted_and_options": "context_parallel= was given for a model that "
    "apply_context_parallel has converted already: drop context_parallel=",
    "unknown_key": "context_parallel has unknown keys ['tiled_mpl']: it takes "
    "apply_context_parallel's keywords ['strategy', 'heads_per_stage',",
    "group_in_options": "unknown keys ['group']",
    "options_for_a_name": "pass model= a loaded model (from_pretrained), not str",
    "not_converted": "the model is not context-parallel: pass "
    "context_parallel=dict(strategy='upipe', ...)",
}


def test_mixin_errors_raise_on_every_rank(clusters):
    for rank, found in enumerate(clusters(2).run(W.mixin_errors, tuple(MIXIN_ERRORS))):
        for case, expected in MIXIN_ERRORS.items():
            assert found[case] is not None, f"rank {rank}: {case} did not raise"
            assert expected in found[case], (rank, case, found[case])


@pytest.mark.parametrize(
    "kwargs,options,raises",
    [
        ({"every_n_layers": 2}, W.FEATURES, True),
        ({"offload": True}, dict(activation_checkpoint=True), True),
        ({"use_reentrant": False}, W.FEATURES, False),  # (torch's checkpoint's: unused)
        ({"every_n_layers": 2}, dict(chunked_loss=True), False),  # transformers' layers
    ],
)
def test_transformers_checkpointing_kwargs_that_upipe_would_ignore(
    clusters, kwargs, options, raises
):
    for problem in clusters(2).run(W.checkpointing_kwargs_error, kwargs, options):
        if raises:
            assert "every_n_layers / offload would be ignored" in problem, problem
        else:
            assert problem is None
