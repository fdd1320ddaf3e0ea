"""`upipe plan` and `upipe train` share their defaults; `--device cpu` plans this machine's
memory; the command printed trains what was planned; a stopped plan leaves its results."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from upipe.cli import build_parser, main
from upipe.cli.options import config_from_args
from upipe.cli.stops import Terminated
from upipe.planner import plan as planner
from upipe.planner.command import train_command
from upipe.planner.plan import PlanConfig, resolved
from upipe.train.config import TrainConfig, default_dtype, default_fsdp


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_plan_and_train_default_alike(device, monkeypatch):
    monkeypatch.setattr("upipe.train.fits.available_host_bytes", lambda: 64 * 2**30)
    pc = resolved(PlanConfig(device=device))
    train = TrainConfig(device=device)
    assert pc.fsdp == train.fsdp == default_fsdp(device) == (device == "cuda")
    assert pc.dtype == train.dtype == default_dtype(device)
    for name in ("document_mask", "batch_size", "master_dtype", "attention_kernel"):
        assert getattr(pc, name) == getattr(train, name), name
    (_, kw, _), *_ = planner.candidates(pc, planner.get_config(pc.model))
    assert kw["fsdp"] == train.fsdp and kw["document_mask"] == train.document_mask
    assert kw["dtype"] == train.dtype


def test_cpu_plans_this_machines_memory(monkeypatch):
    """--device cpu: the memory available now, shared by the ranks, 0.5 GiB each reserved;
    given values win; CUDA keeps 80 and 5."""
    monkeypatch.setattr("upipe.train.fits.available_host_bytes", lambda: 12 * 2**30)
    pc = resolved(PlanConfig(device="cpu", gpus=4))
    assert (pc.gpu_memory_gib, pc.reserve_gib) == (3.0, 0.5)
    assert resolved(dataclasses.replace(pc, gpu_memory_gib=2.0)).gpu_memory_gib == 2.0
    assert (resolved(PlanConfig()).gpu_memory_gib, resolved(PlanConfig()).reserve_gib) == (80, 5)
    monkeypatch.setattr("upipe.train.fits.available_host_bytes", lambda: 1 * 2**30)
    with pytest.raises(ValueError, match="--reserve-gib 0.5 leaves nothing .* fewer --gpus"):
        planner.checked(PlanConfig(device="cpu", gpus=4))


def test_cpu_command_trains_the_candidate():
    kw = dict(strategy="upipe", nproc=2, fsdp=False, dtype="float32", heads_per_stage=4,
              tiled_mlp=True, mlp_tile=256, document_mask=False)  # fmt: skip
    words = shlex.split(train_command(kw, 2, 4096, "cpu"))
    assert words[:4] == ["upipe", "train", "--nproc", "2"]
    ns = build_parser().parse_args(words[1:])
    assert config_from_args(TrainConfig, ns) == TrainConfig(**kw, seq_len=4096, device="cpu")


@pytest.mark.parametrize(
    "error,code,by", [(KeyboardInterrupt, 130, "Ctrl-C (SIGINT)"), (Terminated, 143, "SIGTERM")]
)
def test_a_stopped_plan_leaves_its_rows(monkeypatch, tmp_path, capsys, error, code, by):
    """Ctrl-C (SIGTERM) after one finished candidate: exit 130 (143), one line saying so,
    the finished candidate's line printed, the JSON holding it (finished: false); the JSON is
    rewritten as each candidate finishes."""
    written = []

    def search(pc, progress):
        res = {"config": {}, "budget_bytes": 1, "strategies": [
            {"strategy": "a", "problem": None}, {"strategy": "b", "problem": None}]}  # fmt: skip
        progress(None, res)
        res["strategies"][0].update(max_seq_len=65536)
        progress(res["strategies"][0], res)
        written.append(json.loads((tmp_path / "p.json").read_text()))
        raise error

    monkeypatch.setattr(planner, "plan", search)
    assert main(["plan", "--json", str(tmp_path / "p.json")]) == code
    out = json.loads((tmp_path / "p.json").read_text())
    assert written == [out] and out["finished"] is False
    assert (
        out["strategies"][0]["max_seq_len"] == 65536 and "max_seq_len" not in out["strategies"][1]
    )
    captured = capsys.readouterr()
    assert "a: 65,536 tokens" in captured.out and "Traceback" not in captured.err
    said = f"upipe plan: stopped by {by} after 1 candidate; partial results: {tmp_path}/p.json"
    assert said in captured.err.splitlines(), captured.err
