"""upipe's CUDA path (`backend="cuda"`) on CPU, under the emulation of the CUDA-only aten
ops (cuda_emulation.py: flash and memory-efficient SDPA forward/backward, out_dtype GEMMs,
each held to its contract in torch 2.13's sources): every strategy, forward and backward,
fp32 (memory-efficient kernel) and bf16 (flash kernel), against the float64 reference on
gloo ranks. Before the fixes of this file's regressions, bf16 failed at the first backward
(a defined empty cum_seq_q selects flash's varlen kernel) and bf16 with replicated kv heads
failed in index_add_."""

from __future__ import annotations

import collections
import contextlib

import cuda_emulation
import cuda_workers
import fake_flash_attn
import kernel_workers
import pytest
import torch
from tolerances import TOL, bf16_bound, rel_err
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
    """On an A100 (sm80) auto takes the flash-attn package for fp16/bf16 when a supported
    version is installed, and fp32 goes to torch's memory-efficient kernel (flash-attn
    rejects it); a flash-attn older than 2.7 (other backward arguments) is never picked, and
    asking for it explicitly is a clear error. (The rule on other GPUs:
    test_kernel_select.py.)"""
    from upipe import kernels_select

    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels_select, "device_capability", lambda d: (8, 0))
    for version, half in (((2, 7), "flash_attn"), ((2, 6), "flash")):
        monkeypatch.setattr(kernels_select, "flash_attn_version", lambda v=version: v)
        kernels_select.forget()
        assert kernels.default_backend(cuda, torch.bfloat16) == half
        assert kernels.default_backend(cuda, torch.float32) == "efficient"
    q, k, v, _ = (t.bfloat16() for t in make_qkv(B=1, S=8, H=2, G=2, d=8))
    with pytest.raises(ValueError, match=r"flash-attn package >= 2.7 \(version 2.6\)"):
        kernels.attention_forward(q, k, v, backend="flash_attn")
    monkeypatch.setattr(kernels_select, "flash_attn_version", lambda: (2, 8))
    with pytest.raises(ValueError, match="takes fp16/bf16 inputs"):
        kernels.attention_forward(q.float(), k.float(), v.float(), backend="flash_attn")
    monkeypatch.setattr(kernels_select, "flash_attn_version", lambda: None)
    kernels_select.forget()
    assert kernels.default_backend(cuda, torch.bfloat16) == "flash"
    kernels_select.forget()


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
    from upipe import kernels_select

    fake_flash_attn.install(monkeypatch)
    monkeypatch.setattr(kernels_select, "flash_attn_version", lambda: (2, 7))
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


# --- the other CUDA kernels: cudnn, fa3, fa4 (kernel_workers.py) ---------------------------
# Each under the emulation of its contract (cudnn_emulation.py; FA3/FA4: torch's impl
# activated for real, the rerouted ops and stand-in packages of flash_impl_emulation.py),
# in fp16 and bf16, against float64 within the bound of one device running the same kernel
# on the whole sequence; GQA, MQA and kv heads < C included.

HALF = [torch.float16, torch.bfloat16]
HALF_IDS = ["fp16", "bf16"]


@pytest.fixture(scope="module")
def kernels_emulated():
    import cudnn_emulation
    import flash_impl_emulation

    cudnn_emulation.install()
    flash_impl_emulation.install()
    yield flash_impl_emulation
    flash_impl_emulation.restore()


def _kernel_bounds(emu, kernel, shape, dtype):
    """`_bounds` with the one-device run on `kernel` (FA3/FA4 activated for it, then not)."""
    with emu.packages() if kernel in ("fa3", "fa4") else contextlib.nullcontext():
        return _bounds(shape, dtype, backend=kernel)


FUNCTIONAL = [
    ("cudnn", "ulysses", 2, 8, 2, 8, {}),
    ("cudnn", "upipe", 4, 8, 2, 8, {"heads_per_stage": 4}),  # G < C: kv heads replicated
    ("cudnn", "upipe", 2, 4, 1, 6, {}),  # MQA, head dim padded to 8
    ("fa3", "upipe", 4, 8, 2, 8, {"heads_per_stage": 4}),
    ("fa4", "ulysses", 2, 8, 2, 6, {}),
]


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("kernel,strategy,C,H,G,d,kwargs", FUNCTIONAL)
def test_functional_kernel_path(
    clusters, kernels_emulated, kernel, strategy, C, H, G, d, kwargs, dtype
):  # noqa: E501
    shape = dict(B=2, S=16 * C, H=H, G=G, d=d)
    ref, bounds = _kernel_bounds(kernels_emulated, kernel, shape, dtype)
    res = clusters(C).run(kernel_workers.functional, kernel, strategy, shape, kwargs, dtype)
    _check([torch.cat([r[0][i] for r in res], 1) for i in range(4)], ref, bounds)
    for _, made in res:  # the kernel itself ran, forward and backward, and no other
        assert {op for _, op in made} == {"forward", "backward"}, made
        assert {k for k, _ in made} == {kernel}, made


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_ring_cudnn_path(clusters, kernels_emulated, dtype):
    shape = dict(B=1, S=128, H=8, G=4, d=16)
    ref, bounds = _kernel_bounds(kernels_emulated, "cudnn", shape, dtype)
    res = clusters(4).run(kernel_workers.ring, "cudnn", shape, {"layout": "zigzag"}, dtype)
    _check(_placed(res, shape["S"]), ref, bounds)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("strategy,G", [("usp", 4), ("upipe", 1)])
def test_mesh_cudnn_path(clusters, kernels_emulated, strategy, G, dtype):
    """2 ring x 2 ulysses: USP, and UPipe with each stage a ring attention (G = 1: the kv
    head replicated over the ulysses ranks)."""
    shape = dict(B=1, S=128, H=8, G=G, d=16)
    ref, bounds = _kernel_bounds(kernels_emulated, "cudnn", shape, dtype)
    args = ("cudnn", (1, 2, 2), strategy, shape, {}, dtype)
    res = clusters(4).run(kernel_workers.mesh, *args)
    _check(_placed([(pos, got) for _, pos, got in res], shape["S"]), ref, bounds)


@pytest.mark.parametrize(
    "kernel,strategy,dtype",
    [
        ("cudnn", "upipe", torch.float16),
        ("cudnn", "upipe", torch.bfloat16),
        ("cudnn", "ulysses", torch.bfloat16),
        ("fa3", "upipe", torch.bfloat16),
        ("fa4", "upipe", torch.float16),
    ],
)
def test_module_kernel_path(clusters, kernels_emulated, kernel, strategy, dtype):
    """The layer -- for upipe the fused op (projections, RoPE and o_proj inside the stages)
    -- within the bound of test_module_cuda_path."""
    cfg = dict(B=1, S=32, dim=64, num_heads=8, num_kv_heads=2, head_dim=8)
    ref = module_reference(cfg)
    kwargs = {"strategy": strategy, "layout": "contiguous"}
    res = clusters(2).run(kernel_workers.module, kernel, cfg, kwargs, dtype)
    tol = TOL[torch.bfloat16]["bwd"]
    assert rel_err(torch.cat([r["y"] for r, _ in res], 1), ref["y"]) < tol
    assert rel_err(torch.cat([r["dx"] for r, _ in res], 1), ref["dx"]) < tol
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert rel_err(sum(r[n] for r, _ in res), ref[n]) < tol, n
    assert all({k for k, _ in made} == {kernel} for _, made in res)


DOC_CU = [0, 1, 3, 14, 15, 29, 32]  # one-token documents too (one key: no cuDNN kernel)


@pytest.mark.parametrize(
    "kernel,strategy,dtype,calls",
    [
        # cuDNN has no varlen call here: one call per document and stage (the one-token
        # documents run the efficient kernel), forward and backward
        ("cudnn", "ulysses", torch.bfloat16, {"forward": 4, "backward": 4}),
        ("cudnn", "upipe", torch.float16, {"forward": 8, "backward": 8}),
        ("cudnn", "ring", torch.bfloat16, None),
        # FA3 / FA4: the varlen aten op, rerouted: one call per stage for all documents
        ("fa3", "ulysses", torch.bfloat16, {"varlen forward": 1, "varlen backward": 1}),
        ("fa4", "upipe", torch.bfloat16, {"varlen forward": 2, "varlen backward": 2}),
        ("fa3", "ring", torch.float16, None),
    ],
)
def test_documents_kernel_path(clusters, kernels_emulated, kernel, strategy, dtype, calls):
    from document_workers import doc_reference, one_device

    shape = dict(B=2, S=32, H=4, G=2, d=8)
    ref = doc_reference(shape, DOC_CU)
    with kernels_emulated.packages() if kernel != "cudnn" else contextlib.nullcontext():
        single = one_device(shape, DOC_CU, dtype, backend=kernel)
    res = clusters(2).run(kernel_workers.docs, kernel, strategy, shape, {}, DOC_CU, dtype)
    for name, a, s, r in zip(NAMES, res[0][0], single, ref, strict=True):
        assert rel_err(a, r) <= bf16_bound(rel_err(s, r)), name
    for _, made in res:
        assert {k for k, _ in made} == {kernel}, made
        if calls is not None:
            assert {op: n for (_, op), n in made.items()} == calls, made


def test_module_documents_cudnn(clusters, kernels_emulated):
    """The fused UPipe layer with documents on cuDNN (per-document calls in every stage)."""
    from document_workers import module_doc_reference

    cfg = dict(B=2, S=32, dim=64, num_heads=8, num_kv_heads=2)
    args = ("cudnn", cfg, {"strategy": "upipe"}, DOC_CU, torch.bfloat16)
    got = clusters(2).run(kernel_workers.module_docs, *args)
    ref = module_doc_reference(cfg, DOC_CU)
    tol = TOL[torch.bfloat16]["bwd"]
    for n in ("y", "dx"):
        assert rel_err(got[0][n], ref[n]) < tol, n
    for n in ("q_proj", "k_proj", "o_proj"):
        assert rel_err(sum(r[n] for r in got), ref[n]) < tol, n
