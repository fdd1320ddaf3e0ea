"""Issue 30's first hour, replayed at tiny sizes: each place a new user tripped over, run
through the command line as they ran it, showing what upipe does now.

- plan with `--device cpu`, then run the `upipe train` command it printed: the plan's
  defaults are train's (FSDP, document masking) and the run fits as planned;
- resume that run with a longer `--steps`: it goes on along the saved schedule and says so;
- `--resume` on an empty checkpoint folder: an error naming the folder, nonzero exit;
- `upipe train --model llama3-8b` on this CPU: refused before any rank starts, with the need
  and the memory available;
- the README's `--recommend` command, shrunk: it finishes and prints its table and pick;
- two torchrun "nodes" on this machine (c10d rendezvous on 127.0.0.1): one killed, the other
  ends with one line naming the lost node and rank; started with different `--seq-len`, both
  stop before the first step with an error naming the flag.

The commands run in this process through `upipe.cli.main` (its ranks spawned as a user's
are) where that saves an interpreter's start-up; the torchrun nodes are processes of their
own. The pieces are tested in depth elsewhere (tests/distributed/test_train_loop.py: the
schedule on resume; tests/distributed/test_fits.py: the estimate; tests/unit/test_plan_cli.py:
shared defaults; tests/runs/test_plan.py: plan vs real runs).
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
from commands import end_all, torchrun_nodes, wait_until
from train_workers import CORPUS

from upipe.cli import build_parser, main
from upipe.cli.options import config_from_args
from upipe.train.config import TrainConfig
from upipe.train.fits import GiB, available_host_bytes, state_bytes

DATA = ["--data", CORPUS, "--plot", ""]


def _run(capfd, *args) -> tuple[int, str, str]:
    """`upipe ARGS` in this process: exit status (argparse's errors included), stdout,
    stderr (its spawned ranks' output too)."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """`upipe plan --device cpu` for the tiny model on 2 ranks with a small memory budget
    (so that the longest sequence is short), with plan's defaults (on CPU: float32, no
    FSDP, train's): its JSON and the command it printed."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code = main(["plan", "--device", "cpu", "--model", "tiny", "--gpus", "2",
                 "--gpu-memory-gib", "0.02", "--reserve-gib", "0", "--granularity", "1024",
                 "--max-seq-len", "2048", "--strategies", "upipe", "--heads-per-stage", "2",
                 "--features", "off", "--json", str(path)])  # fmt: skip
    assert code == 0
    return json.loads(path.read_text())


def test_the_plans_command_trains_what_was_planned(planned, tmp_path, capfd):
    command = planned["command"]
    words = shlex.split(command)
    assert words[:2] == ["upipe", "train"], command
    cfg = config_from_args(TrainConfig, build_parser().parse_args(words[1:]))
    default = TrainConfig(device="cpu")
    assert (cfg.fsdp, cfg.document_mask, cfg.dtype) == (
        default.fsdp,
        default.document_mask,
        default.dtype,
    ), command
    (row,) = planned["strategies"]
    assert cfg.seq_len == row["max_seq_len"] > 0
    code, out, err = _run(capfd, *words[1:], "--steps", "2", *DATA,
                          "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
                          "--metrics-file", str(tmp_path / "m.jsonl"))  # fmt: skip
    assert code == 0, err[-3000:]
    assert f"strategy upipe, 2 CPU ranks (dp 1 x ring 1 x ulysses 2), {cfg.seq_len} tokens" in out
    rows = (tmp_path / "m.jsonl").read_text().splitlines()
    peaks = [json.loads(line)["peak_memory_bytes"] for line in rows]
    simulated = next(p["peak_bytes"] for p in row["points"] if p["seq_len"] == cfg.seq_len)
    assert abs(max(peaks) - simulated) <= 0.05 * simulated, (max(peaks), simulated)

    # resumed with a longer --steps: the saved schedule goes on, and the run says so
    code, out, err = _run(capfd, *words[1:], "--steps", "3", *DATA,
                          "--checkpoint-dir", str(tmp_path / "ck"), "--resume")  # fmt: skip
    assert code == 0, err[-3000:]
    said = out + err
    assert f"resuming from step 2 in {tmp_path / 'ck'}" in said, said[-3000:]
    assert "the checkpoint's learning-rate schedule goes on" in said
    assert "--reschedule replaces the schedule by this run's" in said
    assert "steps 3..3: loss" in out


def test_resume_on_an_empty_folder_is_an_error_naming_it(tmp_path, capfd):
    typo = tmp_path / "chekpoints"
    code, out, err = _run(capfd, "train", "--nproc", "2", "--seq-len", "128", *DATA,
                          "--checkpoint-dir", str(typo), "--resume")  # fmt: skip
    assert code != 0
    assert f"--resume: no checkpoint in {typo}" in err, err[-3000:]
    assert "--resume-if-present" in err and "loss=" not in err


def test_a_model_that_cannot_fit_is_refused_before_any_rank_starts(monkeypatch, capfd):
    import upipe.cli.train as cli_train

    cfg = TrainConfig(model="llama3-8b")
    need = cfg.nproc * state_bytes(cfg, cfg.nproc)
    if available_host_bytes() >= need:
        pytest.skip(f"this machine has the {need / GiB:.0f} GiB llama3-8b needs on 4 ranks")
    monkeypatch.setattr(cli_train, "LocalCluster", None)  # spawning would fail loudly
    code, out, err = _run(capfd, "train", "--model", "llama3-8b")
    assert code == 2 and "Traceback" not in err
    assert f"this job needs at least {need / GiB:.1f} GiB (4 rank(s) x " in err, err
    assert re.search(r"but this machine has [0-9.]+ GiB available: ", err), err
    assert "parameters), strategy" not in out  # no banner: nothing started


def test_the_readmes_recommend_command_finishes(tmp_path, capfd):
    """README: `upipe plan --model llama3-8b --gpus 8 --gpu-memory-gib 80 --seq-len 1048576
    --recommend --hardware h100`, with a tiny model, 2 GPUs of 1 GiB, 256 tokens and one
    candidate (the grid's full run: minutes per model, docs/plan.md)."""
    code, out, err = _run(capfd, "plan", "--model", "tiny", "--gpus", "2",
                          "--gpu-memory-gib", "1", "--reserve-gib", "0", "--seq-len", "256",
                          "--recommend", "--hardware", "h100", "--strategies", "ulysses",
                          "--features", "off", "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert code == 0, err[-3000:]
    assert "candidate" in out and "tokens/s" in out and "\npick: ulysses\n" in out, out
    assert "torchrun --nproc-per-node 2 -m upipe.train --device cuda --model tiny" in out
    assert json.loads((tmp_path / "r.json").read_text())["finished"] is True


def _nodes(tmp_path, *seq_lens: int, steps: int):
    return torchrun_nodes(
        [["--steps", str(steps), "--seq-len", str(S), *DATA, "--timeout", "120"] for S in seq_lens],
        cwd=tmp_path,
    )


def test_a_dead_node_is_one_line_naming_it(tmp_path):
    """Two torchrun "nodes" of one rank each: rank 0 prints the banner with the node
    placement; once a step is done the second node (its agent and rank; not the rendezvous
    host) is killed: the surviving rank ends with one line naming itself, the lost node and
    its rank, its traceback in upipe-train-rank<R>.log, no gloo traceback on screen."""
    nodes = _nodes(tmp_path, 128, 128, steps=2000)
    survivor, lost = nodes
    try:
        # rank 0 shows the progress bar: its first "loss=" says a step is done (at a load
        # average of 22, with another suite running, none came within 240 s: 2026-12-06)
        assert wait_until(lambda: any("loss=" in n.stderr for n in nodes), 540), [
            n.stderr[-2000:] for n in nodes
        ]
        lost.kill()
        assert survivor.wait(timeout=180) != 0
    finally:
        end_all(nodes)
    # rank 0's banner, with the node placement (once, before the first step)
    out = survivor.stdout + lost.stdout
    assert out.count("parameters), strategy upipe, 2 CPU ranks on 2 node(s) of 1") == 1, out
    assert "ranks is ACROSS a node" in out, out
    err = survivor.stderr
    line = next((ln for ln in err.splitlines() if "lost its peers" in ln), err[-3000:])
    said = re.search(r"rank (\d) \(node (\d),.* lost its peers: node (\d) \(.*rank (\d)\)", line)
    assert said and said[1] != said[4] and said[2] != said[3], line
    assert "Connection" not in err and "pair.cc" not in err, err[-3000:]  # no gloo traceback
    log = (tmp_path / f"upipe-train-rank{said[1]}.log").read_text()
    assert "Traceback" in log and "RuntimeError" in log


@pytest.mark.exhaustive  # (the default run: a dead node, above, is one line naming it)
def test_nodes_started_with_different_options_name_the_flag(tmp_path):
    """The same two nodes, one started with --seq-len 128 and the other with 256: both stop
    before the first step; the error names --seq-len and each rank's value (which node is
    rank 0 is the rendezvous' choice)."""
    nodes = _nodes(tmp_path, 128, 256, steps=2)
    try:
        codes = [n.wait(timeout=540) for n in nodes]  # (240 s ran out at load 20)
    finally:
        end_all(nodes)
    assert all(code != 0 for code in codes), codes
    err = "".join(n.stderr for n in nodes)
    said = re.search(
        r"the ranks were started with different options: --seq-len: (\d+) on rank 0; (\d+) "
        r"on rank 1 \(start every node with the same command\)",
        err,
    )
    assert said and {said[1], said[2]} == {"128", "256"}, err[-3000:]
    assert "loss=" not in err
