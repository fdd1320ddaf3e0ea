"""The CPU emulation of the CUDA-only ops: right numbers, and every contract rule enforced.

Layout legend as in cuda_emulation.py: tensors are built [B, S, heads, d] (upipe's layout)
and handed to the SDPA ops transposed to [B, heads, S, d], as upipe's CUDA path does.
"""

from __future__ import annotations

import math

import cuda_emulation
import pytest
import torch
from tolerances import TOL, rel_err

from upipe.kernels import attention_backward, attention_forward

aten = torch.ops.aten
BF16 = torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def _emulated():
    cuda_emulation.install()


def make(*, B=2, S=16, H=4, G=2, d=16, dtype=BF16, seed=0):
    """q [B, S, H, d], k/v [B, S, G, d], dout like q."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, S, H, d), (B, S, G, d), (B, S, G, d), (B, S, H, d))
    return tuple(torch.randn(*s, generator=gen).to(dtype) for s in shapes)


def bhsd(*ts):
    return tuple(t.transpose(1, 2) for t in ts)


def reference(q, k, v, dout, causal):
    """float64 (out, lse, dq, dk, dv) in [B, S, heads, d] / [B, H, S]."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    kw = dict(causal=causal, backend="reference")
    out, lse = attention_forward(q, k, v, **kw)
    return (out, lse, *attention_backward(dout, q, k, v, out, lse, **kw))


def flash_fwd(q, k, v, causal=True):
    return aten._scaled_dot_product_flash_attention(*bhsd(q, k, v), 0.0, causal, False)


def flash_bwd(dout, q, k, v, out_BHSd, lse, causal=True, cum=None):
    S = q.shape[1]
    return aten._scaled_dot_product_flash_attention_backward(
        *bhsd(dout, q, k, v), out_BHSd, lse, cum, cum, S, S, 0.0, causal, None, None
    )


def eff_fwd(q, k, v, causal=True, lse=True):
    return aten._scaled_dot_product_efficient_attention(*bhsd(q, k, v), None, lse, 0.0, causal)


def eff_bwd(dout, q, k, v, out_BHSd, lse, causal=True):
    mask = [True, True, True, False]
    args = (*bhsd(dout, q, k, v), None, out_BHSd, lse, None, None, 0.0, mask, causal)
    return aten._scaled_dot_product_efficient_attention_backward(*args)


def test_install_is_idempotent():
    for _ in range(3):
        cuda_emulation.install()
    for name in cuda_emulation._KERNELS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU")


# --- flash: numbers ----------------------------------------------------------------------


@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_matches_reference(causal, G):
    q, k, v, dout = make(G=G)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, causal)
    res = flash_fwd(q, k, v, causal)
    out, lse = res[0], res[1]
    assert out.dtype == BF16 and lse.dtype == torch.float32 and lse.shape == (2, 4, 16)
    assert rel_err(out.transpose(1, 2), ref_out) < TOL[BF16]["fwd"]
    assert rel_err(lse, ref_lse) < 1e-5
    dq, dk, dv = flash_bwd(dout, q, k, v, out, lse, causal)
    assert dk.shape == dv.shape == (2, G, 16, 16)  # GQA: kv heads, summed over their groups
    for got, ref in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert got.dtype == BF16
        assert rel_err(got.transpose(1, 2), ref) < TOL[BF16]["bwd"]


def test_flash_returns_what_the_cuda_op_returns():
    q, k, v, _ = make()
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug = flash_fwd(q, k, v)
    assert cum_q is None and cum_k is None  # Tensor() for a dense call
    assert (max_q, max_k) == (16, 16)
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
    assert unused.dtype == torch.uint64 and unused.shape == ()
    assert debug.numel() == 0
    assert out.transpose(1, 2).is_contiguous()  # empty_like of q's [B, S, H, d] memory
    assert lse.is_contiguous()
    dq, dk, _ = flash_bwd(*make()[3:], q, k, v, out, lse)
    assert dq.transpose(1, 2).is_contiguous() and dk.transpose(1, 2).is_contiguous()


def test_flash_causal_is_aligned_bottom_right():
    q, k, v, _ = make(S=8, G=4)
    q = q[:, :3]  # 3 queries over 8 keys: query i sees keys 0 .. i + 5
    out = aten._scaled_dot_product_flash_attention(*bhsd(q, k, v), 0.0, True)[0]
    mask = torch.ones(3, 8, dtype=torch.bool).tril(5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.double() for t in bhsd(q, k, v)), attn_mask=mask
    )
    assert rel_err(out, ref) < TOL[BF16]["fwd"]


# --- flash: the contract -----------------------------------------------------------------


def test_flash_rejects_fp32():
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16"):
        flash_fwd(*make(dtype=torch.float32)[:3])


@pytest.mark.parametrize(
    ("d", "message"),
    [(12, "head_size must be a multiple of 8"), (264, "head dimension at most 256")],
)
def test_flash_forward_head_dim_limits(d, message):
    with pytest.raises(RuntimeError, match=message):
        flash_fwd(*make(S=4, H=1, G=1, d=d)[:3])


def test_flash_rejects_kv_heads_that_do_not_divide():
    with pytest.raises(RuntimeError, match="must divide number of heads in query"):
        flash_fwd(*make(H=4, G=3)[:3])


def test_flash_rejects_non_contiguous_last_dim():
    q, k, v, _ = make(d=16)
    q = q[..., ::2]
    with pytest.raises(RuntimeError, match="must have contiguous last dimension"):
        flash_fwd(q, k[..., :8], v[..., :8])


def test_flash_debug_mask_needs_dropout():
    with pytest.raises(RuntimeError, match="return_softmax is only supported"):
        aten._scaled_dot_product_flash_attention(*bhsd(*make()[:3]), 0.0, True, True)


def test_flash_backward_empty_cum_seq_selects_varlen_and_fails():
    q, k, v, dout = make()
    out, lse = flash_fwd(q, k, v)[:2]
    empty = torch.empty(0, dtype=torch.int32)  # defined: picks mha_varlen_bwd
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        flash_bwd(dout, q, k, v, out, lse, cum=empty)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        flash_bwd(dout, q, k, v, out, lse, cum=empty.long())


def test_flash_backward_rejects_head_dim_not_multiple_of_8():
    q, k, v, dout = make(d=12)
    out, lse = torch.zeros_like(q).transpose(1, 2), torch.zeros(2, 4, 16)
    with pytest.raises(RuntimeError, match="head_size should be a multiple of 8"):
        flash_bwd(dout, q, k, v, out, lse)


def test_flash_backward_rejects_mixed_dtypes():
    q, k, v, dout = make()
    out, lse = flash_fwd(q, k, v)[:2]
    with pytest.raises(RuntimeError, match="query and dout must have the same dtype"):
        flash_bwd(dout.half(), q, k, v, out, lse)


@pytest.mark.parametrize("bad", ["padded", "transposed", "bf16"])
def test_flash_backward_rejects_an_lse_it_would_misread(bad):
    q, k, v, dout = make()
    out, lse = flash_fwd(q, k, v)[:2]
    lse = {
        "padded": torch.nn.functional.pad(lse, (0, 16)),  # the efficient kernel's layout
        "transposed": lse.transpose(1, 2).contiguous().transpose(1, 2),
        "bf16": lse.to(BF16),
    }[bad]
    with pytest.raises(RuntimeError, match="reads logsumexp as contiguous fp32"):
        flash_bwd(dout, q, k, v, out, lse)


# --- memory-efficient: numbers -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("causal", [True, False])
def test_efficient_matches_reference(causal, dtype):
    q, k, v, dout = make(S=20, G=4, dtype=dtype)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, causal)
    out, lse, seed, offset = eff_fwd(q, k, v, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == (2, 4, 32)  # padded to a multiple of 32 queries
    assert torch.isinf(lse[..., 20:]).all() and (lse[..., 20:] > 0).all()
    assert seed.dtype == offset.dtype == torch.int64 and seed.shape == ()
    assert out.transpose(1, 2).is_contiguous()  # at::empty({B, M, H, Kv})
    assert rel_err(out.transpose(1, 2), ref_out) < TOL[dtype]["fwd"]
    assert rel_err(lse[..., :20], ref_lse) < 1e-5
    dq, dk, dv, dbias = eff_bwd(dout, q, k, v, out, lse, causal)
    assert dbias is None
    for got, ref in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert got.dtype == dtype and got.transpose(1, 2).is_contiguous()
        assert rel_err(got.transpose(1, 2), ref) < TOL[dtype]["bwd"]


def test_efficient_without_log_sumexp_returns_an_empty_lse():
    lse = eff_fwd(*make(G=4, dtype=torch.float32)[:3], lse=False)[1]
    assert lse.shape == (2, 4, 0) and lse.dtype == torch.float32


# --- memory-efficient: the contract ------------------------------------------------------


def test_efficient_rejects_gqa():
    q, k, v, dout = make(H=4, G=2, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"query\.size\(2\) == key\.size\(2\)"):
        eff_fwd(q, k, v)
    out, lse = torch.zeros_like(q).transpose(1, 2), torch.zeros(2, 4, 32)
    with pytest.raises(RuntimeError, match=r"query\.size\(2\) == key\.size\(2\)"):
        eff_bwd(dout, q, k, v, out, lse)


def test_efficient_rejects_fp64():
    with pytest.raises(RuntimeError, match="Only fp32, half & bf16 supported"):
        eff_fwd(*make(G=4, dtype=torch.float64)[:3])


def test_efficient_bf16_needs_aligned_head_dim():
    with pytest.raises(RuntimeError, match="cutlassF: no kernel found to launch"):
        eff_fwd(*make(G=4, d=4)[:3])


@pytest.mark.parametrize(
    ("S", "message"),
    [
        (8, r"reads logsumexp\[\.\.\., :32\]"),  # stride 8 passes the check; too short
        (12, r"LSE is not correctly aligned \(strideH\)"),
    ],
)
def test_efficient_backward_rejects_unpadded_lse(S, message):
    q, k, v, dout = make(S=S, G=4, dtype=torch.float32)
    out, lse = eff_fwd(q, k, v)[:2]
    with pytest.raises(RuntimeError, match=message):
        eff_bwd(dout, q, k, v, out, lse[..., :S].contiguous())


def test_efficient_backward_accepts_a_finite_padding_and_rejects_nan():
    q, k, v, dout = make(S=12, G=4, dtype=torch.float32)
    out, lse = eff_fwd(q, k, v)[:2]
    zero_pad = torch.nn.functional.pad(lse[..., :12], (0, 20))  # what upipe builds
    ref = eff_bwd(dout, q, k, v, out, lse)
    for got, want in zip(eff_bwd(dout, q, k, v, out, zero_pad)[:3], ref[:3], strict=True):
        torch.testing.assert_close(got, want)
    nan_pad = torch.nn.functional.pad(lse[..., :12], (0, 20), value=float("nan"))
    with pytest.raises(RuntimeError, match="padding past M holds NaN"):
        eff_bwd(dout, q, k, v, out, nan_pad)


def test_efficient_backward_rejects_lse_of_another_dtype():
    q, k, v, dout = make(G=4, dtype=torch.float32)
    out, lse = eff_fwd(q, k, v)[:2]
    with pytest.raises(RuntimeError, match="logsumexp must be fp32"):
        eff_bwd(dout, q, k, v, out, lse.double())


def test_efficient_half_backward_needs_the_forward_out_layout():
    q, k, v, dout = make(G=4)
    out, lse = eff_fwd(q, k, v)[:2]
    with pytest.raises(RuntimeError, match="o_strideM"):
        eff_bwd(dout, q, k, v, out.contiguous(), lse)  # [B, H, S, d] memory


# --- out_dtype GEMMs ---------------------------------------------------------------------


def mats(M=5, K=7, N=3, dtype=BF16):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(M, K, generator=gen).to(dtype), torch.randn(K, N, generator=gen).to(dtype)


def test_mm_dtype_accumulates_in_fp32():
    a, b = mats()
    got = torch.mm(a, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert rel_err(got, a.double() @ b.double()) < 1e-6
    out = torch.empty(5, 3)
    assert aten.mm.dtype_out(a, b, torch.float32, out=out) is out
    torch.testing.assert_close(out, got)


@pytest.mark.parametrize("self_dtype", [torch.float32, BF16])
def test_addmm_dtype(self_dtype):
    a, b = mats()
    c = torch.randn(5, 3).to(self_dtype)
    got = torch.addmm(c, a, b, out_dtype=torch.float32, beta=0.5, alpha=2.0)
    want = 0.5 * c.double() + 2.0 * (a.double() @ b.double())
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6


def test_addmm_dtype_accumulates_in_place_into_self():
    a, b = mats()
    acc = torch.randn(5, 3)
    start = acc.clone()
    got = torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    assert got is acc
    assert rel_err(acc, start.double() + a.double() @ b.double()) < 1e-6


def test_addmm_dtype_broadcasts_a_bias_row():
    a, b = mats()
    bias = torch.randn(3)
    got = torch.addmm(bias, a, b, out_dtype=torch.float32)
    assert rel_err(got, bias.double() + a.double() @ b.double()) < 1e-6


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda a, b: torch.mm(a, b, out_dtype=torch.float16), "or fp32 for fp16/bf16 inputs"),
        (lambda a, b: torch.mm(a.float(), b.float(), out_dtype=BF16), "or fp32 for fp16/bf16"),
        (lambda a, b: torch.mm(a, b.half(), out_dtype=torch.float32), "input dtypes must be"),
        (
            lambda a, b: aten.mm.dtype_out(a, b, torch.float32, out=torch.empty(5, 3, dtype=BF16)),
            "dtype of the provided out tensor",
        ),
        (
            lambda a, b: aten.mm.dtype_out(a, b, torch.float32, out=torch.empty(4, 3)),
            "self dim 0 must match mat1 dim 0",  # mm.dtype_out does not resize out
        ),
        (
            lambda a, b: torch.addmm(torch.zeros(5, 3).half(), a, b, out_dtype=torch.float32),
            "self dtype must match either out_dtype or mat1 dtype",
        ),
        (
            lambda a, b: torch.addmm(torch.zeros(5, 3), a, b.half(), out_dtype=torch.float32),
            "mat1 and mat2 must have the same dtype, but got BFloat16 and Half",
        ),
        (
            lambda a, b: torch.addmm(torch.zeros(5, 3), a, b, out_dtype=torch.float16),
            "or fp32 for fp16/bf16 inputs",
        ),
        (lambda a, b: torch.mm(a, b.t(), out_dtype=torch.float32), "cannot be multiplied"),
    ],
)
def test_gemm_dtype_rules(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(*mats())


def test_same_dtype_gemm_is_allowed():
    a, b = mats(dtype=torch.float32)
    got = torch.mm(a, b, out_dtype=torch.float32)
    assert math.isclose(rel_err(got, a.double() @ b.double()), 0.0, abs_tol=1e-6)


# --- cuDNN (cudnn_emulation.py) ---------------------------------------------------------


@pytest.fixture
def cudnn_emu(monkeypatch):
    import cudnn_emulation

    cudnn_emulation.install()
    return cudnn_emulation


def cudnn_fwd(q, k, v, causal=True, lse=True):
    return aten._scaled_dot_product_cudnn_attention(*bhsd(q, k, v), None, lse, 0.0, causal)


def cudnn_bwd(dout, q, k, v, out_BHSd, lse, causal=True, cum=None, philox="defined", max_q=None):
    seed = torch.empty((), dtype=torch.int64) if philox == "defined" else None
    S, N = q.shape[1], k.shape[1]
    args = (*bhsd(dout, q, k, v), out_BHSd, lse, seed, seed, None, cum, cum)
    return aten._scaled_dot_product_cudnn_attention_backward(
        *args, S if max_q is None else max_q, N, 0.0, causal
    )


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_matches_reference(cudnn_emu, causal, G, dtype):
    q, k, v, dout = make(G=G, dtype=dtype)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, causal)
    res = cudnn_fwd(q, k, v, causal)
    out, lse = res[0], res[1]
    assert rel_err(out.transpose(1, 2), ref_out) < TOL[BF16]["fwd"]
    assert rel_err(lse[..., 0], ref_lse) < 1e-5
    dq, dk, dv = cudnn_bwd(dout, q, k, v, out, lse, causal)
    assert dk.shape == dv.shape == (2, G, 16, 16)  # GQA native: the kv heads' gradients
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert got.dtype == dtype and rel_err(got.transpose(1, 2), want) < TOL[BF16]["bwd"]


def test_cudnn_returns_what_the_cuda_op_returns(cudnn_emu):
    q, k, v, dout = make()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = cudnn_fwd(q, k, v)
    assert out.stride() == q.transpose(1, 2).stride()  # allocated like q: [B, S, H, d] memory
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 16, 1) and lse.is_contiguous()
    assert cum_q is None and cum_k is None and debug is None
    assert (max_q, max_k) == (16, 16)
    assert seed.dtype == offset.dtype == torch.int64 and seed.shape == ()
    assert cudnn_fwd(q, k, v, lse=False)[1] is None  # no lse without compute_log_sumexp
    dq, dk, _ = cudnn_bwd(dout, q, k, v, out, lse)
    assert dq.stride() == q.transpose(1, 2).stride() and dk.stride() == k.transpose(1, 2).stride()


def test_cudnn_rejects_fp32_and_mixed_dtypes(cudnn_emu):
    with pytest.raises(RuntimeError, match="graph's io type is HALF.*misread"):
        cudnn_fwd(*make(dtype=torch.float32)[:3])
    q, k, v, _ = make()
    with pytest.raises(RuntimeError, match="graph's io type is BFLOAT16.*misread"):
        cudnn_fwd(q, k.half(), v)


def test_cudnn_backward_needs_undefined_cum_seq_and_defined_philox(cudnn_emu):
    q, k, v, dout = make()
    out, lse = cudnn_fwd(q, k, v)[:2]
    empty = torch.empty(0, dtype=torch.int32)  # defined: the nested path
    with pytest.raises(RuntimeError, match=r"expected a 2D \(H, T\) softmax_lse"):
        cudnn_bwd(dout, q, k, v, out, lse, cum=empty)
    with pytest.raises(RuntimeError, match="philox_seed/philox_offset are undefined"):
        cudnn_bwd(dout, q, k, v, out, lse, philox=None)
    with pytest.raises(RuntimeError, match=r"max_q/max_k are the graph's s_q/s_kv"):
        cudnn_bwd(dout, q, k, v, out, lse, max_q=8)


@pytest.mark.parametrize("bad", ["3-D", "transposed", "bf16"])
def test_cudnn_backward_rejects_an_lse_of_another_layout(cudnn_emu, bad):
    q, k, v, dout = make()
    out, lse = cudnn_fwd(q, k, v)[:2]
    lse = {
        "3-D": lse[..., 0],  # the flash kernels' [B, H, M]
        "transposed": lse.transpose(1, 2).contiguous().transpose(1, 2),
        "bf16": lse.to(BF16),
    }[bad]
    with pytest.raises(RuntimeError, match=r"the forward's layout is contiguous fp32"):
        cudnn_bwd(dout, q, k, v, out, lse)


@pytest.mark.parametrize(
    ("arch", "d", "ok"),
    [((9, 0), 256, True), ((9, 0), 264, False), ((10, 0), 136, False), ((8, 0), 128, True)],
)
def test_cudnn_head_dim_limits(cudnn_emu, monkeypatch, arch, d, ok):
    monkeypatch.setattr(cudnn_emu, "ARCH", arch)
    q, k, v, _ = make(S=4, H=1, G=1, d=d)
    if ok:
        cudnn_fwd(q, k, v)
        return
    with pytest.raises(RuntimeError, match="hidden_dim should be less than or equal to"):
        cudnn_fwd(q, k, v)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("G=3", "must be a factor of number of heads for query"),
        ("d=12", "hidden_dim should be multiple of 8"),
        ("S=1", r"one query or key \(s_q == 1 or s_kv == 1\) has no cuDNN kernel"),
        ("misaligned", "is not 16-byte aligned"),
        ("strided d", "The stride for the last dimension"),
    ],
)
def test_cudnn_contract(cudnn_emu, case, message):
    if case == "G=3":  # 4 query heads over 3 kv heads
        q, (k, v) = make(H=4, G=4)[0], make(H=3, G=3)[1:3]
    elif case == "d=12":
        q, k, v = make(d=12)[:3]
    elif case == "S=1":
        q, k, v = make(S=1)[:3]
    elif case == "misaligned":
        q, k, v = make(d=16)[:3]
        q, k, v = (t[..., 1:9] for t in (q, k, v))  # 2 bytes off, strides of 16 elements
    else:
        q, k, v = make(d=16)[:3]
        q, k, v = (t[..., ::2] for t in (q, k, v))
    with pytest.raises(RuntimeError, match=message):
        cudnn_fwd(q, k, v)


# --- FA3 / FA4: the flash ops while torch's impl is active (flash_impl_emulation.py) -----


@pytest.fixture
def fa_emu():
    import flash_impl_emulation

    flash_impl_emulation.install()
    with flash_impl_emulation.packages():
        yield flash_impl_emulation
    assert torch.nn.attention.current_flash_attention_impl() is None


@pytest.mark.parametrize("impl", ["FA3", "FA4"])
def test_activated_impl_reroutes_the_flash_ops(fa_emu, impl):
    """torch's real activation, then the CPU kernels follow it: the same numbers, the
    impl's own contract (FA3/FA4's SDPA backward passes cum_seq on as None, so a defined
    empty one -- fatal to FA2, which then takes its varlen kernel -- is harmless)."""
    q, k, v, dout = make(G=2)
    ref_out, _, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, True)
    torch.nn.attention.activate_flash_attention_impl(impl)
    out, lse = flash_fwd(q, k, v)[:2]
    assert out.stride() == q.transpose(1, 2).stride() and lse.shape == (2, 4, 16)
    empty = torch.empty(0, dtype=torch.int32)
    dq, dk, dv = flash_bwd(dout, q, k, v, out, lse, cum=empty)
    for got, want in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert rel_err(got.transpose(1, 2), want) < TOL[BF16]["bwd"]
    assert fa_emu.CALLS[(impl, "forward")] >= 1 and fa_emu.CALLS[(impl, "backward")] >= 1
    fa_emu.restore()
    with pytest.raises(RuntimeError, match="batch size must be positive"):  # FA2 again
        flash_bwd(dout, q, k, v, out, lse, cum=empty)


@pytest.mark.parametrize(
    ("impl", "case", "message"),
    [
        ("FA4", "d=264", "head_dim must be less than or equal to 256"),
        ("FA3", "d=12", "head_dim must be divisible by 8"),
        ("FA4", "fp32", "query dtype must be float16 or bfloat16"),
        ("FA3", "lse bf16", "logsumexp dtype must be float32"),
        ("FA4", "lse padded", r"reads lse as contiguous fp32 \[2, 4, 16\]"),
    ],
)
def test_activated_impl_contract(fa_emu, impl, case, message):
    d = {"d=264": 264, "d=12": 12}.get(case, 16)
    q, k, v, dout = make(H=4, G=2, d=d, dtype=torch.float32 if case == "fp32" else BF16)
    torch.nn.attention.activate_flash_attention_impl(impl)
    with pytest.raises(RuntimeError, match=message):
        out, lse = flash_fwd(q, k, v)[:2]
        lse = lse.to(BF16) if case == "lse bf16" else torch.nn.functional.pad(lse, (0, 16))
        flash_bwd(dout, q, k, v, out, lse)
