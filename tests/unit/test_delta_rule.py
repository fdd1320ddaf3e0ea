"""upipe's own chunked gated delta rule (upipe.kernels_delta_rule) against the rule's
definition token by token in float64 (forward and every input's gradient), against
transformers' torch implementation in fp32, and in bf16 within that implementation's own
bf16 error."""

from __future__ import annotations

import pytest
import torch
from tolerances import TOL, bf16_bound, rel_err

from upipe.kernels_delta_rule import delta_rule

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def _definition(q, k, v, g, beta):
    """The gated delta rule token by token (upipe.kernels_deltanet's module doc), float64:
    M_t = e^g M + beta k (v - e^g M^T k)^T, o_t = M_t^T q / sqrt(d), q and k l2-normalised
    -- the recurrence of `deltanet_workers.fla_stand_in` (the stand-in of fla's kernel),
    with the key heads repeated to the value heads first, as fla's contract asks."""
    from deltanet_workers import fla_stand_in

    rep = v.shape[2] // q.shape[2]
    q, k = (t.double().repeat_interleave(rep, dim=2) for t in (q, k))
    v, g, beta = (t.double() for t in (v, g, beta))
    return fla_stand_in(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def _inputs(B, S, G, H, d, e, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, G, d, generator=gen).to(dtype) for _ in "qk")
    v = torch.randn(B, S, H, e, generator=gen).to(dtype)
    g = -0.3 * torch.rand(B, S, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, S, H, generator=gen).to(dtype)
    return q, k, v, g.to(F64 if dtype == F64 else F32), beta


def _run(fn, inputs, do, needs=(True,) * 5):
    leaves = [t.detach().clone().requires_grad_(n) for t, n in zip(inputs, needs, strict=True)]
    o = fn(*leaves)
    wanted = [t for t in leaves if t.requires_grad]
    grads = iter(torch.autograd.grad(o, wanted, do.to(o.dtype)))
    return o, [next(grads) if t.requires_grad else None for t in leaves]


def _errors(o, grads, ref_o, ref_grads):
    """`rel_err` of the output and of each input's gradient."""
    return [rel_err(o, ref_o)] + [rel_err(a, b) for a, b in zip(grads, ref_grads, strict=True)]


SHAPES = [
    (1, 64, 1, 1, 8, 8),  # one whole chunk
    (2, 150, 2, 4, 8, 16),  # two chunks and a padded third, key heads repeated, batch 2
    (1, 200, 3, 3, 16, 8),  # d > e
]


@pytest.mark.parametrize("for_backward", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_the_definition(shape, for_backward):
    """fp64 to 1e-10 and fp32 within the fp32 tolerance of the token-by-token definition,
    the output and the gradient of each of q, k, v, g, beta."""
    B, S, G, H, d, e = shape
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, S, H, e, generator=gen, dtype=F64)
    ref_o, ref_grads = _run(_definition, _inputs(*shape, F64), do)
    for dtype, bound in ((F64, 1e-10), (F32, TOL[F32]["bwd"])):
        o, grads = _run(
            lambda *a: delta_rule(*a, for_backward=for_backward), _inputs(*shape, dtype), do
        )
        assert o.dtype == dtype
        errors = _errors(o, grads, ref_o, ref_grads)
        assert max(errors) < bound, (dtype, errors)


def test_equals_transformers_torch_scan_in_fp32():
    """The same operations in the same order as transformers' `torch_chunk_gated_delta_rule`
    forward: its output to fp32 rounding (1e-6), and its autograd gradients likewise."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next

    from upipe.integrations.hf_deltanet import torch_scan

    reference = torch_scan(modeling_qwen3_next)
    inputs = _inputs(2, 150, 2, 4, 8, 16, F32)
    do = torch.randn(2, 150, 4, 16, generator=torch.Generator().manual_seed(2))

    def theirs(q, k, v, g, beta):
        return reference(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    (o, grads), (ref_o, ref_grads) = _run(delta_rule, inputs, do), _run(theirs, inputs, do)
    errors = _errors(o, grads, ref_o, ref_grads)
    assert max(errors) < 1e-6, errors


def test_bf16_within_the_torch_scans_own_bf16_error():
    """bf16 inputs (computed in fp32, the output rounded to bf16): within `bf16_bound` of
    what transformers' scan does with the same bf16 inputs, each against the definition."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next

    from upipe.integrations.hf_deltanet import torch_scan

    reference = torch_scan(modeling_qwen3_next)
    shape = (1, 150, 2, 4, 8, 16)
    inputs = _inputs(*shape, BF16)
    do = torch.randn(1, 150, 4, 16, generator=torch.Generator().manual_seed(3))
    ref_o, ref_grads = _run(_definition, inputs, do)

    def theirs(q, k, v, g, beta):
        return reference(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def errors(fn):
        return _errors(*_run(fn, inputs, do), ref_o, ref_grads)

    ours, single = errors(delta_rule), errors(theirs)
    assert all(a < bf16_bound(b) for a, b in zip(ours, single, strict=True)), (ours, single)


def test_inputs_without_gradient_and_one_backward():
    """Inputs that need no gradient get None (the others are still exact); a forward with
    for_backward=True refuses a second backward with a clear error."""
    inputs = _inputs(1, 100, 1, 2, 8, 8, F64)
    do = torch.randn(1, 100, 2, 8, dtype=F64, generator=torch.Generator().manual_seed(4))
    _, full = _run(delta_rule, inputs, do)
    _, part = _run(delta_rule, inputs, do, needs=(True, False, True, False, False))
    assert part[1] is None and part[3] is None and part[4] is None
    assert torch.equal(part[0], full[0]) and torch.equal(part[2], full[2])
    leaves = [t.clone().requires_grad_() for t in inputs]
    o = delta_rule(*leaves, for_backward=True)
    o.backward(do, retain_graph=True)
    with pytest.raises(RuntimeError, match="runs its backward once"):
        o.backward(do)


@pytest.mark.parametrize("for_backward", [False, True])
@pytest.mark.parametrize("S,block", [(300, 64), (300, 128), (256, 128)], ids=str)
def test_blocks_compute_what_one_block_does(S, block, for_backward):
    """A sequence run in blocks of `block` tokens (the last one partial or whole), the
    states carried across them: the output and every gradient equal one block's to fp64
    rounding; a gradient of an input that needs none stays None."""
    inputs = _inputs(2, S, 2, 4, 8, 16, F64)
    do = torch.randn(2, S, 4, 16, dtype=F64, generator=torch.Generator().manual_seed(5))
    ref_o, ref_grads = _run(delta_rule, inputs, do)
    needs = (True, True, True, False, True)
    o, grads = _run(
        lambda *a: delta_rule(*a, for_backward=for_backward, block=block), inputs, do, needs
    )
    assert grads[3] is None
    errors = _errors(o, [g for g in grads if g is not None], ref_o, ref_grads[:3] + ref_grads[4:])
    assert max(errors) < 1e-12, errors


def test_blocks_bound_the_scans_memory():
    """The peak of forward + backward (`upipe.MemoryTracker`) with blocks of S / 8 tokens
    is under a third of one block's (measured: 8.9 and 35.2 fp32 vectors of e per value head
    and token at S = 2,048, d = e = 32); a for_backward forward keeps the states only."""
    from upipe.memory import MemoryTracker

    S = 2048
    inputs = _inputs(1, S, 1, 1, 32, 32, F32)
    do = torch.ones(1, S, 1, 32)
    peaks = {}
    for block in (S, S // 8):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with MemoryTracker() as mem:
            delta_rule(*leaves, block=block).backward(do)
        peaks[block] = mem.peak_bytes
    assert peaks[S // 8] < peaks[S] / 3, peaks


def test_bad_block_and_a_second_backward_are_errors():
    """`block` must be a positive multiple of 64 tokens (ValueError naming it); a forward
    with for_backward=True in blocks refuses a second backward."""
    inputs = _inputs(1, 200, 1, 1, 8, 8, F64)
    for block in (0, 100):
        with pytest.raises(ValueError, match=f"multiple of 64 tokens, got {block}"):
            delta_rule(*inputs, block=block)
    leaves = [t.clone().requires_grad_() for t in inputs]
    o = delta_rule(*leaves, for_backward=True, block=64)
    o.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs its backward once"):
        o.sum().backward()
