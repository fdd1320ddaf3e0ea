"""Local attention kernels vs the float64 reference (forward and gradients)."""

import pytest
import torch
from tolerances import TOL, rel_err
from workers import make_qkv, reference

from upipe.kernels import attention_backward, attention_forward, default_backend


def _autograd_truth(q, k, v, dout, causal, scale):
    """Plain softmax(QK^T)V in fp64 through autograd: an independent check of the reference."""
    H, G = q.shape[2], k.shape[2]
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(H // G, 2)) * scale
    if causal:
        S = q.shape[1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", s.softmax(-1), v.repeat_interleave(H // G, 2))
    out.backward(dout.double())
    return out, q.grad, k.grad, v.grad, torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("G", [4, 2, 1])
def test_reference_matches_autograd(causal, G):
    q, k, v, dout = make_qkv(B=2, S=37, H=4, G=G, d=8, dtype=torch.float64)
    truth = _autograd_truth(q, k, v, dout, causal, 0.3)
    out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=0.3, backend="reference")
    grads = attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=0.3, backend="reference"
    )
    for got, want in zip((out, *grads, lse), truth, strict=True):
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("G", [8, 2, 1])
def test_cpu_kernel_fp32(causal, G):
    q, k, v, dout = make_qkv(B=2, S=96, H=8, G=G, d=16)
    ref = reference(q, k, v, dout, causal=causal)
    assert default_backend(q.device) == "cpu"
    out, lse = attention_forward(q, k, v, causal=causal)
    assert out.shape == q.shape and lse.shape == (2, 8, 96) and lse.dtype == torch.float32
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert rel_err(out, ref[0]) < TOL[torch.float32]["fwd"]
    for got, want in zip(grads, ref[1:], strict=True):
        assert rel_err(got, want) < TOL[torch.float32]["bwd"]


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_kernel_bf16_within_bound(causal):
    q, k, v, dout = make_qkv(B=1, S=128, H=4, G=2, d=32)
    ref = reference(q, k, v, dout, causal=causal)
    qb, kb, vb, db = (t.bfloat16() for t in (q, k, v, dout))
    out, lse = attention_forward(qb, kb, vb, causal=causal)
    grads = attention_backward(db, qb, kb, vb, out, lse, causal=causal)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_err(out, ref[0]) < TOL[torch.bfloat16]["fwd"]
    for got, want in zip(grads, ref[1:], strict=True):
        assert rel_err(got, want) < TOL[torch.bfloat16]["bwd"]
    # and no better than the rounding of the inputs allows: the bound is not vacuous
    rounded = reference(qb, kb, vb, db, causal=causal)
    assert rel_err(out, ref[0]) >= 0.5 * rel_err(rounded[0].bfloat16(), ref[0])


def test_lse_is_logsumexp_of_scores():
    q, k, v, _ = make_qkv(B=1, S=50, H=2, G=2, d=8)
    _, lse = attention_forward(q, k, v, causal=True)
    s = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / 8**0.5
    s = s.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
    assert rel_err(lse, torch.logsumexp(s, -1)) < 1e-6


def test_kernel_rejects_bad_input():
    q, k, v, _ = make_qkv(B=1, S=16, H=4, G=2, d=8)
    with pytest.raises(ValueError, match="causal attention needs equal"):
        attention_forward(q, k[:, :8], v[:, :8], causal=True)
    with pytest.raises(ValueError, match="must divide query heads"):
        attention_forward(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_forward(q, k, v, backend="tpu")
    out, _ = attention_forward(q, k[:, :8], v[:, :8], causal=False)  # non-causal: any length
    assert out.shape == q.shape


@pytest.mark.parametrize("layout", ["flash-attn-4 alone", "a package without metadata"])
def test_flash_attn_version_without_flash_attn_2(tmp_path, monkeypatch, layout):
    """Installing flash-attn-4 alone leaves `flash_attn` a namespace package (flash_attn/cute,
    no flash_attn/__init__.py, no 'flash_attn' distribution), on which
    importlib.metadata.version("flash_attn") raises -- upipe failed on CUDA before its first
    kernel call. It now means "flash-attn 2.x not installed", and FA4 is found on its own."""
    import importlib.metadata
    import importlib.util
    import sys

    from upipe import kernels_select

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    if layout == "a package without metadata":
        (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "flash_attn"]:
        monkeypatch.delitem(sys.modules, name)
    kernels_select.forget()
    try:
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("flash_attn")  # what used to escape
        spec = importlib.util.find_spec("flash_attn")
        assert (spec.origin is None) == (layout == "flash-attn-4 alone")
        assert kernels_select.flash_attn_version() is None
        assert kernels_select._module_found("flash_attn.cute")  # FA4's package, on its own
        cuda = torch.device("cuda")
        monkeypatch.setattr(kernels_select, "device_capability", lambda d: (8, 0))
        assert default_backend(cuda, torch.bfloat16) == "flash"  # no flash_attn 2.x
        problem = kernels_select.kernel_problem("flash_attn", cuda, torch.bfloat16, 64)
        assert "flash-attn package >= 2.7 (not installed)" in problem
    finally:
        # the tmp_path packages imported here would stay in sys.modules for the next tests
        # of this process (tests/distributed/test_kernel_select.py would find an FA4)
        for name in [m for m in sys.modules if m.split(".")[0] == "flash_attn"]:
            del sys.modules[name]
        kernels_select.forget()
