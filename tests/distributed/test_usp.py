"""2-D meshes: USP, UPipe and the module on ring x ulysses, against the float64 reference.

World size 4 as a 2x2 mesh (ring=2, ulysses=2) and the degenerate meshes ring=1 x ulysses=4
and ring=4 x ulysses=1 (plus dp=2 replicas). Every rank's rows are compared with the
reference rows of exactly the tokens it holds in the mesh layout, so a layout that is not the
ring's zigzag after the ulysses gather fails even if the set of all rows were right.
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerances import TOL, rel_err
from usp_workers import (
    make_mesh_errors,
    mesh_call_errors,
    mesh_functional_or_error,
    mesh_layout,
    mesh_replica_errors,
    meshes_made,
    run_mesh_functional,
    run_mesh_module,
)
from workers import make_qkv, module_reference, reference

from upipe.comm import sequence_positions
from upipe.heads import valid_heads_per_stage

FWD, BWD = TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"]
NAMES = ("out", "dq", "dk", "dv")
MESH_2x2, MESH_U4, MESH_R4 = (1, 2, 2), (1, 1, 4), (1, 4, 1)  # (dp, ring, ulysses)


def check_rows(results, refs):
    """Each rank's (out, dq, dk, dv) vs the reference rows at its positions, per dp replica;
    each replica's positions must partition the sequence. Returns the max errors."""
    worst = dict.fromkeys(NAMES, 0.0)
    covered = {}
    for rank, (dp, pos, got) in enumerate(results):
        covered.setdefault(dp, []).append(pos)
        for name, a, r in zip(NAMES, got, refs[dp], strict=True):
            err = rel_err(a, r[:, pos])
            assert err < (FWD if name == "out" else BWD), f"rank {rank} {name}: {err}"
            worst[name] = max(worst[name], err)
    S = refs[0][0].shape[1]
    for parts in covered.values():
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(S))
    return worst


USP_CASES = [  # (mesh, H, G, B): G divisible by the ulysses size; MQA only with ulysses=1
    (MESH_2x2, 4, 2, 2),
    (MESH_2x2, 4, 4, 1),
    (MESH_U4, 8, 4, 2),
    (MESH_R4, 4, 1, 1),
    (MESH_R4, 4, 2, 2),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims,H,G,B", USP_CASES)
def test_usp_matches_reference(clusters, dims, H, G, B, causal):
    shape = dict(B=B, S=32, H=H, G=G, d=8)
    res = clusters(4).run(run_mesh_functional, dims, "usp", shape, {"causal": causal})
    check_rows(res, [reference(*make_qkv(**shape), causal=causal)])


UPIPE_CASES = [  # (mesh, H, G, B, heads_per_stage): GQA, MQA with kv replication, U in {C, H}
    (MESH_2x2, 8, 2, 2, 2),
    (MESH_2x2, 4, 1, 1, 2),
    (MESH_2x2, 8, 8, 1, 8),
    (MESH_U4, 8, 2, 1, 4),
    (MESH_R4, 4, 1, 2, 1),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims,H,G,B,U", UPIPE_CASES)
def test_upipe_on_mesh_matches_reference(clusters, dims, H, G, B, U, causal):
    shape = dict(B=B, S=32, H=H, G=G, d=8)
    kwargs = {"causal": causal, "heads_per_stage": U}
    res = clusters(4).run(run_mesh_functional, dims, "upipe", shape, kwargs)
    check_rows(res, [reference(*make_qkv(**shape), causal=causal)])


@pytest.mark.parametrize("strategy", ["usp", "upipe"])
def test_contiguous_ring_layout_softmax_scale(clusters, strategy):
    shape = dict(B=1, S=32, H=4, G=2, d=8)
    kwargs = {"layout": "contiguous", "softmax_scale": 0.2}
    res = clusters(4).run(run_mesh_functional, MESH_2x2, strategy, shape, kwargs)
    check_rows(res, [reference(*make_qkv(**shape), softmax_scale=0.2)])


@pytest.mark.parametrize("dims", [(2, 1, 2), (2, 2, 1)])
def test_usp_with_dp_replicas(clusters, dims):
    """Each dp replica computes attention over its own sequence."""
    shape = dict(B=1, S=16, H=4, G=2, d=8)
    res = clusters(4).run(run_mesh_functional, dims, "usp", shape, {})
    check_rows(res, [reference(*make_qkv(**shape, seed=dp)) for dp in (0, 1)])


MODULE_CASES = [  # (mesh, num_heads, num_kv_heads, B, strategy, heads_per_stage, causal)
    (MESH_2x2, 4, 2, 2, "upipe", 2, True),
    (MESH_2x2, 8, 2, 1, "upipe", 4, False),
    (MESH_2x2, 4, 1, 1, "upipe", 2, True),
    (MESH_2x2, 4, 2, 1, "ulysses", None, True),
    (MESH_U4, 8, 4, 1, "upipe", 4, True),
    (MESH_R4, 4, 1, 2, "upipe", 1, True),
    (MESH_R4, 4, 2, 1, "ulysses", None, False),
]


@pytest.mark.parametrize("dims,H,G,B,strategy,U,causal", MODULE_CASES)
def test_module_on_mesh_matches_reference(clusters, dims, H, G, B, strategy, U, causal):
    cfg = dict(B=B, S=32, dim=32, num_heads=H, num_kv_heads=G, head_dim=8)
    kwargs = {"strategy": strategy, "heads_per_stage": U, "causal": causal}
    res = clusters(4).run(run_mesh_module, dims, cfg, kwargs)
    ref = module_reference(cfg, causal=causal)
    for rank, r in enumerate(res):
        assert rel_err(r["y"], ref["y"][:, r["pos"]]) < FWD, rank
        assert rel_err(r["dx"], ref["dx"][:, r["pos"]]) < BWD, rank
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # rank contributions sum to the grad
        assert rel_err(sum(r[name] for r in res), ref[name]) < BWD, name


@pytest.mark.parametrize("dims", [MESH_2x2, MESH_U4, MESH_R4, (2, 2, 1)])
def test_mesh_layout(clusters, dims):
    """Round trips; positions; after the ulysses all-to-all each rank holds exactly its ring
    rank's part in the ring layout (zigzag: chunks i and 2R-1-i, in that order)."""
    S = 16
    res = clusters(4).run(mesh_layout, dims, 2, S)
    dp, R, U = dims
    for r in res:
        assert r["default_is_zigzag"]
        for layout in ("zigzag", "contiguous"):
            got = r[layout]
            assert got["roundtrip_exact"] and got["positions_match"] and got["dim2_exact"]
            assert torch.equal(got["gathered"], got["ring_positions"]), (layout, r["coords"])
    for layout in ("zigzag", "contiguous"):
        for replica in range(dp):
            pos = [r[layout]["pos"] for r in res if r["coords"][0] == replica]
            assert torch.equal(torch.cat(pos).sort().values, torch.arange(S))
    if dims == MESH_2x2:  # ring rank 1 holds chunks 1 and 2 of 4 (4 tokens each)
        assert res[2]["zigzag"]["gathered"].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
        assert res[3]["zigzag"]["pos"].tolist() == [8, 9, 10, 11]


def test_one_dimensional_zigzag_is_not_the_mesh_layout():
    """What the gather check above catches: zigzag over all R*U ranks (a 1-D layout) leaves a
    ulysses group holding tokens that are not its ring rank's zigzag pair."""
    S, R, U = 16, 2, 2
    for ring_rank in range(R):
        naive = torch.cat(
            [
                sequence_positions(S, rank=ring_rank * U + j, world_size=R * U, layout="zigzag")
                for j in range(U)
            ]
        )
        ring = sequence_positions(S, rank=ring_rank, world_size=R, layout="zigzag")
        assert not torch.equal(naive, ring)


def test_make_mesh_errors(clusters):
    for r in clusters(4).run(make_mesh_errors):
        assert r["product"][0] == "ValueError"
        assert r["product"][1] == (
            "dp * ring * ulysses = 1 * 1 * 3 = 3 must equal the world size (4); use ulysses=4"
        )
        assert r["product dp"][1].endswith("= 6 must equal the world size (4); use dp=2")
        assert r["product neither"][1].endswith(
            "= 9 must equal the world size (4); choose degrees whose product is 4, e.g. "
            "ulysses=4, ring=1, dp=1"
        )
        assert r["zero"] == ("ValueError", "ring must be a positive int, got 0")
        assert r["bool"] == ("ValueError", "ulysses must be a positive int, got True")
        assert r["float"] == ("ValueError", "ulysses must be a positive int, got 2.0")


def test_make_mesh_makes_groups_once(clusters):
    """A second make_mesh with the same degrees returns the first mesh and makes no group;
    other degrees make their own; once the groups ended, a new mesh with working groups."""
    for r in clusters(4).run(meshes_made):
        assert r["first"] > 0
        assert r["again"] == (True, 0)
        assert r["other"][0] and r["other"][1] > 0
        assert r["after end"] == (True, True)


MESH_CALL_ERRORS = {  # case: (error type, pattern)
    "shard neither": ("ValueError", r"exactly one of group= \(1-D\) or mesh="),
    "shard both": ("ValueError", r"exactly one of group="),
    "shard length": (
        "ValueError",
        r"length 6 \(dim 1\) does not split over ring 2 x ulysses 2 .* multiple of 4 \(e\.g\. 8\)",
    ),
    "unshard both": ("ValueError", r"exactly one of group="),
    "positions both": ("ValueError", r"either rank= and world_size= \(1-D\) or mesh="),
    "positions neither": ("ValueError", r"pass rank= and world_size="),
    "usp not a mesh": ("TypeError", r"mesh must be a torch\.distributed\.device_mesh\.DeviceMesh"),
    "usp heads": ("ValueError", r"query heads \(1\) must be at least the ulysses size \(2\)"),
    "usp kv heads": ("ValueError", r"kv heads \(3\) must divide query heads \(4\)"),
    "usp one rank differs": ("ValueError", r"ranks disagree.*rank 0 has .*rank 3 has \(1, 6"),
    "upipe both": ("ValueError", r"exactly one of group="),
    "upipe layout on group": ("ValueError", r"unknown sequence layout 'diagonal'"),
    "upipe heads_per_stage": ("ValueError", r"heads_per_stage \(3\)"),
    "module both": ("ValueError", r"exactly one of group="),
    "module layout on group": ("ValueError", r"unknown sequence layout 'diagonal'"),
    "module heads": ("ValueError", r"num_heads \(1\) must be at least the ulysses size \(2\)"),
}


def test_mesh_argument_and_input_errors_on_every_rank(clusters):
    for rank, res in enumerate(clusters(4).run(mesh_call_errors)):
        for name, (err, pattern) in MESH_CALL_ERRORS.items():
            got = res[name]
            assert got is not None, f"rank {rank} did not raise for {name}"
            assert got[0] == err and re.search(pattern, got[1]), (rank, name, got)


def test_validation_spans_the_whole_mesh(clusters):
    """dp replicas may differ in shape; an invalid input in one replica fails every rank."""
    for rank, res in enumerate(clusters(4).run(mesh_replica_errors)):
        assert res["replicas differ"] is None
        err, msg = res["one replica bad"]
        assert err == "ValueError" and "query heads (1)" in msg
        if rank != 3:
            assert "rank 3 of the group rejected its input" in msg


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dims=st.sampled_from([MESH_2x2, MESH_U4, MESH_R4]),
    H=st.sampled_from([2, 3, 4, 6, 8]),
    G=st.sampled_from([1, 2, 3, 4, 8]),
    U=st.one_of(st.none(), st.integers(1, 8)),
    L=st.sampled_from([2, 4, 6]),
    causal=st.booleans(),
)
def test_property_upipe_on_mesh(clusters, dims, H, G, U, L, causal):
    """Every drawn 2-D config computes the right rows on every rank or raises the same
    ValueError on all of them."""
    _, R, C = dims
    shape = dict(B=1, S=R * C * L, H=H, G=G, d=4)
    kwargs = {"heads_per_stage": U, "causal": causal}
    res = clusters(4).run(mesh_functional_or_error, dims, "upipe", shape, kwargs)
    # any G dividing H and C <= H (split unevenly where C does not divide them)
    valid = H % G == 0 and H >= C and (U or C) in valid_heads_per_stage(H, G, C)
    if not valid:
        assert all(isinstance(r[0], str) and r[0] == "ValueError" for r in res), res
        assert len({r[1] for r in res}) == 1  # the same message on every rank
        return
    check_rows(res, [reference(*make_qkv(**shape), causal=causal)])
