"""The Gated DeltaNet layer split by heads (upipe.attention.deltanet, deltanet_staged,
upipe.integrations.hf_deltanet) against transformers' own layer on the whole sequence:
Ulysses and UPipe stages, even, replicated and uneven heads, documents, the fla path."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import deltanet_workers as W  # noqa: E402
from tolerances import TOL, bf16_bound, grad_errors, rel_err  # noqa: E402

TOL32 = TOL[torch.float32]
# documents of 2 tokens, inside a shard, across shards and chunks. (Not of one token: there
# the unconverted layer's own dx moves by 3e-5 when its input moves by 1e-7 -- measured --,
# and transformers' projection of a 1-token slice rounds differently than of the whole
# sequence; the model-level test, tests/distributed/test_hybrid.py, keeps a 1-token document.)
DOCS = (0, 2, 7, 70, 100, W.SEQ)
UNEVEN = dict(linear_num_key_heads=3, linear_num_value_heads=6)  # 6 over 3 on 4 ranks


@functools.cache
def _reference(kind, docs, heads, dtype=torch.float32):
    return W.reference(kind, docs, dtype, **dict(heads))


def _errors(results, y, dx, grads):
    ours_y = torch.cat([r[0] for r in results], dim=1)
    ours_dx = torch.cat([r[1] for r in results], dim=1)
    return {
        "y": rel_err(ours_y, y),
        "dx": rel_err(ours_dx, dx),
        **grad_errors(results[0][2], grads),
    }


def _check(case, results):
    """Every rank's y and dx block and the summed gradients vs the unconverted layer (fp32);
    bf16 within `bf16_bound` of the unconverted layer's own bf16 error, each against fp32."""
    kind, spec, _, docs, heads, _, dtype = case
    strategy, _, keep = spec.partition("+")
    y, dx, grads = _reference(kind, docs, tuple(heads.items()))
    C = len(results)
    for r in results:
        assert list(r[2]) == list(grads)  # the layer's parameters, under their names
        assert f"strategy='{strategy}'" in r[3] and f"group_size={C}" in r[3]
        assert f"stage_inputs='{keep or 'recompute'}'" in r[3]
    errs = _errors(results, y, dx, grads)
    if dtype == torch.float32:
        bounds = dict.fromkeys(errs, TOL32["bwd"])
    else:  # the unconverted layer in bf16 on one process, against its fp32 self
        single = _errors([_reference(kind, docs, tuple(heads.items()), dtype)], y, dx, grads)
        bounds = {n: bf16_bound(e) for n, e in single.items()}
    bad = {n: (e, bounds[n]) for n, e in errs.items() if e >= bounds[n]}
    assert not bad, (case, bad)


F32, BF16 = torch.float32, torch.bfloat16
# (kind, strategy, heads_per_stage, docs, heads, scan backend, dtype)
CASES = {
    2: [  # (scan None: upipe's own, upipe.kernels_delta_rule)
        ("next", "upipe", None, DOCS, {}, None, F32),  # U = 2: a round of two stages
        ("next", "upipe", None, DOCS, {}, "torch", F32),  # transformers' own scan
        ("next", "upipe+keep", None, DOCS, {}, None, F32),  # stage inputs kept, not recomputed
        ("3.5", "ulysses", None, None, {}, None, F32),
        ("3.5", "upipe", 4, None, {}, None, F32),  # one stage of every head
        ("next", "upipe", None, None, {}, None, BF16),
        ("3.5", "ulysses", None, DOCS, {}, None, BF16),
    ],
    4: [
        ("next", "ulysses", None, DOCS, {}, None, F32),  # 2 key heads on 4 ranks: replicated
        ("3.5", "upipe", 4, DOCS, UNEVEN, None, F32),  # uneven: 2, 2, 1, 1 value heads
        ("3.5", "upipe+keep", 4, DOCS, UNEVEN, None, F32),
        ("next", "upipe", 8, None, dict(linear_num_value_heads=8), None, F32),  # two rounds
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
        ("next", "upipe", None, DOCS, {}, "fla", F32),
        ("3.5", "ulysses", None, None, {}, "fla", F32),
    ]
    results = clusters(2).run(W.run_layer_fla, cases)
    for case, per_rank in zip(cases, zip(*results, strict=True), strict=True):
        _check(case, per_rank)


OP_ERRORS = {
    "width": f"x must be [batch, local_seq, {W.D}], got (2, 64, 63)",
    "dtype": "x has dtype torch.float64 but the weights have torch.float32",
    "strategy": "strategy must be 'ulysses' or 'upipe', got 'ring'",
    "stages": "Gated DeltaNet (4 value heads, 2 key heads): heads_per_stage (3)",
    "reference": "the 'torch' scan needs reference=",
    "backend": "unknown scan backend 'triton'",
    "stage_inputs": "stage_inputs must be one of ('recompute', 'keep'), got 'offload'",
    "documents_rank1": "cu_seqlens must start at 0 and end at the full sequence length 128",
}


def test_bad_input_raises_on_every_rank(clusters):
    found = clusters(2).run(W.op_errors, tuple(OP_ERRORS))
    for rank, by_case in enumerate(found):
        for case, expected in OP_ERRORS.items():
            assert by_case[case] is not None, f"rank {rank}: {case} did not raise"
            assert expected in by_case[case], (rank, case, by_case[case])
