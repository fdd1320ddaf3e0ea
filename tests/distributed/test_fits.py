"""`upipe.train.fits`: the lower bound of a rank's memory that `upipe train` checks before
any rank starts -- its closed form, that a real rank's peak is above it, and the CLI's
refusal of a job that cannot fit (need, budget, what would fit)."""

from __future__ import annotations

import dataclasses

import pytest
from train_workers import small_config, train_steps

import upipe.cli.train as cli_train
from upipe.cli import main
from upipe.model import PRESETS
from upipe.train.fits import GiB, check_fits, state_bytes


def test_closed_form():
    cfg = small_config(seq_len=1024, batch_size=2)
    m = PRESETS["tiny"]
    P, V = m.num_params(), m.vocab_size
    logits = 2 * (1024 // 4) * V * 4  # B x local tokens x V, fp32
    assert state_bytes(cfg, 4) == 16 * P + logits
    assert state_bytes(dataclasses.replace(cfg, chunked_loss=True), 4) == 16 * P
    sharded = dataclasses.replace(cfg, fsdp=True, chunked_loss=True)
    assert state_bytes(sharded, 4) == 16 * P // 4
    mixed = dataclasses.replace(cfg, dtype="bfloat16", chunked_loss=True)
    assert state_bytes(mixed, 4) == 16 * P + 4 * P  # the bf16 copy: weights and gradients
    data_parallel = dataclasses.replace(cfg, strategy="none")
    assert state_bytes(data_parallel, 4) == 16 * P + 2 * 1024 * V * 4  # whole sequences


@pytest.mark.parametrize("kw", [{}, {"fsdp": True, "chunked_loss": True}])
def test_a_real_rank_peaks_above_the_bound(clusters, kw):
    cfg = small_config(seq_len=256, steps=2, **kw)
    peak = clusters(2).run(train_steps, cfg, True)[0]  # the ranks' largest step peak
    assert state_bytes(cfg, 2) <= peak < 4 * state_bytes(cfg, 2), (peak, state_bytes(cfg, 2))


def test_the_message_names_need_budget_and_what_fits():
    cfg = small_config(model="llama3-8b", seq_len=8192, nproc=4)
    need = 4 * state_bytes(cfg, 4)
    assert check_fits(cfg, 4, need, sharing=4, where="this machine") is None
    sharded = 4 * state_bytes(dataclasses.replace(cfg, fsdp=True), 4)
    problem = check_fits(cfg, 4, sharded, sharing=4, where="this machine")
    assert problem.startswith(f"this job needs at least {need / GiB:.1f} GiB (4 rank(s) x ")
    assert f"but this machine has {sharded / GiB:.1f} GiB available: add --fsdp or " in problem
    assert "a smaller --model (tiny-qwen3, tiny" in problem, problem


def test_cli_refuses_before_spawning(monkeypatch, capsys):
    monkeypatch.setattr(cli_train, "available_host_bytes", lambda: 16 * GiB)
    monkeypatch.setattr(cli_train, "LocalCluster", None)  # spawning would fail loudly
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "llama3-8b", "--plot", ""])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "upipe train: error: this job needs at least " in err
    assert "but this machine has 16.0 GiB available" in err, err


def test_check_memory_simulates_the_step_first(monkeypatch, capsys):
    """--check-memory: the planner's simulated peak (above the lower bound) is held against
    the budget; a budget between the two passes the quick check and fails this one."""
    cfg = small_config(seq_len=2048)
    monkeypatch.setattr(cli_train, "available_host_bytes", lambda: 5 * state_bytes(cfg, 4))
    monkeypatch.setattr(cli_train, "LocalCluster", None)
    with pytest.raises(SystemExit) as e:
        main(["train", "--check-memory", "--seq-len", "2048", "--plot", ""])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "upipe train: error: --check-memory: one step peaks at " in err
    assert "(simulated)" in err and "it does not fit; upipe plan --model tiny" in err, err
