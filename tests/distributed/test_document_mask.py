"""Document masking (`cu_seqlens`) in every strategy, against a float64 reference that
applies the S x S document mask explicitly (document_workers.py).

Boundary sets (S = 32; L = 8 tokens per rank at C = 4, zigzag chunks of 4): "mixed" has
one-token documents, one shorter than a shard and documents spanning several shards;
"random" is drawn (with an empty document, which is allowed and dropped); "single" is one
document (= plain causal attention).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from document_workers import (
    bad_docs,
    count_docs_layer,
    doc_mask,
    doc_reference,
    masked_attention,
    module_doc_reference,
    one_device,
    run_docs,
    run_docs_mesh,
    run_module_docs,
    run_module_docs_emulated,
    run_module_docs_mesh,
    varlen_calls,
)
from tolerances import TOL, bf16_bound, rel_err
from workers import make_module_inputs, make_weights

from upipe.attention.documents import block_calls, layout_segments
from upipe.packing import check_cu_seqlens, document_positions

S = 32
NAMES = ("out", "dq", "dk", "dv")


def _random_cu(seed, S=S):
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randperm(S - 1, generator=gen)[:5] + 1
    cu = [0, *sorted(inner.tolist()), S]
    return cu[:3] + [cu[2]] + cu[3:]  # a repeated boundary: an empty document


CU = {"mixed": [0, 1, 3, 14, 15, 29, S], "random": _random_cu(0), "single": [0, S]}


def _check(got, ref, tol_fwd, tol_bwd, names=NAMES):
    errs = {}
    for name, a, r in zip(names, got, ref, strict=True):
        errs[name] = rel_err(a, r)
        assert errs[name] < (tol_fwd if name in ("out", "y") else tol_bwd), (name, errs)
    return errs


# --- the boundaries themselves ----------------------------------------------------------


def test_check_cu_seqlens_normalises_and_positions_restart():
    assert check_cu_seqlens(torch.tensor([0, 3, 3, 8]), 8) == (0, 3, 8)
    assert check_cu_seqlens((0, 8), 8) == (0, 8)
    pos = document_positions(torch.tensor([0, 1, 4, 4, 6]), 6)
    assert pos.tolist() == [0, 0, 1, 2, 0, 1] and pos.dtype == torch.long


@pytest.mark.parametrize(
    "cu,match",
    [
        (torch.tensor([[0, 8]]), "1-D"),
        (torch.tensor([0.0, 8.0]), "integers"),
        (torch.tensor([1, 8]), "start at 0 and end at the full sequence length 8"),
        (torch.tensor([0, 7]), "end at the full sequence length 8"),
        (torch.tensor([0, 5, 3, 8]), r"cu_seqlens\[1\] = 5 > cu_seqlens\[2\] = 3"),
        ("0,8", "1-D integer tensor or a sequence of ints"),
    ],
)
def test_check_cu_seqlens_rejects(cu, match):
    with pytest.raises(ValueError, match=match):
        check_cu_seqlens(cu, 8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout,C", [("zigzag", 4), ("contiguous", 4), ("zigzag", 1)])
def test_block_calls_are_exactly_the_mask(layout, C, causal):
    """Every ring block's calls, over all (rank, source) pairs, cover each allowed (query,
    key) pair once and nothing else; each causal call is a same-length diagonal block."""
    for cu in CU.values():
        bounds, L = check_cu_seqlens(cu, S), S // C
        seen = torch.zeros(S, S, dtype=torch.long)
        for r in range(C):
            q_pos = torch.cat(
                [
                    torch.arange(s.start, s.start + s.length)
                    for s in layout_segments(layout, C, r, L)
                ]
            )
            for src in range(C):
                segs = layout_segments(layout, C, src, L)
                k_pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in segs])
                for qs, ks, c, (q0, k0) in block_calls(
                    bounds, layout_segments(layout, C, r, L), segs, causal
                ):
                    qi, ki = q_pos[qs], k_pos[ks]
                    assert (q0, k0) == (qi[0], ki[0])  # the calls' global positions
                    vis = torch.ones(len(qi), len(ki), dtype=torch.long)
                    if c:
                        assert torch.equal(qi, ki)
                        vis = vis.tril()
                    seen[qi[:, None], ki[None, :]] += vis
        assert torch.equal(seen, doc_mask(cu, S, causal).long())


# --- every strategy, fp32 ----------------------------------------------------------------

FUNCTIONAL = [  # (strategy, world, H, G, kwargs)
    ("ulysses", 1, 4, 2, {}),
    ("ulysses", 2, 4, 2, {"layout": "zigzag"}),
    ("ulysses", 4, 4, 4, {}),
    ("ulysses", 2, 4, 2, {"causal": False}),
    ("upipe", 2, 8, 2, {"heads_per_stage": 2}),
    ("upipe", 4, 8, 2, {"heads_per_stage": 8, "layout": "zigzag"}),
    ("upipe", 4, 8, 1, {}),  # MQA: the kv head replicated to every rank
    ("upipe", 2, 4, 4, {"heads_per_stage": 4}),
    ("ring", 1, 4, 2, {}),
    ("ring", 2, 4, 2, {}),
    ("ring", 4, 4, 1, {}),
    ("ring", 4, 4, 2, {"layout": "contiguous"}),
    ("ring", 4, 4, 4, {"causal": False}),
    ("ring", 2, 4, 2, {"layout": "contiguous", "causal": False}),
]


@pytest.mark.parametrize("cu_name", list(CU))
@pytest.mark.parametrize("strategy,world,H,G,kwargs", FUNCTIONAL)
def test_functional_matches_reference(clusters, strategy, world, H, G, kwargs, cu_name):
    shape = dict(B=2, S=S, H=H, G=G, d=8)
    got = clusters(world).run(run_docs, strategy, shape, kwargs, CU[cu_name])
    ref = doc_reference(shape, CU[cu_name], causal=kwargs.get("causal", True))
    for rank_result in got:  # every rank gathered the same full tensors
        _check(rank_result, ref, TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"])


MESH = [  # (strategy, kwargs) on ring 2 x ulysses 2
    ("usp", {"layout": "zigzag"}),
    ("usp", {"layout": "contiguous"}),
    ("upipe", {"layout": "zigzag"}),
]


@pytest.mark.parametrize("cu_name", ["mixed", "random"])
@pytest.mark.parametrize("strategy,kwargs", MESH)
def test_mesh_matches_reference(clusters, strategy, kwargs, cu_name):
    shape = dict(B=1, S=S, H=4, G=2, d=8)
    got = clusters(4).run(run_docs_mesh, (1, 2, 2), strategy, shape, kwargs, CU[cu_name])
    ref = doc_reference(shape, CU[cu_name])
    for pos, res in got:
        rows = [r[:, pos] for r in ref]
        _check(res, rows, TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"])


MODULE = [  # (world, strategy kwargs, kv heads)
    (2, {"strategy": "upipe"}, 2),
    (4, {"strategy": "upipe", "heads_per_stage": 8}, 2),
    (4, {"strategy": "upipe"}, 1),
    (2, {"strategy": "upipe", "layout": "zigzag", "overlap": True}, 2),
    (4, {"strategy": "ring"}, 2),
    (2, {"strategy": "ulysses"}, 2),
]


@pytest.mark.parametrize("world,kwargs,G", MODULE)
def test_module_matches_reference(clusters, world, kwargs, G):
    cfg = dict(B=2, S=S, dim=32, num_heads=8, num_kv_heads=G)
    got = clusters(world).run(run_module_docs, cfg, kwargs, CU["mixed"])
    ref = module_doc_reference(cfg, CU["mixed"])
    names = ("y", "dx", "q_proj", "k_proj", "o_proj")
    summed = {n: sum(r[n] for r in got) for n in names[2:]}  # weight grads: per-rank shares
    tol = TOL[torch.float32]["bwd"]
    _check([got[0]["y"], got[0]["dx"], *summed.values()], [ref[n] for n in names], tol, tol, names)


@pytest.mark.parametrize("strategy", ["upipe", "ulysses"])
def test_module_on_mesh_matches_reference(clusters, strategy):
    """The module on ring 2 x ulysses 2: fused UPipe with ring attention per stage, and
    Ulysses (= USP), both with documents."""
    cfg = dict(B=1, S=S, dim=32, num_heads=8, num_kv_heads=2)
    kwargs = {"strategy": strategy}
    got = clusters(4).run(run_module_docs_mesh, (1, 2, 2), cfg, kwargs, CU["mixed"])
    ref = module_doc_reference(cfg, CU["mixed"])
    tol = TOL[torch.float32]["bwd"]
    for r in got:
        _check(
            [r["y"], r["dx"]],
            [ref["y"][:, r["pos"]], ref["dx"][:, r["pos"]]],
            tol,
            tol,
            ("y", "dx"),
        )
    for n in ("q_proj", "k_proj", "o_proj"):
        assert rel_err(sum(r[n] for r in got), ref[n]) < tol, n


def test_model_plain_path_matches_reference():
    """The model's single-process Attention with cu_seqlens (one SDPA call per document)
    in float64, against the explicit mask; and the packed CausalLM's logits equal each
    document run on its own."""
    from upipe.model.config import ModelConfig
    from upipe.model.llama import Attention, CausalLM

    cfg = dict(B=2, S=S, dim=32, num_heads=8, num_kv_heads=2)
    ref = module_doc_reference(cfg, CU["mixed"])
    mc = ModelConfig(hidden_size=32, n_heads=8, n_kv_heads=2, head_dim=4, n_layers=1)
    attn = Attention(mc).double()
    with torch.no_grad():
        for n, t in make_weights(cfg).items():
            getattr(attn, n).weight.copy_(t)
    x, dy, _ = make_module_inputs(**cfg, dtype=torch.float64)
    x.requires_grad_()
    pos = document_positions(CU["mixed"], S)[None].expand(2, S)
    y = attn(x, pos, torch.tensor(CU["mixed"]))
    y.backward(dy)
    _check(
        [y, x.grad, attn.q_proj.weight.grad],
        [ref["y"], ref["dx"], ref["q_proj"]],
        1e-10,
        1e-10,
        ("y", "dx", "dq"),
    )

    model = CausalLM(ModelConfig(n_layers=2))
    model.init_weights(0)
    model.recompute_blocks = True
    ids = torch.randint(0, 257, (2, S), generator=torch.Generator().manual_seed(0))
    bounds = CU["mixed"]
    packed = model(ids, pos, cu_seqlens=torch.tensor(bounds))
    alone = torch.cat(
        [
            model(ids[:, a:b], torch.arange(b - a)[None].expand(2, -1))
            for a, b in itertools.pairwise(bounds)
        ],
        dim=1,
    )
    assert rel_err(packed, alone) < 1e-5


# --- bf16, and the CUDA path (emulated) --------------------------------------------------

BF16 = [  # (strategy, world, G, kwargs)
    ("ulysses", 2, 2, {}),
    ("upipe", 4, 2, {"heads_per_stage": 4}),
    ("ring", 4, 2, {}),
]


@pytest.mark.parametrize("strategy,world,G,kwargs", BF16)
def test_bf16_within_bound(clusters, strategy, world, G, kwargs):
    """bf16 error at most `bf16_bound` of one device running the same document-masked
    kernel calls in bf16 (the kernel's own error vs fp64; tolerances.py)."""
    shape, cu = dict(B=1, S=S, H=4, G=G, d=8), CU["mixed"]
    ref = doc_reference(shape, cu)
    single = one_device(shape, cu, torch.bfloat16)
    got = clusters(world).run(run_docs, strategy, shape, kwargs, cu, torch.bfloat16)
    for name, a, s, r in zip(NAMES, got[0], single, ref, strict=True):
        bound = bf16_bound(rel_err(s, r))
        assert rel_err(a, r) <= bound, (name, rel_err(a, r), bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strategy,kwargs", [("ulysses", {}), ("upipe", {}), ("ring", {})])
def test_cuda_path_emulated(clusters, strategy, kwargs, dtype):
    """backend="cuda" on CPU under the emulation of the CUDA kernels' contract
    (tests/helpers/cuda_emulation.py, tests/helpers/varlen_emulation.py). Ulysses/UPipe in bf16:
    one varlen
    flash call per stage (forward and backward) for all documents and batch rows; in fp32,
    and the ring always, per-document calls of the dense flash (bf16) or memory-efficient
    (fp32) kernels. d = 4 is padded to 8, B = 2 rows are packed."""
    shape, cu = dict(B=2, S=S, H=4, G=2, d=4), CU["random"]
    ref = doc_reference(shape, cu)
    kwargs = {"backend": "cuda", **kwargs}
    got = clusters(2).run(varlen_calls, strategy, shape, kwargs, cu, dtype)
    res, calls = got[0]
    stages = 1 if strategy == "ulysses" else 2  # upipe: H / U = 4 / 2 stages
    varlen = dtype == torch.bfloat16 and strategy != "ring"
    assert calls == ({"forward": stages, "backward": stages} if varlen else {}), calls
    if dtype == torch.float32:
        _check(res, ref, TOL[dtype]["fwd"], TOL[dtype]["bwd"])
    else:
        single = one_device(shape, cu, dtype)
        for a, s, r in zip(res, single, ref, strict=True):
            assert rel_err(a, r) <= bf16_bound(rel_err(s, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_module_cuda_path_emulated(clusters, dtype):
    """The fused UPipe module on the emulated CUDA path (varlen in bf16), fwd + bwd."""
    cfg = dict(B=2, S=S, dim=64, num_heads=8, num_kv_heads=2)
    got = clusters(2).run(run_module_docs_emulated, cfg, {"strategy": "upipe"}, CU["mixed"], dtype)
    ref = module_doc_reference(cfg, CU["mixed"])
    names = ("y", "dx", "q_proj", "k_proj", "o_proj")
    summed = [sum(r[n] for r in got) for n in names[2:]]
    tol = TOL[torch.float32]["bwd"] if dtype == torch.float32 else TOL[dtype]["bwd"]
    _check([got[0]["y"], got[0]["dx"], *summed], [ref[n] for n in names], tol, tol, names)


# --- validation and counts ---------------------------------------------------------------


@pytest.mark.parametrize(
    "cu,match",
    [
        ((0, 5, 3, S), "must not decrease"),
        ((0, 16), f"end at the full sequence length {S}"),
        (torch.tensor([0.0, S]), "integers"),
    ],
)
@pytest.mark.parametrize("strategy", ["ulysses", "upipe", "ring"])
def test_bad_cu_seqlens_same_error_everywhere(clusters, strategy, cu, match):
    shape = dict(B=1, S=S, H=4, G=2, d=8)
    got = clusters(2).run(bad_docs, strategy, shape, cu)
    assert got[0] is not None and got[0][0] == "ValueError" and match in got[0][1], got
    assert got[1] == got[0]


def test_bad_cu_seqlens_on_one_rank_fails_every_rank(clusters):
    shape = dict(B=1, S=S, H=4, G=2, d=8)
    got = clusters(2).run(bad_docs, "upipe", shape, [[0, 8, S], [0, 9, 8, S]])
    assert got[1][0] == "ValueError" and "must not decrease" in got[1][1]
    assert got[0][0] == "ValueError" and "rank 1 of the group rejected its input" in got[0][1]


def test_documents_add_no_collective_and_no_sync_from_ints(clusters):
    """After the first call, a layer call with cu_seqlens given as ints issues the same
    collectives as without and no host sync; a tensor costs one `.tolist()` (a host sync
    on CUDA) per call."""
    cfg = dict(B=1, S=S, dim=32, num_heads=4, num_kv_heads=2)
    counts = clusters(2).run(count_docs_layer, cfg, CU["mixed"])[0]
    plain, ints, tensor = ({k: v for k, v in c.items() if v} for c in counts)
    assert ints == plain and not any("sync" in k for k in plain), (plain, ints)
    assert tensor == {**plain, "host sync: tolist": 1}, tensor


def test_masked_attention_reference_is_plain_causal_for_one_document():
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64) for _ in range(3))
    s = torch.einsum("bshd,bthd->bhst", q, k) * 0.5
    s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    plain = torch.einsum("bhst,bthd->bshd", s.softmax(-1), v)
    assert torch.allclose(masked_attention(q, k, v, doc_mask([0, 8], 8, True)), plain)
