"""transformers' Trainer and TRL's SFTTrainer training a model converted by
apply_context_parallel, launched by torchrun (`examples/trainer_hf.py`): every step's loss,
the held-out loss and the saved checkpoint equal those of the unmodified model trained by
transformers' Trainer on one process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TOL, rel_err

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trainer_hf.py"
TOL32 = TOL[torch.float32]
STEPS = 3


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


def _train(model_dir, out: Path, *args, nproc=None):
    """Run the example (under torchrun with `nproc` ranks): {trainer: (losses, checkpoint)}."""
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone"]
    launcher += [] if nproc is None else [f"--nproc-per-node={nproc}"]
    cmd = [sys.executable, *launcher, str(EXAMPLE), "--model-dir", str(model_dir)]
    cmd += ["--output-dir", str(out), "--losses", str(out / "losses.json")]
    cmd += ["--steps", str(STEPS), "--optim", "sgd", "--lr", "0.1", "--timeout", "120", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode and "terminate called without an active exception" in res.stderr:
        # known, unexplained: under load a rank sometimes aborts in C++ at interpreter exit,
        # after its work is done (about 1 run in 6-10, 2026-11-30/12-01): run once more
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    from transformers import AutoModelForCausalLM

    runs = json.loads((out / "losses.json").read_text())
    return {
        name: (run, AutoModelForCausalLM.from_pretrained(out / name / f"checkpoint-{STEPS}"))
        for name, run in runs.items()
    }


def test_losses_and_checkpoints_match_the_unmodified_model(model_dir, tmp_path_factory):
    """The reference: the unmodified model under the Trainer on one process. Under
    torchrun, 2 ranks, UPipe: the Trainer with the documents of a batch packed into one row
    (DataCollatorWithFlattening: the position ids restart per document), then the
    SFTTrainer with padded rows (TRL's collator) and TRL's own loss -- the same documents,
    the same mean over their tokens. SGD, so that the weights differ by the gradients'
    rounding only (AdamW divides by sqrt(v) and lifts it where v is tiny)."""
    reference = _train(model_dir, tmp_path_factory.mktemp("ref"), "--no-context-parallel")
    ref, ref_model = reference["trainer"]
    ref_state = ref_model.state_dict()
    runs = _train(model_dir, tmp_path_factory.mktemp("cp"), "--trainer", "trainer", "sft", nproc=2)
    assert list(runs) == ["trainer", "sft"]
    for name, (got, model) in runs.items():
        assert len(got["losses"]) == len(ref["losses"]) == STEPS
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert abs(a - b) / b < TOL32["fwd"], (name, got, ref)
        assert abs(got["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"] < TOL32["fwd"], name
        # the checkpoint the Trainer saved loads into the unmodified model: the same weights
        state = model.state_dict()
        assert state.keys() == ref_state.keys()
        errors = {n: rel_err(state[n], ref_state[n]) for n in ref_state}
        assert max(errors.values()) < TOL32["bwd"], (name, errors)
