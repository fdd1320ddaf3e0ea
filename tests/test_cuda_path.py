"""upipe's CUDA path (`backend="cuda"`) on CPU, under the emulation of the CUDA-only aten
ops (cuda_emulation.py: flash and memory-efficient SDPA forward/backward, out_dtype GEMMs,
each held to its contract in torch 2.13's sources): every strategy, forward and backward,
fp32 (memory-efficient kernel) and bf16 (flash kernel), against the float64 reference on
gloo ranks. Before the fixes of this file's regressions, bf16 failed at the first backward
(a defined empty cum_seq_q selects flash's varlen kernel) and bf16 with replicated kv heads
failed in index_add_."""

from __future__ import annotations

import collections

import cuda_emulation
import cuda_workers
import fake_flash_attn
import pytest
import torch
from conftest import TOL, bf16_bound, rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from workers import make_qkv, module_reference, reference_and_one_device, run_module_on

from upipe import kernels
from upipe.memory.simulate import fake_process_group

NAMES = ("out", "dq", "dk", "dv")
DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


@pytest.fixture(scope="module", autouse=True)
def emulated():
    cuda_emulation.install()


def _bounds(shape, dtype, backend="cuda"):
    """Allowed relative error per tensor: fp32's tolerance, or in bf16 a multiple of what one
    device running `backend`'s kernel (the emulated CUDA one) on the whole sequence gets
    wrong."""
    ref, one = reference_and_one_device(shape, dtype, backend=backend)
    if dtype == torch.float32:
        tol = TOL[torch.float32]
        return ref, [tol["fwd"]] + [tol["bwd"]] * 3
    return ref, [bf16_bound(rel_err(a, r)) for a, r in zip(one, ref, strict=True)]


def _check(full, ref, bounds):
    for name, got, want, bound in zip(NAMES, full, ref, bounds, strict=True):
        err = rel_err(got, want)
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


def _placed(results, S):
    """Full tensors from per-rank (positions, [out, dq, dk, dv]) results."""
    full = [None] * 4
    for pos, got in results:
        for i, t in enumerate(got):
            if full[i] is None:
                full[i] = t.new_zeros(t.shape[0], S, *t.shape[2:])
            full[i][:, pos] = t
    return full


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(
    "strategy,C,H,G,d,kwargs",
    [
        ("ulysses", 2, 8, 2, 8, {}),
        ("upipe", 2, 8, 2, 8, {}),
        ("upipe", 4, 8, 2, 8, {"heads_per_stage": 4}),  # G < C: kv heads replicated
        ("upipe", 2, 4, 1, 8, {}),  # MQA
        ("upipe", 2, 4, 2, 6, {}),  # head dim padded to 8 for both kernels
    ],
)
def test_functional_cuda_path(clusters, strategy, C, H, G, d, kwargs, dtype):
    shape = dict(B=2, S=16 * C, H=H, G=G, d=d)
    ref, bounds = _bounds(shape, dtype)
    res = clusters(C).run(cuda_workers.functional, strategy, shape, kwargs, dtype)
    full = [torch.cat([r[i] for r in res], 1) for i in range(4)]
    _check(full, ref, bounds)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_cuda_path(clusters, layout, dtype):
    shape = dict(B=1, S=128, H=8, G=4, d=16)  # as test_ring's bf16 test
    ref, bounds = _bounds(shape, dtype)
    res = clusters(4).run(cuda_workers.ring, shape, {"layout": layout}, dtype)
    _check(_placed(res, shape["S"]), ref, bounds)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("strategy,G", [("usp", 4), ("upipe", 4), ("upipe", 1)])
def test_mesh_cuda_path(clusters, strategy, G, dtype):
    """2 ring x 2 ulysses: USP, and UPipe stages run as ring attention (G = 1: the kv head
    replicated over the ulysses ranks, whose bf16 backward used to fail in index_add_)."""
    shape = dict(B=1, S=128, H=8, G=G, d=16)
    ref, bounds = _bounds(shape, dtype)
    res = clusters(4).run(cuda_workers.mesh, (1, 2, 2), strategy, shape, {}, dtype)
    _check(_placed([(pos, got) for _, pos, got in res], shape["S"]), ref, bounds)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("strategy", ["upipe", "ulysses", "ring"])
def test_module_cuda_path(clusters, strategy, dtype):
    """The layer (projections, RoPE, o_proj): bf16 within the bound that the CPU path's
    module test uses (test_upipe.py), fp32 within fp32's tolerance."""
    cfg = dict(B=1, S=32, dim=64, num_heads=8, num_kv_heads=2, head_dim=8)
    ref = module_reference(cfg)
    kwargs = {"strategy": strategy, "layout": "contiguous"}  # run_module shards contiguously
    res = clusters(2).run(cuda_workers.module, cfg, kwargs, dtype)
    y = torch.cat([r["y"] for r in res], 1)
    dx = torch.cat([r["dx"] for r in res], 1)
    tol = TOL[torch.float32]["bwd"] if dtype == torch.float32 else TOL[torch.bfloat16]["bwd"]
    assert rel_err(y, ref["y"]) < tol
    assert rel_err(dx, ref["dx"]) < tol
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert rel_err(sum(r[n] for r in res), ref[n]) < tol, n


def test_flash_backward_gets_undefined_cum_seq():
    """Regression: the dense flash backward needs cum_seq_q undefined (None); the emulation
    rejects a defined empty tensor as the varlen kernel does."""
    q, k, v, dout = (t.bfloat16() for t in make_qkv(B=1, S=16, H=4, G=2, d=8))
    out, lse = kernels.attention_forward(q, k, v, backend="cuda")
    kernels.attention_backward(dout, q, k, v, out, lse, backend="cuda")  # passes
    empty = torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)),
            lse,
            empty,
            empty,
            16,
            16,
            0.0,
            True,
            torch.empty(0, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64),
        )


def test_flash_path_keeps_gqa_heads(monkeypatch):
    """The flash kernels get the kv heads as they are (GQA native); only the memory-efficient
    kernel (fp32), which needs equal head counts, gets them expanded."""
    seen = {}
    flash, eff = (
        torch.ops.aten._scaled_dot_product_flash_attention,
        torch.ops.aten._scaled_dot_product_efficient_attention,
    )

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (flash.default, eff.default):
                seen[func.__name__.split(".")[0]] = args[1].shape[1]
            return func(*args, **(kwargs or {}))

    for dtype in DTYPES:
        q, k, v, _ = (t.to(dtype) for t in make_qkv(B=1, S=16, H=8, G=2, d=8))
        with Spy():
            kernels.attention_forward(q, k, v, backend="cuda")
    assert seen == {
        "_scaled_dot_product_flash_attention": 2,
        "_scaled_dot_product_efficient_attention": 8,
    }


def test_default_backend_follows_dtype(monkeypatch):
    """With flash-attn installed, fp32 still goes to torch's kernel (flash-attn rejects it);
    a flash-attn older than 2.7 (other backward arguments) is never picked, and asking for
    it explicitly is a clear error."""
    cuda = torch.device("cuda")
    for version, half, fp32 in (((2, 7), "flash_attn", "cuda"), ((2, 6), "cuda", "cuda")):
        monkeypatch.setattr(kernels, "flash_attn_version", lambda v=version: v)
        assert kernels.default_backend(cuda, torch.bfloat16) == half
        assert kernels.default_backend(cuda, torch.float32) == fp32
    q, k, v, _ = (t.bfloat16() for t in make_qkv(B=1, S=8, H=2, G=2, d=8))
    with pytest.raises(ValueError, match=r"flash-attn package >= 2.7 \(version 2.6\)"):
        kernels.attention_forward(q, k, v, backend="flash_attn")
    monkeypatch.setattr(kernels, "flash_attn_version", lambda: (2, 8))
    with pytest.raises(ValueError, match="takes fp16/bf16 inputs"):
        kernels.attention_forward(q.float(), k.float(), v.float(), backend="flash_attn")
    monkeypatch.setattr(kernels, "flash_attn_version", lambda: None)
    assert kernels.default_backend(cuda, torch.bfloat16) == "cuda"


def test_fused_op_uses_out_dtype_gemms():
    """On the CUDA path the fused op sums bf16 products into its fp32 accumulators (y, dx)
    with the out_dtype GEMM (tensor cores) instead of casting stage tensors to fp32 -- and
    the layer is still right."""
    cfg = dict(B=1, S=16, dim=32, num_heads=4, num_kv_heads=2, head_dim=8)
    ops = collections.Counter()

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with fake_process_group(1) as group, Spy():
        res = run_module_on(group, cfg, {"strategy": "upipe", "backend": "cuda"}, torch.bfloat16)
    assert ops["aten.addmm.dtype_out"] >= 2, ops
    ref = module_reference(cfg)
    for name in ("y", "dx", "q_proj", "k_proj", "v_proj", "o_proj"):
        assert rel_err(res[name], ref[name]) < TOL[torch.bfloat16]["bwd"], name


@pytest.mark.parametrize("d", [8, 6])
@pytest.mark.parametrize("G", [4, 1])
def test_flash_attn_package_path(monkeypatch, d, G):
    """backend="flash_attn" against a stand-in with the package's 2.7 contract: the backward's
    keyword arguments, head dims padded to a multiple of 8 for the backward, GQA native."""
    fake_flash_attn.install(monkeypatch)
    monkeypatch.setattr(kernels, "flash_attn_version", lambda: (2, 7))
    shape = dict(B=2, S=32, H=4, G=G, d=d)
    ref, bounds = _bounds(shape, torch.bfloat16, backend="cpu")  # the stand-in's numbers
    q, k, v, dout = (t.bfloat16() for t in make_qkv(**shape))
    out, lse = kernels.attention_forward(q, k, v, backend="flash_attn")
    grads = kernels.attention_backward(dout, q, k, v, out, lse, backend="flash_attn")
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _check((out, *grads), ref, bounds)


def test_agreement_runs_on_the_inputs_gpu(clusters):
    """The first call's validation exchange enters the inputs' device; the second (agreed
    signature) exchanges nothing."""
    for rank, entered in enumerate(clusters(2).run(cuda_workers.agreement_device)):
        assert entered == [torch.device("cuda", rank)]
