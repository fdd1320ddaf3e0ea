"""The chunked cross-entropy (`upipe.loss.cross_entropy_sum` with `chunk_tokens`): loss and
gradients in one pass, against the unchunked loss."""

import pytest
import torch
from tolerances import rel_err

from upipe.loss import IGNORE_INDEX, cross_entropy_sum


def _case(dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 37, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(50, 16, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(50, generator=gen).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, 50, (2, 37), generator=gen)
    labels[0, :9] = IGNORE_INDEX  # padding
    labels[1, -1] = IGNORE_INDEX
    return h, w, b, labels


def _grads(loss, inputs, scale):
    (loss * scale).backward()  # a loss scale (the Trainer's) reaches backward as g != 1
    out = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 10, 37, 74, 200])
def test_chunked_equals_unchunked_fp32(bias, chunk):
    h, w, b, labels = _case(torch.float32, bias)
    inputs = [t for t in (h, w, b) if t is not None]
    full = cross_entropy_sum(h, w, labels, bias_V=b)
    chunked = cross_entropy_sum(h, w, labels, chunk_tokens=chunk, bias_V=b)
    # each chunk's loss is F.cross_entropy's of its rows; only the sum's order differs
    assert abs(chunked.item() - full.item()) <= 4 * torch.finfo(torch.float32).eps * full.item()
    ref = _grads(full, inputs, 3.7)
    got = _grads(chunked, inputs, 3.7)
    for a, r in zip(got, ref, strict=True):
        assert rel_err(a, r) < 1e-6


def test_bf16_hidden_gradient_is_rounded_once():
    """bf16: dh is kept in fp32 until g is known, then rounded once -- as close to the fp64
    truth as the unchunked loss's own bf16 backward."""
    h, w, _, labels = _case(torch.bfloat16, False, seed=1)
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    truth = _grads(cross_entropy_sum(h64, w64, labels), [h64, w64], 0.01)
    full = _grads(cross_entropy_sum(h, w, labels), [h, w], 0.01)
    chunked = _grads(cross_entropy_sum(h, w, labels, chunk_tokens=8), [h, w], 0.01)
    for c, f, t in zip(chunked, full, truth, strict=True):
        assert c.dtype == torch.bfloat16
        assert rel_err(c, t) <= 1.5 * rel_err(f, t) + 1e-3


def test_without_grad_only_the_loss():
    h, w, _, labels = _case(torch.float32, False)
    with torch.no_grad():
        loss = cross_entropy_sum(h, w, labels, chunk_tokens=10)
    assert loss.grad_fn is None
    full = cross_entropy_sum(h, w, labels).item()
    assert abs(loss.item() - full) <= 4 * torch.finfo(torch.float32).eps * full


def test_frozen_weight_gets_no_gradient():
    h, w, _, labels = _case(torch.float32, False)
    w.requires_grad_(False)
    cross_entropy_sum(h, w, labels, chunk_tokens=10).backward()
    assert w.grad is None and h.grad is not None


def test_chunk_must_be_positive():
    h, w, _, labels = _case(torch.float32, False)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        cross_entropy_sum(h, w, labels, chunk_tokens=0)


@pytest.mark.parametrize("chunk", [7, 74])
def test_norm_inside_the_chunks(chunk):
    """The final norm applied chunk by chunk inside the loss (the normalised [N, D] never
    exists): the loss and the gradients of h, W and the norm's weight as with the norm run
    on all rows first."""
    h, w, _, labels = _case(torch.float32, False, seed=2)
    norm = torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.add_(torch.randn(16, generator=torch.Generator().manual_seed(3)))
    inputs = [h, w, norm.weight]
    full = cross_entropy_sum(norm(h), w, labels)
    chunked = cross_entropy_sum(h, w, labels, chunk_tokens=chunk, norm=norm)
    assert abs(chunked.item() - full.item()) <= 4 * torch.finfo(torch.float32).eps * full.item()
    ref = _grads(full, inputs, 0.37)
    got = _grads(chunked, inputs, 0.37)
    for a, r in zip(got, ref, strict=True):
        assert rel_err(a, r) < 1e-6
    with torch.no_grad():
        no_grad = cross_entropy_sum(h, w, labels, chunk_tokens=chunk, norm=norm)
    assert abs(no_grad.item() - full.item()) <= 4 * torch.finfo(torch.float32).eps * full.item()
