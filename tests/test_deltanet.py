"""The Gated DeltaNet layer split by heads (upipe.attention.deltanet, deltanet_staged,
upipe.integrations.hf_deltanet) against transformers' own layer on the whole sequence:
Ulysses and UPipe stages, even, replicated and uneven heads, documents, the fla path."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import deltanet_workers as W  # noqa: E402
from conftest import TOL, grad_errors, rel_err  # noqa: E402

TOL32 = TOL[torch.float32]
# documents of 2 tokens, inside a shard, across shards and chunks. (Not of one token: there
# the unconverted layer's own dx moves by 3e-5 when its input moves by 1e-7 -- measured --,
# and transformers' projection of a 1-token slice rounds differently than of the whole
# sequence; the model-level test, tests/test_hybrid.py, keeps a 1-token document.)
DOCS = (0, 2, 7, 70, 100, W.SEQ)
UNEVEN = dict(linear_num_key_heads=3, linear_num_value_heads=6)  # 6 over 3 on 4 ranks


@functools.cache
def _reference(kind, docs, heads):
    return W.reference(kind, docs, **dict(heads))


def _check(case, results):
    """Every rank's y and dx block and the summed gradients vs the unconverted layer."""
    kind, strategy, _, docs, heads, _ = case
    y, dx, grads = _reference(kind, docs, tuple(heads.items()))
    C = len(results)
    ours_y = torch.cat([r[0] for r in results], dim=1)
    ours_dx = torch.cat([r[1] for r in results], dim=1)
    errs = {"y": rel_err(ours_y, y), "dx": rel_err(ours_dx, dx)}
    for r in results:
        assert list(r[2]) == list(grads)  # the layer's parameters, under their names
        assert f"strategy='{strategy}'" in r[3] and f"group_size={C}" in r[3]
    errs.update(grad_errors(results[0][2], grads))
    worst = max(errs, key=errs.get)
    assert errs[worst] < TOL32["bwd"], (case, worst, errs[worst])


# (kind, strategy, heads_per_stage, docs, heads, scan backend)
CASES = {
    2: [
        ("next", "upipe", None, DOCS, {}, None),  # U = 2: a round of two stages
        ("3.5", "ulysses", None, None, {}, None),
        ("3.5", "upipe", 4, None, {}, None),  # one stage of every head
    ],
    4: [
        ("next", "ulysses", None, DOCS, {}, None),  # 2 key heads on 4 ranks: replicated
        ("3.5", "upipe", 4, DOCS, UNEVEN, None),  # uneven: 2, 2, 1, 1 value heads
        ("next", "upipe", 8, None, dict(linear_num_value_heads=8), None),  # two rounds
    ],
}


@pytest.mark.parametrize("world", [2, 4])
def test_matches_the_transformers_layer(clusters, world):
    """y, dx and every parameter gradient (summed over the ranks) against transformers' layer
    on the whole sequence, or on each document alone."""
    results = clusters(world).run(W.run_layer, CASES[world])
    for case, per_rank in zip(CASES[world], zip(*results, strict=True), strict=True):
        _check(case, per_rank)


def test_fla_path_follows_its_contract(clusters):
    """backend "fla" (one kernel call, rows flattened, documents as cu_seqlens) through a
    stand-in with fla's contract (float64 recurrence), against transformers' torch layer."""
    cases = [
        ("next", "upipe", None, DOCS, {}, "fla"),
        ("3.5", "ulysses", None, None, {}, "fla"),
    ]
    results = clusters(2).run(W.run_layer_fla, cases)
    for case, per_rank in zip(cases, zip(*results, strict=True), strict=True):
        _check(case, per_rank)
