"""The training stack: every strategy and memory feature trains exactly like one process."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from commands import stop_midway, upipe
from tolerances import rel_err
from train_workers import (
    CORPUS,
    check_training,
    small_config,
    train_and_save,
    train_steps,
)

from upipe.loss import count_valid, cross_entropy_sum, global_token_mean, shift_labels
from upipe.model import CausalLM, get_config
from upipe.model.features import activation_checkpoint, tiled_recompute
from upipe.train.config import validate

# Training parity: same fp32 math, different reduction order. Gradients of one step are as
# close as the attention itself (~1e-6); losses after a few AdamW steps stay within 1e-5.


@pytest.fixture(scope="module")
def reference(clusters):
    """Single-process runs (strategy none) of each model, by name."""
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = clusters(1).run(train_steps, small_config(model=model, strategy="none"))[
                0
            ]
        return cache[model]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,model,kw",
    [
        (2, "tiny", {"strategy": "ulysses"}),
        (4, "tiny", {"strategy": "ulysses"}),
        (2, "tiny", {"strategy": "upipe"}),
        (4, "tiny", {"strategy": "upipe", "heads_per_stage": 8}),
        (4, "tiny-qwen3", {"strategy": "upipe"}),  # QK-norm, tied embeddings, kv replicated
        (2, "tiny-qwen3", {"strategy": "ulysses"}),
        (4, "tiny", {"strategy": "ring"}),
        (4, "tiny", {"strategy": "usp"}),
        (4, "tiny", {"strategy": "upipe", "ring": 2}),
        (4, "tiny", {"strategy": "upipe", "fsdp": True}),
        (2, "tiny-qwen3", {"strategy": "ulysses", "fsdp": True}),
        (4, "tiny", {"strategy": "upipe", "dp": 2}),
    ],
)
def test_training_equals_one_process(clusters, reference, world_size, model, kw):
    cfg = small_config(model=model, **kw)
    if kw.get("dp") == 2:  # two sequences per step in both runs
        ref = clusters(1).run(train_steps, small_config(model=model, strategy="none", batch_size=2))
        ref = ref[0]
    else:
        ref = reference(model)
    check_training(clusters(world_size).run(train_steps, cfg)[0], ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,strategy,features",
    [
        (1, "none", {"tiled_mlp": True, "mlp_tile": 48}),
        (1, "none", {"chunked_loss": True, "loss_chunk": 40}),
        (1, "none", {"activation_checkpoint": True}),
        (1, "none", {"activation_checkpoint": True, "offload": True}),  # offload is a no-op on CPU
        (
            2,
            "upipe",
            {
                "tiled_mlp": True,
                "mlp_tile": 16,
                "chunked_loss": True,
                "loss_chunk": 24,
                "activation_checkpoint": True,
            },
        ),
        (
            4,
            "ulysses",
            {"activation_checkpoint": True, "fsdp": True, "tiled_mlp": True, "mlp_tile": 8},
        ),
    ],
)
def test_memory_features_do_not_change_the_math(
    clusters, reference, world_size, strategy, features
):
    cfg = small_config(strategy=strategy, **features)
    check_training(clusters(world_size).run(train_steps, cfg)[0], reference("tiny"))


@pytest.mark.slow
def test_memory_features_save_memory(clusters):
    """Each feature lowers the per-rank peak of a step (one process, longer sequence)."""
    base = small_config(strategy="none", seq_len=1024, steps=1)
    peak = lambda **kw: clusters(1).run(train_steps, dataclasses.replace(base, **kw), True)[0]
    off = peak()
    assert peak(chunked_loss=True, loss_chunk=128) < off
    assert peak(tiled_mlp=True, mlp_tile=128) < off
    assert peak(activation_checkpoint=True) < off


@pytest.mark.slow
def test_resume_continues_the_same_curve(clusters, tmp_path):
    import shutil

    cfg = small_config(strategy="upipe", steps=4, fsdp=True)
    straight = clusters(2).run(train_and_save, cfg)[0]
    ckpt = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    first = clusters(2).run(train_and_save, ckpt)[0]
    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")  # as if killed after step 2
    resumed = clusters(2).run(train_and_save, dataclasses.replace(ckpt, resume=True))[0]
    assert first == straight
    assert resumed == straight[2:]  # bit for bit: same data by step, same restored state


def test_chunked_cross_entropy_and_tiling_float64():
    torch.manual_seed(0)
    h = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = shift_labels(torch.randint(0, 50, (2, 37)))
    labels[0, :9] = -100  # padding
    full = cross_entropy_sum(h, w, labels)
    chunked = cross_entropy_sum(h, w, labels, chunk_tokens=10)
    assert abs(full.item() - chunked.item()) < 1e-5 * abs(full.item())
    g_full, g_chunk = torch.autograd.grad(full, (h, w)), torch.autograd.grad(chunked, (h, w))
    for a, b in zip(g_full, g_chunk, strict=True):
        assert rel_err(b, a) < 1e-6
    assert count_valid(labels).item() == 2 * 37 - 2 - 9  # last position of each row, 9 pads
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.SiLU(), torch.nn.Linear(24, 16))
    mlp.double()
    y = tiled_recompute(mlp, h, 8)
    y_ref = mlp(h)
    assert rel_err(y, y_ref) < 1e-12
    with torch.no_grad():  # the path of a checkpointed forward
        assert rel_err(tiled_recompute(mlp, h, 8), y_ref) < 1e-12
    gy = torch.randn_like(y)
    # reentrant recompute: parameter gradients accumulate into .grad (use backward, not grad)
    y.backward(gy)
    tiled = [h.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    h.grad = None
    mlp.zero_grad()
    y_ref.backward(gy)
    ref = [h.grad, *(p.grad for p in mlp.parameters())]
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(tiled, ref, strict=True))
    z = activation_checkpoint(lambda x, s: mlp(x) * s, h, 2.0)
    assert (
        rel_err(torch.autograd.grad(z.sum(), h)[0], torch.autograd.grad((mlp(h) * 2).sum(), h)[0])
        < 1e-12
    )


def test_global_token_mean_single_process_matches_mean():
    loss_sum, n = torch.tensor(12.0, requires_grad=True), torch.tensor(4.0)
    loss = global_token_mean(loss_sum, n)
    loss.backward()
    assert loss.item() == 3.0 and loss_sum.grad.item() == 0.25


def test_same_seed_same_weights_whatever_the_model_split():
    a, b = CausalLM(get_config("tiny")), CausalLM(get_config("tiny"))
    a.init_weights(7)
    b.init_weights(7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert get_config("llama3-8b").num_params() == 8_030_261_248  # the published 8.03B


@pytest.mark.parametrize(
    "kw,world,message",
    [
        ({"strategy": "ulysses", "nproc": 16}, 16, "8 heads, fewer than the ulysses size 16"),
        ({"grad_accum": 0}, 4, "--grad-accum must be >= 1, got 0"),
        ({"master_dtype": "bfloat16"}, 4, "--master-dtype bfloat16 is less precise"),
        ({"min_lr_ratio": 2.0}, 4, "--min-lr-ratio in [0, 1]"),
        ({"strategy": "none", "dp": 2}, 4, "use --dp 4"),
        ({"strategy": "upipe", "heads_per_stage": 3}, 4, "--heads-per-stage: heads_per_stage (3)"),
        ({"strategy": "usp", "ring": 4}, 4, "usp needs 1 < --ring < 4"),
        ({"offload": True}, 4, "add --activation-checkpoint"),
        ({"resume": True}, 4, "--resume needs --checkpoint-dir"),
    ],
)
def test_validation_messages(kw, world, message):
    assert message in validate(small_config(**kw), world)


@pytest.mark.slow
def test_cli_demo_path_small(tmp_path):
    pytest.importorskip("matplotlib")  # (its PNG is checked)
    metrics, plot = tmp_path / "m.jsonl", tmp_path / "loss.png"
    res = upipe(
        "train", "--nproc", "2", "--seq-len", "256", "--steps", "3", "--data",
        small_config().data, "--metrics-file", str(metrics), "--plot", str(plot),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] < math.log(257) + 0.2
    assert plot.stat().st_size > 1000 and "loss" in res.stdout


def test_cli_bad_option_is_a_message(capsys):
    """Refused in the parent before any rank is spawned: exit status 2 and one message (in
    this process: `main` is what `upipe` runs)."""
    from upipe.cli import main

    for argv, said in [
        (["--nproc", "4", "--master-dtype", "bfloat16"],
         "--master-dtype bfloat16 is less precise than the compute --dtype"),
        (["--data", "/nonexistent/corpus"], "neither a file nor a directory"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            main(["train", *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and "Traceback" not in err, err


def test_fsdp_model_never_exists_whole(clusters):
    """With FSDP the model is built on the meta device and only this rank's shards are
    allocated: building peaks well below the full model (plus one full matrix being drawn),
    and the weights equal those built whole."""
    from train_workers import build_memory

    cfg = small_config(strategy="upipe", nproc=4, fsdp=True)
    peak, full, local, sharded = clusters(4).run(build_memory, cfg)[0]
    assert local <= full / 4 + 4096 and peak < 0.6 * full, (peak, full, local)
    *_, whole = clusters(1).run(build_memory, small_config(strategy="none"))[0]
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[n], whole[n]) for n in whole)


def test_banner_says_where_the_ulysses_groups_are():
    from upipe.cli.train import banner

    cfg = small_config(strategy="usp", ring=2, device="cpu")
    inside = banner(cfg, 16, ranks_per_node=8)
    assert "16 CPU ranks on 2 node(s) of 8 (dp 1 x ring 2 x ulysses 8: each Ulysses group" in inside
    assert "of 8 consecutive ranks is inside a node" in inside
    across = banner(dataclasses.replace(cfg, ring=1), 16, ranks_per_node=8)
    assert "ulysses 16: each Ulysses group of 16 consecutive ranks is ACROSS a node" in across
    assert banner(cfg, 4).startswith("tiny (") and "4 CPU ranks (dp 1 x ring 2 x ulysses 2)" in (
        banner(cfg, 4)
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,code,by",
    [
        # (by default: Ctrl-C to upipe demo and upipe plan, tests/runs/test_cli.py)
        pytest.param("SIGINT", 130, "Ctrl-C (SIGINT)", marks=pytest.mark.exhaustive),
        ("SIGTERM", 143, "SIGTERM"),
    ],
)
def test_a_stopped_run_says_so_and_leaks_nothing(tmp_path, sig, code, by):
    """Ctrl-C or SIGTERM during training: one line naming the signal and the resume, exit
    128 + the signal, the ranks gone, no traceback and no leaked-semaphore warning. (Ctrl-C
    as a terminal sends it: to the whole process group, ranks included.)"""
    args = ["train", "--steps", "500", "--seq-len", "512", "--nproc", "2", "--plot", "",
            "--data", CORPUS, "--checkpoint-dir", "ck"]  # fmt: skip
    # after "loss=": the first step is done
    got, _, err = stop_midway(args, after="loss=", sig=sig, group=sig == "SIGINT", cwd=tmp_path)
    assert got == code, err[-2000:]
    said = f"upipe train: stopped by {by}: the ranks were stopped; --resume continues from ck"
    assert said in err, err[-2000:]
    assert "Traceback" not in err and "leaked" not in err, err[-2000:]


def test_the_lost_peer_is_named_by_its_address():
    from upipe.train.peers import Placement, describe, is_peer_loss

    ps = [Placement(r, r // 2, f"h{r // 2}", f"10.0.0.{r // 2}") for r in range(6)]
    e = RuntimeError("pair.cc:537] Read error [10.0.0.2]:4711: Connection reset by peer")
    assert is_peer_loss(e) and not is_peer_loss(RuntimeError("CUDA out of memory"))
    assert describe(e, ps, ps[0]) == "node 2 (h2, 10.0.0.2: ranks 4-5)"
    unknown = RuntimeError("NCCL error: remote process exited or there was a network error")
    assert describe(unknown, ps, ps[0]) == (
        "node 1 (h1, 10.0.0.1: ranks 2-3) or node 2 (h2, 10.0.0.2: ranks 4-5)"
    )
