"""The training loop around the step: any sequence length (padding), gradient accumulation,
the learning-rate schedule, held-out evaluation, TensorBoard, resume, optional plots."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import pytest
import torch
from tolerances import grad_errors
from train_workers import small_config, train_and_save, train_steps, weights_after

from upipe.train.config import TrainConfig, padded_length
from upipe.train.loop import plot_loss, warmup_cosine

# Same tolerances as tests/runs/test_train.py: the same fp32 math summed in another order.
LOSS_TOL, GRAD_TOL = 1e-5, 2e-5


def _close(res, ref):
    """Largest relative differences of losses and step-1 gradients (asserted in bounds)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"], strict=True))
    grad = max(grad_errors(res["grads"], ref["grads"]).values())
    assert loss < LOSS_TOL and grad < GRAD_TOL, (loss, grad, res["losses"], ref["losses"])
    return loss, grad


@pytest.mark.parametrize(
    "strategy,kw,padded",
    [
        ("none", {}, 1001),
        ("ulysses", {}, 1004),
        ("upipe", {}, 1004),
        ("upipe", {"ring": 2}, 1008),  # stages as ring attention: zigzag over the ring
        ("ring", {}, 1008),  # zigzag: 2C chunks
        ("usp", {}, 1008),
    ],
)
def test_padded_length(strategy, kw, padded):
    cfg = small_config(strategy=strategy, seq_len=1001, **kw)
    assert padded_length(cfg, 1 if strategy == "none" else 4) == padded


@pytest.fixture(scope="module")
def odd_reference(clusters):
    return clusters(1).run(train_steps, small_config(strategy="none", seq_len=1001, steps=2))[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {"strategy": "ulysses"},
        {"strategy": "upipe"},
        {"strategy": "upipe", "ring": 2},
        {"strategy": "ring"},
        {"strategy": "usp"},
        {"strategy": "upipe", "fsdp": True, "chunked_loss": True, "loss_chunk": 100},
    ],
)
def test_odd_length_equals_one_process(clusters, odd_reference, kw):
    """seq_len 1001 on 4 ranks: padded at the end (labels ignored), the same losses and
    gradients as one process holding the 1001 tokens unpadded."""
    cfg = small_config(seq_len=1001, steps=2, **kw)
    _close(clusters(4).run(train_steps, cfg)[0], odd_reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,kw",
    [
        (1, {"strategy": "none"}),
        (2, {"strategy": "upipe"}),
        (4, {"strategy": "upipe", "dp": 2, "fsdp": True}),
        (2, {"strategy": "ulysses", "dtype": "bfloat16"}),  # fp32 masters: fp32 accumulation
    ],
)
def test_grad_accum_equals_one_big_batch(clusters, world, kw):
    """2 micro-batches of 1 sequence per step = 1 batch of 2 sequences: the same rows, the
    loss the mean over all their tokens, the gradients accumulated (fp32) then reduced."""
    big = clusters(world).run(train_steps, small_config(batch_size=2, **kw))[0]
    accum = clusters(world).run(train_steps, small_config(grad_accum=2, **kw))[0]
    if kw.get("dtype") == "bfloat16":  # bf16 compute of 1 vs 2 rows: the kernels' rounding
        loss = max(abs(a - b) / b for a, b in zip(accum["losses"], big["losses"], strict=True))
        assert loss < 2e-3, (accum["losses"], big["losses"])
        assert max(grad_errors(accum["grads"], big["grads"]).values()) < 2e-2
    else:
        _close(accum, big)


def test_warmup_cosine_schedule():
    """LambdaLR over `warmup_cosine`: linear warmup, cosine to min_ratio at the last step."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    fn = lambda s: warmup_cosine(s, warmup=2, total=11, min_ratio=0.1)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
    lrs = []
    for _ in range(11):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])  # warmup, then the peak at step 2
    assert lrs[6] == pytest.approx(0.55)  # the middle of the cosine (steps 2..10)
    assert lrs[-1] == pytest.approx(0.1) and lrs[2:] == sorted(lrs[2:], reverse=True)
    const = [warmup_cosine(s, warmup=0, total=5, min_ratio=1.0) for s in range(5)]
    assert const == [1.0] * 5
    assert warmup_cosine(0, warmup=0, total=1, min_ratio=0.1) == 1.0  # one step: the peak


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {"strategy": "upipe", "fsdp": True, "dtype": "bfloat16"},  # FSDP2 mixed precision
        {"strategy": "ulysses", "dtype": "bfloat16"},  # fp32 masters apart from the model
    ],
)
def test_resume_with_schedule_accumulation_and_masters(clusters, tmp_path, kw):
    """Killed after step 2 of 4 and resumed: steps 3 and 4 bit for bit as in a straight run
    (fp32 masters and AdamW states, the schedule's position, micro-batches by step)."""
    cfg = small_config(steps=4, grad_accum=2, warmup_steps=1, lr=3e-3, **kw)
    straight = clusters(2).run(train_and_save, cfg)[0]
    ckpt = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    assert clusters(2).run(train_and_save, ckpt)[0] == straight
    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")
    resumed = clusters(2).run(train_and_save, dataclasses.replace(ckpt, resume=True))[0]
    assert resumed == straight[2:]


@pytest.mark.slow
def test_weight_decay_is_adamw_s_on_the_matrices(clusters):
    """--weight-decay: the masters after 3 steps (warmup, cosine, FSDP2's sharded masters)
    are bit for bit those of torch's AdamW with the weights of two or more dimensions in a
    group of that weight_decay and the norms in one without; and the decay moved them."""
    cfg = small_config(strategy="upipe", fsdp=True, steps=3, warmup_steps=1, lr=1e-2)
    decayed = dataclasses.replace(cfg, weight_decay=0.1)
    ours = clusters(2).run(weights_after, decayed)[0]
    ref = clusters(2).run(weights_after, cfg, 0.1)[0]
    plain = clusters(2).run(weights_after, cfg)[0]
    assert ours.keys() == ref.keys()
    for name, w in ref.items():
        assert torch.equal(ours[name], w), name
        if w.ndim >= 2:
            assert not torch.equal(w, plain[name]), name


@pytest.mark.slow
def test_resume_with_another_steps_keeps_or_replaces_the_schedule(clusters, tmp_path):
    """A run of 4 steps resumed with --steps 6 continues the checkpoint's cosine (its floor
    past step 4) and says so; --reschedule takes this run's 6-step cosine from step 4 on (the
    rate jumps, printed); --resume on an empty folder is an error naming it on every rank,
    --resume-if-present starts from step 0 there."""
    from loop_workers import train_lrs_and_notes as run

    ckpt = str(tmp_path / "ckpt")
    four = small_config(steps=4, lr=1e-2, min_lr_ratio=0.1, checkpoint_dir=ckpt)
    clusters(2).run(run, four)
    six = dataclasses.replace(four, steps=6, resume=True)
    kept, said = clusters(2).run(run, six)[0]
    assert [s for s, _, _ in kept] == [5, 6]
    assert [lr for _, lr, _ in kept] == pytest.approx([1e-3, 1e-3])  # the saved floor
    assert "the checkpoint's learning-rate schedule goes on: lr 0.01, 0 warmup steps, " in said
    assert "cosine to 0.1 x lr at step 4 (this run asked for lr 0.01, 0 warmup steps" in said
    shutil.rmtree(tmp_path / "ckpt" / "step_00000006")
    replaced, said = clusters(2).run(run, dataclasses.replace(six, reschedule=True))[0]
    want = [1e-2 * warmup_cosine(s, warmup=0, total=6, min_ratio=0.1) for s in (4, 5)]
    assert [lr for _, lr, _ in replaced] == pytest.approx(want)
    assert f"the rate goes from 0.001 to {want[0]:.4g} at step 4" in said
    straight, _ = clusters(2).run(run, dataclasses.replace(four, steps=6, checkpoint_dir=None))[0]
    assert [lr for _, lr, _ in replaced] == [lr for _, lr, _ in straight[4:]]
    empty = str(tmp_path / "typo")
    for found in clusters(2).run(run, dataclasses.replace(six, checkpoint_dir=empty)):
        assert f"CheckpointError: --resume: no checkpoint in {empty} " in found, found
        assert "--resume-if-present" in found
    fresh = dataclasses.replace(six, checkpoint_dir=empty, resume=False, resume_if_present=True)
    rows, said = clusters(2).run(run, fresh)[0]
    assert "starting from step 0" in said
    assert rows == straight


@pytest.mark.slow
def test_eval_metrics_and_tensorboard(clusters, tmp_path):
    """eval_loss every 2 steps and at the end, on the held-out documents (data.py's split:
    no token of them in a training batch); the lr of each step; the same scalars as
    TensorBoard events."""
    pytest.importorskip("tensorboard")
    from loop_workers import train_rows

    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    cfg = small_config(
        strategy="upipe", steps=3, eval_every=2, eval_batches=2, eval_fraction=0.3,
        warmup_steps=1, metrics_file=str(metrics), tensorboard=str(tb),
    )  # fmt: skip
    rows, train_rows_, eval_rows = clusters(2).run(train_rows, cfg)[0]
    assert len(eval_rows) == 2 * cfg.batch_size  # (rank 0's rows; the split: test_data.py)
    assert not any(row in train_rows_ for row in eval_rows)
    assert [("eval_loss" in r) for r in rows] == [False, True, True]
    assert all(0 < r["eval_loss"] < 6 for r in rows[1:])
    assert [r["lr"] for r in rows] == pytest.approx([5e-3, 1e-2, 1e-3])  # warmup, peak, min
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == rows
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.value for e in events.Scalars("train/eval_loss")] == pytest.approx(
        [r["eval_loss"] for r in rows[1:]]
    )
    assert len(events.Scalars("train/loss")) == 3


def test_plot_without_matplotlib_warns_and_skips(monkeypatch, tmp_path):
    import upipe.plot

    monkeypatch.setattr(upipe.plot, "have_matplotlib", lambda: False)
    path = tmp_path / "loss.png"
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        plot_loss([{"step": 1, "loss": 1.0}], str(path), "t")
    assert not path.exists()


def test_cli_tensorboard_missing_is_a_message(monkeypatch, capsys):
    import upipe.cli.train as cli_train
    from upipe.cli import main

    monkeypatch.setattr(cli_train, "have_tensorboard", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["train", "--tensorboard", "runs"])
    assert e.value.code == 2
    assert "--tensorboard needs the tensorboard package" in capsys.readouterr().err


def test_defaults_are_a_plain_fp32_run():
    """`upipe train` with no options: fp32 compute and masters (CPU), no accumulation."""
    cfg = TrainConfig()
    assert (cfg.dtype, cfg.master_dtype, cfg.grad_accum, cfg.eval_every) == (
        "float32",
        "float32",
        1,
        0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warmup_cosine(cfg.steps - 1, warmup=0, total=cfg.steps, min_ratio=0.1) == 0.1


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"eval_every": 2, "eval_fraction": 0.0}, "--eval-every needs --eval-fraction in (0, 1)"),
        ({"warmup_steps": -1}, "--warmup-steps, --eval-every and --grad-clip must be >= 0"),
        ({"eval_batches": 0}, "--eval-batches must be >= 1, got 0"),
        ({"weight_decay": -0.1}, "--weight-decay must be >= 0, got -0.1"),
        ({"weight_decay": float("nan")}, "--weight-decay must be >= 0, got nan"),
        ({"dtype": "bfloat16", "master_dtype": "bfloat16"}, None),  # all bf16: allowed
        ({"strategy": "ring", "seq_len": 1001}, None),  # any length: padded to 1008
    ],
)
def test_loop_option_validation(kw, message):
    from upipe.train.config import validate

    problem = validate(small_config(**kw), 4)
    assert problem == message if message is None else message in problem


@pytest.mark.slow
def test_ranks_started_with_different_options_name_them(clusters):
    from loop_workers import train_with_rank_options

    cfg = small_config(steps=1)
    other = dataclasses.replace(cfg, seq_len=256, nproc=2)
    for found in clusters(2).run(train_with_rank_options, (cfg, other)):
        assert found == (
            "the ranks were started with different options: --seq-len: 128 on rank 0; 256 on "
            "rank 1 (start every node with the same command)"
        ), found
