"""Peak memory: the closed forms in upipe.memory.model against measurement, and UPipe's
head-proportional buffers shrinking as U/H.

Measured on one rank of a C-rank job under the fake process group (same allocations as a
real rank, released deterministically; the gloo runs in test_upipe/bench agree up to
buffers gloo's thread releases late)."""

import pytest
import torch

import upipe
from upipe.heads import plan_rounds, valid_heads_per_stage
from upipe.memory.model import LayerShape, ulysses_peak_units, upipe_peak_units
from upipe.memory.simulate import fake_process_group

SHAPES = [  # (C, S, D, H, G, d): the target shape at 1/4 length, and small ones
    (4, 4096, 512, 16, 4, 32),
    (4, 4096, 512, 16, 16, 32),
    (4, 1024, 256, 8, 2, 32),
    (2, 512, 128, 8, 8, 16),
    (2, 1024, 256, 4, 1, 64),
]


def _module_peak(C, S, D, H, G, d, strategy, U):
    with fake_process_group(C) as group:
        torch.manual_seed(0)
        layer = upipe.ContextParallelAttention(
            D, H, G, d, group=group, strategy=strategy, heads_per_stage=U
        )
        L = S // C
        x = torch.randn(1, L, D, requires_grad=True)
        dy = torch.randn(1, L, D)
        with upipe.MemoryTracker() as mem:
            y = layer(x, torch.arange(L)[None])
            y.backward(dy)
        return mem.peak_bytes


@pytest.mark.parametrize("C,S,D,H,G,d", [s for s in SHAPES if s[4] % s[0] == 0])
def test_ulysses_formula_is_exact(C, S, D, H, G, d):
    sh = LayerShape(B=1, L=S // C, D=D, H=H, G=G, d=d, C=C)
    measured = _module_peak(C, S, D, H, G, d, "ulysses", None) / sh.unit_bytes
    assert measured == pytest.approx(ulysses_peak_units(sh), rel=1e-3)


@pytest.mark.parametrize("C,S,D,H,G,d", SHAPES)
def test_upipe_formula_bounds_measurement(C, S, D, H, G, d):
    """The formula counts the stage and kernel events exactly; transients of the RoPE
    backward and of a round's end, which it leaves out, stay under two stage buffers."""
    sh = LayerShape(B=1, L=S // C, D=D, H=H, G=G, d=d, C=C)
    for U in valid_heads_per_stage(H, G, C):
        measured = _module_peak(C, S, D, H, G, d, "upipe", U) / sh.unit_bytes
        model = upipe_peak_units(sh, U)
        assert model - 1e-3 <= measured <= model + 2 * U / H, (U, measured, model)


def test_upipe_formula_exact_for_gqa_default_stage():
    sh = LayerShape(B=1, L=1024, D=512, H=16, G=4, d=32, C=4)
    measured = _module_peak(4, 4096, 512, 16, 4, 32, "upipe", 4) / sh.unit_bytes
    assert measured == pytest.approx(upipe_peak_units(sh, 4), rel=1e-3)


@pytest.mark.parametrize("G", [8, 4])
def test_head_layout_buffers_scale_as_U_over_H(G):
    """The paper's claim: attention's head-proportional intermediates -- every buffer over the
    full sequence S in the head layout -- shrink to U/H of Ulysses' (for GQA, the kv share
    stays at one kv head per rank per round, which U cannot shrink further)."""
    C, L, H, d = 2, 256, 8, 16
    S = C * L
    peaks = {}
    for name, U in [("ulysses", None), ("upipe", 2), ("upipe", 4), ("upipe", 8)]:
        with fake_process_group(C) as group:
            q = torch.randn(1, L, H, d, requires_grad=True)
            k, v = (torch.randn(1, L, G, d, requires_grad=True) for _ in range(2))
            kw = {} if U is None else {"heads_per_stage": U}
            with upipe.MemoryTracker(count=lambda t: t.dim() == 4 and t.shape[1] == S) as mem:
                out = getattr(upipe, f"{name}_attention")(q, k, v, group=group, **kw)
                out.backward(torch.randn_like(out))
            peaks[U] = mem.counted_peak_bytes
    head = S * d * 4  # one head over the full sequence, fp32
    # Ulysses: q, out, dout, dq (H/C heads each) and k, v, dk, dv (G/C heads each)
    assert peaks[None] == 4 * (H + G) // C * head
    for U in (2, 4, 8):
        k = len(plan_rounds(H, G, C, U)[0].kv_heads) // C  # kv heads per rank per round
        # at most six stage buffers (q, out, dout, dq, two in transit; U/C heads each) and
        # six round buffers (k, v, dk, dv, their fp32 sums; k heads each)
        assert peaks[U] <= (6 * U // C + 6 * k) * head, (U, peaks[U] / head)
    assert peaks[2] < peaks[4] < peaks[8] <= peaks[None]
    if G == H:  # MHA at U = C keeps under twice U/H of Ulysses' head-layout memory
        assert peaks[C] <= 2 * C / H * peaks[None]
