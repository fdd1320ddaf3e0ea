"""Bad input raises a clear error on every rank, before any collective (never a hang)."""

import re

import pytest
import torch
from workers import expect_error

import upipe
from upipe.attention.common import forget_agreements

S4 = (1, 8, 4, 8)  # a valid [B, L, H, d]


def _q(*shape):
    return tuple(shape)


BAD = [  # (description, per-rank (q, k, v) shapes or a list by rank, kwargs, error, match)
    (  # heads C does not divide are split unevenly (tests/distributed/test_uneven_heads.py)
        "fewer query heads than ranks",
        (_q(1, 8, 1, 8), _q(1, 8, 1, 8), _q(1, 8, 1, 8)),
        {},
        "ValueError",
        r"query heads \(1\) must be at least the context-parallel size \(2\)",
    ),
    (
        "G does not divide H",
        (_q(1, 8, 6, 8), _q(1, 8, 4, 8), _q(1, 8, 4, 8)),
        {},
        "ValueError",
        r"kv heads \(4\) must divide query heads \(6\)",
    ),
    ("q not 4-D", (_q(8, 4, 8), S4, S4), {}, "ValueError", r"q must be 4-D"),
    (
        "head dims differ",
        (S4, _q(1, 8, 4, 16), _q(1, 8, 4, 16)),
        {},
        "ValueError",
        r"head dims differ: q has 8, k/v have 16",
    ),
    (
        "batch differs",
        (S4, _q(2, 8, 4, 8), _q(2, 8, 4, 8)),
        {},
        "ValueError",
        r"batch sizes differ: q has 1, k/v have 2",
    ),
    (
        "local length differs",
        (S4, _q(1, 6, 4, 8), _q(1, 6, 4, 8)),
        {},
        "ValueError",
        r"local sequence lengths differ: q has 8, k/v have 6",
    ),
    ("k and v differ", (S4, S4, _q(1, 8, 2, 8)), {}, "ValueError", r"must have the same shape"),
    ("bad scale", (S4, S4, S4), {"softmax_scale": -1.0}, "ValueError", r"softmax_scale"),
    ("bad backend", (S4, S4, S4), {"backend": "tpu"}, "ValueError", r"unknown attention backend"),
    (
        "lengths differ between ranks",
        [(S4, S4, S4), (_q(1, 6, 4, 8),) * 3],
        {},
        "ValueError",
        r"ranks disagree.*q shape: rank 0 has \(1, 8, 4, 8\), rank 1 has "
        r"\(1, 6, 4, 8\).*pad the sequence",
    ),
    (
        "one rank's input is bad",
        [(S4, S4, S4), (_q(1, 8, 4), S4, S4)],
        {},
        "ValueError",
        r"q must be 4-D",
    ),
    (
        "options differ between ranks",
        (S4, S4, S4),
        "per-rank-causal",
        "ValueError",
        r"ranks disagree.*causal",
    ),
]


UPIPE_BAD = [
    (
        "U not a multiple of C",
        (S4, S4, S4),
        {"heads_per_stage": 3},
        "ValueError",
        r"heads_per_stage \(3\) must be a multiple of the context-parallel size "
        r"\(2\); valid values .*: \[2, 4\]",
    ),
    (
        "U larger than H",
        (S4, S4, S4),
        {"heads_per_stage": 8},
        "ValueError",
        r"heads_per_stage \(8\) must divide the number of query heads \(4\)",
    ),
    (
        "U does not divide H",
        (_q(1, 8, 12, 8),) * 3,
        {"heads_per_stage": 8},
        "ValueError",
        r"heads_per_stage \(8\) must divide the number of query heads \(12\)",
    ),
    (
        "U past one stage of an uneven split",
        (_q(1, 8, 5, 8), _q(1, 8, 5, 8), _q(1, 8, 5, 8)),
        {"heads_per_stage": 8},
        "ValueError",
        r"heads_per_stage \(8\) must be at most 6 .*valid values.*: \[2, 4, 6\]",
    ),
    (
        "U does not fit the GQA schedule",
        (_q(1, 8, 12, 8), _q(1, 8, 4, 8), _q(1, 8, 4, 8)),
        {"heads_per_stage": 4},
        "ValueError",
        r"GQA scheduling.*valid values.*\[2, 6, 12\]",
    ),
    ("U not an int", (S4, S4, S4), {"heads_per_stage": 2.0}, "TypeError", r"must be an int"),
    (
        "U differs between ranks",
        (S4, S4, S4),
        "per-rank-U",
        "ValueError",
        r"ranks disagree.*heads_per_stage",
    ),
]
CASES = [("ulysses", c) for c in BAD] + [("upipe", c) for c in BAD + UPIPE_BAD]


@pytest.mark.parametrize("strategy,case", CASES, ids=[f"{s}: {c[0]}" for s, c in CASES])
def test_bad_input_raises_on_every_rank(clusters, strategy, case):
    _, shapes, kwargs, err, match = case
    if kwargs in ("per-rank-causal", "per-rank-U"):
        res = clusters(2).run(_per_rank_option, strategy, kwargs)
    else:
        res = clusters(2).run(expect_error, strategy, shapes, kwargs)
    for rank, r in enumerate(res):
        assert r is not None, f"rank {rank} did not raise"
        assert r[0] == err
        if case[0] == "one rank's input is bad" and rank == 0:
            assert "rank 1 of the group rejected its input" in r[1]
        assert re.search(match, r[1]), r[1]


def _per_rank_option(rank, world_size, strategy, which):
    kwargs = (
        {"causal": rank == 0} if which == "per-rank-causal" else {"heads_per_stage": 2 + 2 * rank}
    )
    return expect_error(rank, world_size, strategy, (S4, S4, S4), kwargs)


def test_dtype_and_type_errors(clusters):
    res = clusters(2).run(_dtype_and_type)
    for r in res:
        assert (
            r["dtype"][0] == "ValueError" and "has dtype torch.float64 but q has" in r["dtype"][1]
        )
        assert r["type"][0] == "TypeError" and "k must be a torch.Tensor" in r["type"][1]
        assert r["int"][0] == "ValueError" and "floating-point" in r["int"][1]


def _dtype_and_type(rank, world_size):
    q = torch.randn(S4)
    return {
        "dtype": expect_error(rank, world_size, "ulysses", (q, q.double(), q), {}),
        "type": expect_error(rank, world_size, "ulysses", (q, [1, 2], q), {}),
        "int": expect_error(rank, world_size, "ulysses", (q.long(),) * 3, {}),
    }


def test_group_must_be_a_process_group():
    q = torch.randn(S4)
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        upipe.ulysses_attention(q, q, q, group=None)


MODULE_BAD = [
    (
        dict(hidden_size=32, num_heads=4, num_kv_heads=2, strategy="striped"),
        r"unknown strategy 'striped'",
    ),
    (
        dict(hidden_size=32, num_heads=4, num_kv_heads=2, strategy="ring", heads_per_stage=4),
        r"heads_per_stage applies to strategy='upipe' only",
    ),
    (
        dict(hidden_size=48, num_heads=2, num_kv_heads=2),
        r"num_heads \(2\) must be at least the context-parallel size \(4\).*"
        r"use a size of at most 2, or strategy='ring'",
    ),
    (
        dict(hidden_size=32, num_heads=8, num_kv_heads=3),
        r"num_kv_heads \(3\) must divide num_heads",
    ),
    (
        dict(hidden_size=30, num_heads=4, num_kv_heads=2),
        r"hidden_size \(30\) is not divisible by num_heads",
    ),
    (
        dict(hidden_size=24, num_heads=6, num_kv_heads=2, heads_per_stage=12),
        r"heads_per_stage \(12\) must be at most 8 .*: \[4, 8\]",
    ),
    (
        dict(hidden_size=32, num_heads=8, num_kv_heads=8, heads_per_stage=6),
        r"heads_per_stage \(6\)",
    ),
    (
        dict(hidden_size=32, num_heads=8, num_kv_heads=8, strategy="ulysses", heads_per_stage=4),
        r"heads_per_stage applies to strategy='upipe' only",
    ),
    (
        dict(hidden_size=32, num_heads=4, num_kv_heads=2, softmax_scale=-0.5),
        r"softmax_scale must be a positive number or None, got -0.5",
    ),
]


def test_module_arguments_are_validated(clusters):
    for msgs in clusters(4).run(_module_errors):
        for m, (_, match) in zip(msgs, MODULE_BAD, strict=True):
            assert m is not None and re.search(match, m), m


def _module_errors(rank, world_size):
    out = []
    for kwargs, _ in MODULE_BAD:
        try:
            upipe.ContextParallelAttention(group=torch.distributed.group.WORLD, **kwargs)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_module_forward_checks_inputs_on_every_rank(clusters):
    for r in clusters(2).run(_module_forward_errors):
        assert "x must be [batch, local_seq, 32]" in r["x"]
        assert "position_ids must be [batch, local_seq] = (1, 8)" in r["pos"]
        assert "ranks disagree" in r["len"] and "x shape" in r["len"]


def _module_forward_errors(rank, world_size):
    torch.manual_seed(0)
    layer = upipe.ContextParallelAttention(32, 4, 2, group=torch.distributed.group.WORLD)
    out = {}
    for key, x, pos in (
        ("x", torch.randn(1, 8, 16), torch.arange(8)[None]),
        ("pos", torch.randn(1, 8, 32), torch.arange(7)[None]),
        ("len", torch.randn(1, 8 - 2 * rank, 32), torch.arange(8 - 2 * rank)[None]),
    ):
        forget_agreements()  # a first call: ranks whose inputs differ must exchange verdicts
        try:
            layer(x, pos)
        except ValueError as e:
            out[key] = str(e)
    return out
