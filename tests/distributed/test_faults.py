"""Faults and bad data (issue 16): each ends with a clear one-line message and a non-zero
exit, or a documented recovery (a resume from the newest intact checkpoint, bad records
skipped when asked), never with wrong results and exit 0."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fault_workers import (
    groups_and_threads,
    intact,
    make_groups,
    nan_gradient,
    pid,
    signal_one_rank,
    train_quietly,
    train_with_file_size_limit,
    train_with_nan_gradient,
    unpicklable_on,
    use_groups,
)
from train_workers import small_config

from upipe.cli import main
from upipe.launch import DistributedError, LocalCluster, RankFailure
from upipe.train.checkpointing import verify_checkpoint
from upipe.train.data import PackedTokens, check_corpus
from upipe.train.loop import summary
from upipe.train.outputs import check_outputs, read_metrics

STEP2, STEP4 = "step_00000002", "step_00000004"


def _one_line(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message, message
    return message


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def run(clusters, tmp_path_factory):
    """A 4-step run on 2 ranks, checkpoints after steps 2 and 4, a metrics file: its
    directory, config and losses."""
    pytest.importorskip("tensorboard")  # (the `train` extra: the run writes its events)
    root = tmp_path_factory.mktemp("run")
    cfg = small_config(
        strategy="upipe", steps=4, checkpoint_dir=str(root / "ckpt"), checkpoint_every=2,
        metrics_file=str(root / "m.jsonl"), tensorboard=str(root / "tb"),
    )  # fmt: skip
    losses, _ = clusters(2).run(train_quietly, cfg)[0]
    return root, cfg, losses


def _copy(run, tmp_path):
    """A copy of the run's directory, and its config pointing there."""
    root, cfg, _ = run
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    cfg = dataclasses.replace(
        cfg,
        checkpoint_dir=str(tmp_path / "ckpt"),
        metrics_file=str(tmp_path / "m.jsonl"),
        tensorboard=str(tmp_path / "tb"),
    )
    return tmp_path / "ckpt", cfg


def _largest(ckpt: Path) -> Path:
    return max(ckpt.glob("__*.distcp"), key=lambda p: p.stat().st_size)


def _scribble(path: Path) -> None:
    """4 KiB of random bytes in the middle of the file (its size unchanged)."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(4096))


DAMAGE = {
    "corrupt": (_scribble, "is corrupt (its SHA-256 differs from checksums.json)"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size // 3), "were written (truncated?)"),
    "deleted": (os.remove, "is missing"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_data_file_is_named(run, tmp_path, damage):
    ckpt, _ = _copy(run, tmp_path)
    step4 = ckpt / STEP4
    assert verify_checkpoint(step4) is None
    fn, message = DAMAGE[damage]
    target = _largest(step4)
    fn(target)
    assert f"{target.name} " in verify_checkpoint(step4) and message in verify_checkpoint(step4)


@pytest.mark.slow
def test_missing_metadata_or_checksums_is_named(run, tmp_path):
    ckpt, _ = _copy(run, tmp_path)
    os.remove(ckpt / STEP4 / ".metadata")
    assert verify_checkpoint(ckpt / STEP4) == ".metadata is missing"
    os.remove(ckpt / STEP2 / "checksums.json")
    assert verify_checkpoint(ckpt / STEP2).startswith("no checksums.json")


@pytest.mark.slow
def test_resume_falls_back_to_the_newest_intact_checkpoint(clusters, run, tmp_path):
    """The newest checkpoint corrupt (4 KiB of random bytes in a data file), the metrics
    file's last line torn, a save killed before it was published: the resumed run warns,
    starts from step 2, reproduces steps 3 and 4 bit for bit, lists each step once in the
    metrics file, and the next save replaces the damaged checkpoint and the partial one."""
    _, _, straight = run
    ckpt, cfg = _copy(run, tmp_path)
    bad = _largest(ckpt / STEP4)
    _scribble(bad)
    with open(cfg.metrics_file, "a") as f:
        f.write('{"step": 5, "lo')  # killed while writing step 5's line
    (ckpt / ".step_00000006.partial").mkdir()
    ranks = clusters(2).run(intact, str(ckpt))
    assert ranks[0] == ranks[1] == (str(ckpt / STEP2), [f"{ckpt / STEP4}: {bad.name} is corrupt "
                                    "(its SHA-256 differs from checksums.json)"])  # fmt: skip
    losses, err = clusters(2).run(train_quietly, dataclasses.replace(cfg, resume=True))[0]
    assert losses == straight  # steps 1-2 read back from the metrics file, 3-4 trained again
    assert f"warning: skipped damaged checkpoint {ckpt / STEP4}: {bad.name} is corrupt" in err
    assert f"warning: metrics file {cfg.metrics_file}:5: dropped a torn last line" in err
    rows, torn = read_metrics(cfg.metrics_file)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and torn is None
    assert [r["loss"] for r in rows] == straight
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(cfg.tensorboard)
    events.Reload()  # the first run's steps 3-4 purged (purge_step), the resumed run's kept
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert verify_checkpoint(ckpt / STEP4) is None  # saved again after step 4
    assert sorted(p.name for p in ckpt.iterdir()) == [STEP2, STEP4]


@pytest.mark.slow
def test_no_intact_checkpoint_is_one_error_on_every_rank(clusters, run, tmp_path):
    ckpt, cfg = _copy(run, tmp_path)
    os.remove(ckpt / STEP4 / ".metadata")
    os.truncate(_largest(ckpt / STEP2), 100)
    errors = clusters(2).run(train_quietly, dataclasses.replace(cfg, resume=True))
    assert errors[0] == errors[1]  # the same verdict on every rank: none waits for another
    assert _one_line(errors[0]).startswith(
        f"CheckpointError: no intact checkpoint to resume from in {ckpt}: "
        f"{ckpt / STEP4}: .metadata is missing; {ckpt / STEP2}: __"
    )


@pytest.mark.slow
def test_a_failed_save_publishes_nothing_and_says_so(clusters, tmp_path):
    """A write that fails on one rank (a file-size limit, as a full disk): every rank
    raises the same one-line CheckpointError, and no checkpoint directory is published."""
    cfg = small_config(strategy="upipe", steps=1, checkpoint_dir=str(tmp_path / "ckpt"))
    errors = clusters(2).run(train_with_file_size_limit, cfg, 100_000)
    assert errors[0] == errors[1]
    assert _one_line(errors[0]).startswith(
        f"CheckpointError: checkpoint {tmp_path / 'ckpt' / 'step_00000001'} not written (rank 1: "
    )
    assert "); nothing was published, older checkpoints are intact; " in errors[0]
    assert errors[0].endswith(" MiB free there")
    assert not list((tmp_path / "ckpt").glob("step_*"))


# --------------------------------------------------------------------------- non-finite


@pytest.mark.slow
def test_nonfinite_gradient_stops_the_run_naming_the_step(clusters):
    cfg = small_config(strategy="upipe", steps=3)
    message = clusters(2).run(nan_gradient, cfg, 1)[0]
    said = re.match(  # the loss finite (whatever the data makes it): the NaN is in the gradient
        r"NonFiniteError: step 2: the loss is ([0-9.]+), the gradient norm nan; stopped before "
        r"the update",
        _one_line(message),
    )
    assert said and 0 < float(said[1]) < 10, message


@pytest.mark.slow
def test_skip_nonfinite_steps_leaves_weights_and_optimizer_as_they_were(clusters):
    """--skip-nonfinite-steps: the step with a NaN gradient changes neither the weights nor
    the AdamW states (bit for bit), the learning rate moves on as in a run without the
    fault, and the next step trains."""
    cfg = small_config(
        strategy="upipe", steps=3, skip_nonfinite_steps=True, warmup_steps=2, grad_clip=0.0
    )  # no clipping: the norm from get_total_norm
    res = clusters(2).run(nan_gradient, cfg, 1)[0]
    assert res["skipped"][0] is None and res["skipped"][2] is None
    said = re.fullmatch(r"the loss is ([0-9.]+), the gradient norm nan", res["skipped"][1])
    assert said and 0 < float(said[1]) < 10, res["skipped"][1]
    assert res["unchanged"] is True
    assert res["lrs"] == pytest.approx([cfg.lr / 3, 2 * cfg.lr / 3, cfg.lr])
    assert 0 < res["last_loss"] < 6


@pytest.mark.slow
def test_skipped_steps_are_null_in_the_metrics_and_counted(clusters, tmp_path):
    metrics = tmp_path / "m.jsonl"
    cfg = small_config(
        strategy="upipe", steps=3, skip_nonfinite_steps=True, metrics_file=str(metrics)
    )
    rows = clusters(2).run(train_with_nan_gradient, cfg, 1)[0]
    written = [
        json.loads(line, parse_constant=_refuse) for line in metrics.read_text().splitlines()
    ]
    assert written == rows and [r["loss"] is None for r in rows] == [False, True, False]
    assert rows[1]["grad_norm"] is None and rows[1]["skipped"].endswith("gradient norm nan")
    assert summary(rows).endswith(
        "; skipped 1 step(s) with a non-finite loss or gradient norm: [2]"
    )


@pytest.mark.slow
def test_nonfinite_loss_on_the_command_line(tmp_path, capsys):
    """A learning rate of 1e30 makes step 2's loss or gradient norm NaN (which one depends
    on the batch: the corpus is the package's own sources, which change with every commit):
    `upipe train` (spawning 2 ranks) exits with status 1 and one line naming the step, and
    the metrics file holds step 1 only, in strict JSON."""
    metrics = tmp_path / "m.jsonl"
    status = main([
        "train", "--nproc", "2", "--seq-len", "128", "--steps", "3", "--lr", "1e30",
        "--data", small_config().data, "--metrics-file", str(metrics), "--plot", "",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 1 and err.endswith("\n") and "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("upipe train: ranks 0, 1 raised NonFiniteError: step 2: the loss is ")
    assert last.split(";")[0].endswith(" nan"), last  # the loss, or the gradient norm after it
    rows = [json.loads(line, parse_constant=_refuse) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


def _refuse(constant):
    raise AssertionError(f"{constant} in the metrics file")


def _usage_error(capsys, *args) -> str:
    """The one line `upipe train ARGS` ends with when an option is refused (status 2)."""
    with pytest.raises(SystemExit) as e:
        main(["train", *args])
    assert e.value.code == 2
    return _one_line(capsys.readouterr().err.strip().splitlines()[-1])


# --------------------------------------------------------------------------- data


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("a.jsonl", b'{"text": "ok"}\n{"text": 5}\n', 'a.jsonl:2: "text" is int 5, not a string'),
        ("a.jsonl", b'{"text": "caf\xe9"}\n', "a.jsonl:1: not UTF-8 text (byte 0xe9 at column 14)"),
        ("a.jsonl", b'{"text": "ok"}\n{"text": "cut\n',
         "a.jsonl:2: not JSON (Unterminated string starting at: column 10)"),
        ("a.jsonl", b'["text"]\n',
         'a.jsonl:1: expected a JSON object with a "text" string, got list'),
        ("a.jsonl", b"", "a.jsonl: no JSON line (empty file)"),
        ("empty.txt", b"", "empty.txt: empty file"),
        ("python", Path(sys.executable).read_bytes()[:4096],
         "python: binary, not text (a NUL byte at offset"),
        ("latin1.txt", "caf\xe9".encode("latin-1"),
         "latin1.txt: not UTF-8 text (byte 0xe9 at line 1, column 4)"),
    ],
    ids=["text-not-a-string", "jsonl-not-utf8", "malformed-line", "not-an-object", "empty-jsonl",
         "empty", "binary", "text-not-utf8"],
)  # fmt: skip
def test_bad_data_is_named_before_training(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as e:
        check_corpus(str(tmp_path / name))
    assert f"{tmp_path}/{message}" in _one_line(str(e.value))
    assert "pass --skip-bad-records" in str(e.value)


def test_a_bad_line_in_one_file_of_a_folder_stops_before_step_one(tmp_path):
    """Checked up front, not when the stream reaches it (the issue's run died at step 13)."""
    _jsonl(tmp_path / "a.jsonl", *[json.dumps({"text": f"doc {i}"}) for i in range(50)])
    _jsonl(tmp_path / "b.jsonl", '{"text": "fine"}', "{oops", '{"text": "also fine"}')
    with pytest.raises(ValueError, match=r"b\.jsonl:2: not JSON"):
        check_corpus(str(tmp_path))


def test_skip_bad_records_counts_them_and_the_stream_leaves_them_out(tmp_path):
    _jsonl(tmp_path / "a.jsonl", '{"text": "one"}', '{"text": null}', "nope", '{"text": "two"}')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "ok.txt").write_text("three")
    report = check_corpus(str(tmp_path), skip_bad=True)
    assert (report.sources, report.documents, len(report.skipped)) == (3, 3, 3)
    assert report.skipped[0].endswith('a.jsonl:2: "text" is NoneType None, not a string')
    stream = PackedTokens(str(tmp_path), skip_bad_records=True)
    text = "".join(chr(t) if t < 256 else "|" for t in stream.tokens(0, 14).tolist())
    assert sorted(text.split("|")) == ["", "one", "three", "two"]  # one pass: EOS after each
    with pytest.raises(ValueError, match=r"a\.jsonl:2"):  # without the option
        PackedTokens(str(tmp_path)).tokens(0, 17)


def test_saved_dataset_rows_without_text(tmp_path):
    datasets = pytest.importorskip("datasets")

    datasets.Dataset.from_dict({"text": ["ab", None, "cd"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=rf"--data: {tmp_path / 'ds'}: a row with no text"):
        check_corpus(str(tmp_path / "ds"))
    report = check_corpus(str(tmp_path / "ds"), skip_bad=True)
    assert (report.documents, len(report.skipped)) == (2, 1)
    text = "".join(
        chr(t) if t < 256 else "|"
        for t in PackedTokens(str(tmp_path / "ds"), skip_bad_records=True).tokens(0, 6).tolist()
    )
    assert sorted(text.split("|")) == ["", "ab", "cd"]


def test_only_bad_data_is_an_error_even_when_skipping(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"holds no document \(1 bad records left out"):
        check_corpus(str(tmp_path), skip_bad=True)


# --------------------------------------------------------------------------- outputs


@pytest.mark.parametrize(
    "option", ["metrics_file", "plot", "checkpoint_dir", "tensorboard", "save_hf"]
)
def test_unwritable_output_paths_are_found_at_start(tmp_path, option):
    """A path under a regular file can be written by nobody (root included)."""
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "out")
    problem = check_outputs(small_config(**{option: bad}))
    flag = "--" + option.replace("_", "-")
    assert _one_line(problem) == (
        f"{flag} {bad}: {tmp_path / 'file'} is a file, not a directory; choose a writable path"
    )
    good = str(tmp_path / "new" / "out")  # created
    assert check_outputs(small_config(**{option: good})) is None


def test_bad_data_and_paths_on_the_command_line(tmp_path, capsys):
    """Refused before any rank starts: one line, exit status 2."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert _usage_error(capsys, "--data", str(empty)) == (
        f"upipe train: error: --data: {empty}: empty file; fix or remove it, "
        "or pass --skip-bad-records to leave bad records out"
    )
    assert _usage_error(capsys, "--plot", str(empty / "loss.png")) == (
        f"upipe train: error: --plot {empty / 'loss.png'}: {empty} is a file, not a directory; "
        "choose a writable path"
    )


# --------------------------------------------------------------------------- metrics


def test_metrics_file_torn_line_and_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    rows, torn = read_metrics(path)
    assert (
        rows == [{"step": 1, "loss": 2.0}]
        and torn == f"{path}:2: dropped a torn last line (15 bytes)"
    )
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"metrics file {path}:2: not a metrics line"):
        read_metrics(path)


# --------------------------------------------------------------------------- ranks


@pytest.fixture(scope="module")
def short_timeout():
    """Two ranks whose collectives time out after 3 s; the call waits up to 60 s for a peer's
    own report after the first failure (a rank whose collective timed out reports after
    3 s once it runs, but on a loaded 2-core machine it may be scheduled late: CI once saw
    rank 0 still running 5 s after its peer was killed, and a machine at load 30 15 s)."""
    with LocalCluster(2, timeout_s=300, pg_timeout_s=3, grace_s=60) as cluster:
        yield cluster


def test_killed_rank_is_named_at_once(short_timeout):
    short_timeout.run(pid)  # running (restarted after an earlier failure): not timed
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as e:
        short_timeout.run(signal_one_rank, 1, signal.SIGKILL)
    assert time.monotonic() - t0 < 75  # the grace period at most, not the call's 300 s limit
    assert _one_line(e.value.summary).startswith("rank 1 was killed by SIGKILL (pid ")
    # rank 0: its own error, the peer left (it once was "still running" after the grace: rank
    # 1 died holding the lock of the ranks' shared result queue, which kept rank 0's report
    # out; each rank now reports through its own pipe)
    assert "; rank 0 raised RuntimeError: " in e.value.summary, e.value.summary


def test_a_task_that_cannot_be_sent_raises_at_once(short_timeout):
    """A function the ranks could not import (a lambda) or an argument that cannot be
    pickled: a TypeError in the caller at once, not a wait for the call's limit; the ranks
    are still there for the next call."""
    short_timeout.run(pid)  # the ranks are up (a previous test may have killed them)
    t0 = time.monotonic()
    with pytest.raises(
        TypeError, match=r"cannot send .*<lambda> to the ranks: .*module-level function"
    ):
        short_timeout.run(lambda rank, world_size: rank)
    with pytest.raises(TypeError, match="cannot send pid to the ranks"):
        short_timeout.run(pid, threading.Lock())
    assert time.monotonic() - t0 < 10  # not the call's 300 s limit
    assert len(short_timeout.run(pid)) == 2


def test_a_result_that_cannot_be_pickled_is_its_ranks_error(short_timeout):
    """The rank pickles its result before writing it: a result that cannot be pickled is
    that rank's error at once (not a lost report and a wait for the call's limit)."""
    short_timeout.run(pid)
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as e:
        short_timeout.run(unpicklable_on, 1)
    assert time.monotonic() - t0 < 30
    assert [(f.rank, f.what) for f in e.value.failures] == [(1, "raised")]
    assert "TypeError: cannot pickle '_thread.lock' object" in e.value.summary, e.value.summary


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_end_groups_ends_the_groups_calls_made_and_their_threads(short_timeout):
    """A mesh's groups and a group of one rank, made in one call and used in the next, end
    with `end_groups`, and so do their threads (each idle gloo group wakes 100 times a
    second); the default group stays."""
    short_timeout.run(pid)  # the ranks are up (a previous test may have killed them)
    short_timeout.run(make_groups)  # (once first: a first collective may start threads)
    short_timeout.end_groups()
    ended = short_timeout.run(groups_and_threads)
    made = short_timeout.run(make_groups)
    assert made[0][0] > made[1][0] > 1  # (rank 0 is also in a group of its own)
    assert short_timeout.run(use_groups) == [made[0][0] - 1, made[1][0] - 1]  # still there
    assert short_timeout.end_groups() == [made[0][0] - 1, made[1][0] - 1]
    assert short_timeout.run(groups_and_threads) == ended
    assert [n for n, _ in ended] == [1, 1]  # the default group alone
    assert all(t < t_made for (_, t), (_, t_made) in zip(ended, made, strict=True))
    short_timeout.close()
    assert short_timeout.end_groups() == []  # (no ranks: nothing to end, none started)


@pytest.mark.slow
def test_frozen_rank_is_named_after_the_timeout(short_timeout):
    short_timeout.run(pid)
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as e:
        short_timeout.run(signal_one_rank, 1, signal.SIGSTOP)
    assert 3 <= time.monotonic() - t0 < 30  # the 3 s timeout, not the call's 300 s limit
    summary = _one_line(e.value.summary)
    assert summary.startswith("rank 1 is frozen: its process ") and "stopped (SIGSTOP" in summary
    assert "; rank 0 raised RuntimeError: " in summary and "Timed out" in summary


@pytest.mark.slow
def test_ranks_die_with_their_launcher(tmp_path):
    """kill -9 of the process that started the ranks ends them too (no orphans)."""
    script = (
        "import multiprocessing, time\n"
        "from upipe.launch import LocalCluster\n"
        "if __name__ == '__main__':\n"
        "    with LocalCluster(2):  # the ranks, ready, wait for work\n"
        "        print(*(p.pid for p in multiprocessing.active_children()), flush=True)\n"
        "        time.sleep(600)\n"
    )
    (tmp_path / "launcher.py").write_text(script)
    launcher = subprocess.Popen(
        [sys.executable, str(tmp_path / "launcher.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # a killed launcher's resource tracker reports leaks there
        text=True,
    )
    ranks = []
    try:
        ready, _, _ = select.select([launcher.stdout], [], [], 240)  # never hang
        ranks = [int(p) for p in launcher.stdout.readline().split()] if ready else []
        assert len(ranks) == 2 and all(_alive(p) for p in ranks), ranks
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in ranks)
    finally:
        launcher.kill()
        for p in ranks:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _alive(process: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap it counts as ended)."""
    try:
        with open(f"/proc/{process}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_failures_are_one_line_on_the_command_line(monkeypatch, capsys):
    """`upipe train` turns a failed run into one line and exit status 1 (the traceback too,
    above it, only for an error upipe does not explain), with --timeout as the process
    group's timeout."""
    import upipe.cli.train as cli

    seen = {}
    failures = [
        RankFailure(0, "raised", "RuntimeError: boom", "builtins.RuntimeError", "Traceback: x\n"),
        RankFailure(1, "killed", "was killed by SIGKILL (pid 7)"),
    ]

    class Failing:
        def __init__(self, nproc, *, timeout_s, pg_timeout_s):
            seen["pg_timeout_s"] = pg_timeout_s

        def __enter__(self):
            raise DistributedError("running _spawned_rank", failures)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cli, "LocalCluster", Failing)
    monkeypatch.setattr(cli, "oom_kills", lambda: 3)  # the OOM killer did not act
    assert cli.run(small_config(timeout=42.0, nproc=2)) == 1
    assert seen == {"pg_timeout_s": 42.0}
    err = capsys.readouterr().err
    assert err == (
        "upipe train: rank 1 was killed by SIGKILL (pid 7); rank 0 raised RuntimeError: boom\n"
    )  # the peer's error follows from the death: no traceback
    counts = iter([3, 4])  # before and after the run: the OOM killer killed one process
    monkeypatch.setattr(cli, "oom_kills", lambda: next(counts))
    assert cli.run(small_config(timeout=42.0, nproc=2)) == 1
    hint = capsys.readouterr().err.splitlines()[1]
    assert hint.startswith(
        "upipe train: the rank killed by SIGKILL was stopped by the kernel's out-of-memory "
        "killer (its oom_kill count rose): this job needs at least 0.0 GiB before activations"
    ), hint
    monkeypatch.setattr(cli, "oom_kills", lambda: None)  # the kernel does not say
    assert cli.run(small_config(timeout=42.0, nproc=2)) == 1
    assert "was probably stopped by the kernel's out-of-memory killer, if nobody sent it" in (
        capsys.readouterr().err
    )
    monkeypatch.setattr(cli, "oom_kills", lambda: 3)
    failures.pop()
    assert cli.run(small_config(nproc=2)) == 1
    assert (
        capsys.readouterr().err == "Traceback: x\n\nupipe train: rank 0 raised RuntimeError: boom\n"
    )
