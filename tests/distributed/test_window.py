"""Sliding-window attention (`window=`) in every strategy, against a float64 reference that
applies the S x S mask (same document, causal, i - t < window) explicitly.

S = 32; L = 8 tokens per rank at C = 4 (zigzag chunks of 4). Windows: 1 (a token sees only
itself), 3 and 5 (shorter than a shard and a zigzag chunk), 12 (spans shards), 40 (longer
than the sequence: plain causal attention).
"""

from __future__ import annotations

import random

import pytest
import torch
from document_workers import (
    doc_reference,
    module_doc_reference,
    one_device,
    run_docs,
    run_docs_mesh,
    run_module_docs,
    run_module_docs_mesh,
    varlen_calls,
)
from tolerances import TOL, bf16_bound, rel_err

from upipe.attention import window as sliding

S = 32
NAMES = ("out", "dq", "dk", "dv")
CU = {"single": [0, S], "mixed": [0, 1, 3, 14, 15, 29, S]}
WINDOWS = (1, 3, 5, 12, 40)


def _check(got, ref, names=NAMES, dtype=torch.float32):
    errs = {n: rel_err(a, r) for n, a, r in zip(names, got, ref, strict=True)}
    for n, e in errs.items():
        assert e < TOL[dtype]["fwd" if n in ("out", "y") else "bwd"], (n, errs)


# --- the tiling --------------------------------------------------------------------------


def test_band_calls_cover_the_band_exactly_once():
    """For drawn blocks (rows at q0.., keys at k0.., window w) the calls' masks are disjoint
    and their union is exactly {(i, j): 0 <= i - j < w}; causal and flipped calls are
    square."""
    rng = random.Random(0)
    for _ in range(2000):
        M, N = rng.randint(1, 14), rng.randint(1, 14)
        q0, k0, w = rng.randint(0, 30), rng.randint(0, 30), rng.randint(1, 20)
        seen = set()
        for rows, keys, kind in sliding.band_calls(q0, M, k0, N, w):
            if kind != sliding.FULL:
                assert rows.stop - rows.start == keys.stop - keys.start
            for m in range(rows.start, rows.stop):
                for n in range(keys.start, keys.stop):
                    dm, dn = m - rows.start, n - keys.start
                    if (kind == sliding.CAUSAL and dn > dm) or (
                        kind == sliding.FLIPPED and dn < dm
                    ):
                        continue
                    assert (m, n) not in seen, (q0, M, k0, N, w)
                    seen.add((m, n))
        band = {(m, n) for m in range(M) for n in range(N) if 0 <= (q0 + m) - (k0 + n) < w}
        assert seen == band, (q0, M, k0, N, w)


@pytest.mark.parametrize("S_,w", [(4096, 256), (4096, 64), (1000, 37)])
def test_work_is_proportional_to_the_window(S_, w):
    """The scores the calls compute (a causal square of n counts n(n+1)/2) stay within
    S * w + S (the band's area plus the tiles' diagonals), not S^2 / 2."""
    work = 0
    for rows, keys, kind in sliding.band_calls(0, S_, 0, S_, w):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        work += n * m if kind == sliding.FULL else n * (n + 1) // 2
    band = sum(min(i + 1, w) for i in range(S_))
    assert band <= work <= band + S_, (work, band)
    assert work < S_ * S_ / 2 * (2 * w / S_ + 0.01)


def test_masked_tiles_cover_the_band_exactly_once():
    """For drawn blocks and tile heights the masked calls' visible entries are disjoint, their
    union is exactly the band, and every row of a call sees a key (the CPU kernel would give
    a row it hides entirely lse 0)."""
    rng = random.Random(1)
    for _ in range(2000):
        M, N = rng.randint(1, 14), rng.randint(1, 14)
        q0, k0, w, T = rng.randint(0, 30), rng.randint(0, 30), rng.randint(1, 20), rng.randint(1, 6)
        band_T = sliding.band_mask(T, w, "cpu")
        seen = set()
        for rows, keys, col in sliding.masked_tiles(q0, M, k0, N, w, T):
            mask = band_T[: rows.stop - rows.start, col : col + keys.stop - keys.start]
            assert mask.shape == (rows.stop - rows.start, keys.stop - keys.start)
            assert keys.start >= 0 and keys.stop <= N and rows.stop - rows.start <= T
            assert bool((mask == 0).any(dim=1).all()), (q0, M, k0, N, w, T)
            for dm, dn in (mask == 0).nonzero().tolist():
                m, n = rows.start + dm, keys.start + dn
                assert (m, n) not in seen, (q0, M, k0, N, w, T)
                seen.add((m, n))
        band = {(m, n) for m in range(M) for n in range(N) if 0 <= (q0 + m) - (k0 + n) < w}
        assert seen == band, (q0, M, k0, N, w, T)


@pytest.mark.parametrize("S_,w", [(4096, 1024), (4096, 64), (1000, 37)])
def test_masked_work_is_the_window_plus_the_tile(S_, w):
    """The masked calls compute T (T + w - 1) scores a tile of T rows: at most w + T - 1 a
    row (T = `MASKED_ROWS`)."""
    T = sliding.MASKED_ROWS
    tiles = sliding.masked_tiles(0, S_, 0, S_, w, T)
    work = sum((r.stop - r.start) * (k.stop - k.start) for r, k, _ in tiles)
    assert len(tiles) == -(-S_ // T) and work <= S_ * (w + T - 1), (work, S_ * (w + T - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("q0,M,k0,N,w", [(0, 100, 0, 100, 13), (100, 40, 60, 40, 25),
                                          (0, 64, 0, 64, 64), (37, 50, 0, 90, 1)])  # fmt: skip
def test_masked_calls_match_the_reference(monkeypatch, q0, M, k0, N, w, dtype):
    """`forward` / `backward` of a block on the CPU kernel, in many tiles (T = 8), against the
    float64 kernel on the whole block with the band as its mask; rows that see no key get out
    0 and lse -inf. (fp64 inputs take an fp64 mask: the CPU kernel gave wrong results with an
    fp32 one.)"""
    from upipe.kernels import attention_backward, attention_forward

    monkeypatch.setattr(sliding, "MASKED_ROWS", 8)
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, M, 4, 16, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, N, 2, 16, generator=gen, dtype=dtype) for _ in range(2))
    kw = dict(q0=q0, k0=k0, window=w, softmax_scale=None, backend="cpu")
    out, lse = sliding.forward(q, k, v, **kw)
    grads = sliding.backward(dout, q, k, v, out, lse, **kw)
    i, j = torch.arange(q0, q0 + M)[:, None], torch.arange(k0, k0 + N)[None, :]
    sees = (i - j >= 0) & (i - j < w)
    rows = sees.any(dim=1)
    mask = torch.zeros(M, N, dtype=torch.float64).masked_fill_(~sees, float("-inf"))[rows]
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = attention_forward(q64[:, rows], k64, v64, causal=False, mask=mask,
                                         backend="reference")  # fmt: skip
    ref = attention_backward(do64[:, rows], q64[:, rows], k64, v64, ref_out, ref_lse,
                             causal=False, mask=mask, backend="reference")  # fmt: skip
    tol = TOL[torch.float32] if dtype == torch.float32 else {"fwd": 1e-12, "bwd": 1e-12}
    assert rel_err(out[:, rows], ref_out) < tol["fwd"]
    assert rel_err(lse[:, :, rows], ref_lse) < tol["fwd"]
    assert not out[:, ~rows].any() and bool((lse[:, :, ~rows] == float("-inf")).all())
    for got, want in zip((grads[0][:, rows], *grads[1:]), ref, strict=True):
        assert rel_err(got, want) < tol["bwd"]
    assert not grads[0][:, ~rows].any()


def test_a_mask_of_the_wrong_dtype_or_shape_is_refused():
    from upipe.kernels import attention_forward

    q = torch.zeros(1, 4, 2, 8)
    for mask, says in ((torch.zeros(4, 4, dtype=torch.float64), "torch.float32 \\[4, 4\\]"),
                       (torch.zeros(4, 3), "got torch.float32 \\(4, 3\\)")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            attention_forward(q, q, q, causal=False, mask=mask, backend="cpu")
    with pytest.raises(ValueError, match="a mask runs on the"):
        attention_forward(q, q, q, causal=False, mask=torch.zeros(4, 4), backend="efficient")


# --- every strategy ----------------------------------------------------------------------

FUNCTIONAL = [  # (strategy, world, H, G, kwargs)
    ("ulysses", 2, 4, 2, {}),
    ("ulysses", 4, 4, 4, {}),
    ("ulysses", 4, 6, 2, {}),  # uneven heads
    ("upipe", 2, 8, 2, {"heads_per_stage": 2}),
    ("upipe", 4, 8, 2, {"heads_per_stage": 8, "layout": "zigzag"}),
    ("upipe", 4, 8, 1, {}),  # MQA: the kv head replicated
    ("ring", 2, 4, 2, {}),
    ("ring", 4, 4, 1, {}),
    ("ring", 4, 4, 2, {"layout": "contiguous"}),
]


@pytest.mark.parametrize("w", WINDOWS)
@pytest.mark.parametrize("strategy,world,H,G,kwargs", FUNCTIONAL)
def test_functional_matches_reference(clusters, strategy, world, H, G, kwargs, w):
    shape = dict(B=2, S=S, H=H, G=G, d=8)
    cu = CU["mixed"] if w in (3, 12) else CU["single"]  # with and without documents
    got = clusters(world).run(run_docs, strategy, shape, {**kwargs, "window": w}, cu)
    ref = doc_reference(shape, cu, window=w)
    for rank_result in got:
        _check(rank_result, ref)


@pytest.mark.parametrize("w", [3, 12])
@pytest.mark.parametrize("strategy,kwargs", [("usp", {}), ("usp", {"layout": "contiguous"}),
                                             ("upipe", {})])  # fmt: skip
def test_mesh_matches_reference(clusters, strategy, kwargs, w):
    """Ring 2 x ulysses 2: each stage's ring skips the steps the window excludes."""
    shape = dict(B=1, S=S, H=4, G=2, d=8)
    cu = CU["mixed"] if w == 3 else CU["single"]
    got = clusters(4).run(run_docs_mesh, (1, 2, 2), strategy, shape, {**kwargs, "window": w}, cu)
    ref = doc_reference(shape, cu, window=w)
    for pos, res in got:
        _check(res, [r[:, pos] for r in ref])


MODULE = [  # (world, strategy kwargs, kv heads)
    (2, {"strategy": "upipe"}, 2),
    (4, {"strategy": "upipe", "heads_per_stage": 8}, 1),
    (2, {"strategy": "upipe", "layout": "zigzag", "overlap": True}, 2),
    (4, {"strategy": "ring"}, 2),
    (2, {"strategy": "ulysses"}, 2),
]


@pytest.mark.parametrize("world,kwargs,G", MODULE)
def test_module_matches_reference(clusters, world, kwargs, G):
    """ContextParallelAttention(window=5) with documents: y, dx and the weight gradients
    (the fused UPipe op recomputes its projections in backward)."""
    cfg = dict(B=2, S=S, dim=32, num_heads=8, num_kv_heads=G)
    got = clusters(world).run(run_module_docs, cfg, {**kwargs, "window": 5}, CU["mixed"])
    ref = module_doc_reference(cfg, CU["mixed"], window=5)
    names = ("y", "dx", "q_proj", "k_proj", "o_proj")
    summed = {n: sum(r[n] for r in got) for n in names[2:]}
    _check([got[0]["y"], got[0]["dx"], *summed.values()], [ref[n] for n in names], names)


def test_module_on_mesh_matches_reference(clusters):
    cfg = dict(B=1, S=S, dim=32, num_heads=8, num_kv_heads=2)
    kwargs = {"strategy": "upipe", "window": 6}
    got = clusters(4).run(run_module_docs_mesh, (1, 2, 2), cfg, kwargs, CU["mixed"])
    ref = module_doc_reference(cfg, CU["mixed"], window=6)
    for r in got:
        _check([r["y"], r["dx"]], [ref["y"][:, r["pos"]], ref["dx"][:, r["pos"]]], ("y", "dx"))


@pytest.mark.parametrize("strategy,world,kwargs", [("ulysses", 2, {}),
                                                   ("upipe", 4, {"heads_per_stage": 4}),
                                                   ("ring", 4, {})])  # fmt: skip
def test_bf16_within_bound(clusters, strategy, world, kwargs):
    """bf16 error at most `bf16_bound` of one device running the windowed calls in bf16 (dk
    and dv of the head splits: sums over the world / G ranks whose query heads share a kv
    head)."""
    shape, cu, w = dict(B=1, S=S, H=4, G=2, d=8), CU["mixed"], 5
    ref = doc_reference(shape, cu, window=w)
    single = one_device(shape, cu, torch.bfloat16, window=w)
    got = clusters(world).run(
        run_docs, strategy, shape, {**kwargs, "window": w}, cu, torch.bfloat16
    )
    sharing = max(1, world // shape["G"]) if strategy != "ring" else 1
    for name, a, s, r in zip(NAMES, got[0], single, ref, strict=True):
        summed = sharing if name in ("dk", "dv") else 1
        assert rel_err(a, r) <= bf16_bound(rel_err(s, r), summed), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strategy", ["ulysses", "upipe", "ring"])
def test_cuda_path_emulated(clusters, strategy, dtype):
    """backend="cuda" under the emulated CUDA contracts: Ulysses/UPipe in bf16 make one varlen
    flash call per stage with the native window (window_size_left = w - 1, right 0) for all
    documents and rows; fp32 (memory-efficient kernel) and the ring run the tiled calls."""
    shape, cu, w = dict(B=2, S=S, H=4, G=2, d=4), CU["mixed"], 5
    ref = doc_reference(shape, cu, window=w)
    kwargs = {"backend": "cuda", "window": w}
    res, calls = clusters(2).run(varlen_calls, strategy, shape, kwargs, cu, dtype)[0]
    stages = 1 if strategy == "ulysses" else 2
    varlen = dtype == torch.bfloat16 and strategy != "ring"
    if varlen:
        assert calls == {"forward": stages, "backward": stages}, calls
    if dtype == torch.float32:
        _check(res, ref)
    else:
        single = one_device(shape, cu, dtype, window=w)
        for a, s, r in zip(res, single, ref, strict=True):
            assert rel_err(a, r) <= bf16_bound(rel_err(s, r))


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window,causal,match",
    [(0, True, "positive int"), (-3, True, "positive int"), (2.5, True, "positive int"),
     (True, True, "positive int"), (4, False, "needs causal=True")],
)  # fmt: skip
def test_bad_window_raises_on_every_rank(clusters, window, causal, match):
    shape = dict(B=1, S=S, H=4, G=2, d=8)
    kwargs = {"window": window, "causal": causal}
    got = clusters(2).run(_bad_window, shape, kwargs)
    assert all(e is not None and match in e for e in got), got


def _bad_window(rank, world_size, shape, kwargs):
    import torch.distributed as dist
    from workers import make_qkv

    import upipe

    q, k, v, _ = make_qkv(**shape)
    L = shape["S"] // world_size
    errors = []
    for op in (upipe.ulysses_attention, upipe.upipe_attention, upipe.ring_attention):
        try:
            op(q[:, :L], k[:, :L], v[:, :L], group=dist.group.WORLD, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    return errors[0] if len(errors) == 3 and len(set(errors)) == 1 else None


def test_module_rejects_a_bad_window_at_construction(clusters):
    got = clusters(2).run(_bad_module)
    assert all("positive int" in e for e in got), got


def _bad_module(rank, world_size):
    import torch.distributed as dist

    import upipe

    try:
        upipe.ContextParallelAttention(32, 4, 2, group=dist.group.WORLD, window=0)
    except ValueError as e:
        return str(e)
    return "no error"


# --- the model ---------------------------------------------------------------------------


@pytest.mark.parametrize("w,cu", [(1, None), (5, None), (7, [0, 3, 20, S]), (40, None)])
def test_model_attention_matches_reference(w, cu):
    """The one-process model's sliding-window attention (SDPA per tile, `model.llama`), y
    and dx, against the fp64 masked reference; the reference of every strategy's parity."""
    from document_workers import doc_mask, masked_attention

    from upipe.model.config import get_config
    from upipe.model.llama import Attention
    from upipe.rope import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    cfg = get_config("tiny", hidden_size=32, n_heads=4, n_kv_heads=2, head_dim=8)
    attn = Attention(cfg, window=w).double()
    x = torch.randn(2, S, 32, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(S)[None].expand(2, S)
    y = attn(x, pos, cu_seqlens=cu)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    cos, sin = rope_cos_sin(pos, 8, theta=cfg.rope_theta, dtype=torch.float64)
    xr = x.detach().requires_grad_()
    q = apply_rope(attn.q_proj(xr).view(2, S, 4, 8), cos, sin)
    k = apply_rope(attn.k_proj(xr).view(2, S, 2, 8), cos, sin)
    v = attn.v_proj(xr).view(2, S, 2, 8)
    yr = attn.o_proj(masked_attention(q, k, v, doc_mask(cu or [0, S], S, True, w)).flatten(2))
    (dxr,) = torch.autograd.grad(yr, xr, dy)
    assert rel_err(y, yr) < 1e-12 and rel_err(dx, dxr) < 1e-12


def test_layer_types_choose_each_layers_window():
    from upipe.model.config import ModelConfig, get_config

    cfg = get_config("tiny-sliding")
    assert [cfg.layer_window(i) for i in range(4)] == [64, None, 64, None]
    assert ModelConfig(sliding_window=8).layer_window(1) == 8  # no layer_types: all slide
    with pytest.raises(ValueError, match="must list 2 entries"):
        ModelConfig(sliding_window=8, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="set sliding_window"):
        ModelConfig(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="positive int"):
        ModelConfig(sliding_window=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,kw",
    [(2, {"strategy": "upipe"}), (4, {"strategy": "ring"}), (4, {"strategy": "usp"}),
     (2, {"strategy": "ulysses", "activation_checkpoint": True, "tiled_mlp": True})],
)  # fmt: skip
def test_training_a_mixed_stack_equals_one_process(clusters, world, kw):
    """tiny-sliding (window 64 on layers 0 and 2, full attention on 1 and 3) over 128
    tokens: losses and every gradient as in one process."""
    from train_workers import check_training, small_config, train_steps

    ref = clusters(1).run(train_steps, small_config(model="tiny-sliding", strategy="none"))[0]
    check_training(
        clusters(world).run(train_steps, small_config(model="tiny-sliding", **kw))[0], ref
    )
