"""Bad input raises a clear error on every rank, before any collective (never a hang)."""

import re

import pytest
import torch
from workers import expect_error

import upipe

S4 = (1, 8, 4, 8)  # a valid [B, L, H, d]


def _q(*shape):
    return tuple(shape)


BAD = [  # (description, per-rank (q, k, v) shapes or a list by rank, kwargs, error, match)
    (
        "H not divisible by C",
        (_q(1, 8, 3, 8), _q(1, 8, 3, 8), _q(1, 8, 3, 8)),
        {},
        "ValueError",
        r"query heads \(3\) must be divisible by the context-parallel size \(2\)",
    ),
    (
        "G not divisible by C",
        (S4, _q(1, 8, 1, 8), _q(1, 8, 1, 8)),
        {},
        "ValueError",
        r"kv heads \(1\) must be divisible by the context-parallel size \(2\)",
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


@pytest.mark.parametrize("strategy", ["ulysses"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_on_every_rank(clusters, strategy, case):
    _, shapes, kwargs, err, match = case
    if kwargs == "per-rank-causal":
        res = clusters(2).run(_per_rank_causal, strategy)
    else:
        res = clusters(2).run(expect_error, strategy, shapes, kwargs)
    for rank, r in enumerate(res):
        assert r is not None, f"rank {rank} did not raise"
        assert r[0] == err
        if case[0] == "one rank's input is bad" and rank == 0:
            assert "rank 1 of the group rejected its input" in r[1]
        assert re.search(match, r[1]), r[1]


def _per_rank_causal(rank, world_size, strategy):
    return expect_error(rank, world_size, strategy, (S4, S4, S4), {"causal": rank == 0})


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
