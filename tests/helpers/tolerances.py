"""The tolerances of the whole suite, in one table, and the helpers that judge an error with
them: `rel_err` (relative, with an absolute floor), `grad_errors` (a model's gradients or
weights), `bf16_bound` (bf16 judged against single-device bf16)."""

from __future__ import annotations

import torch

# Relative error bounds, max|actual - ref| / max|ref|, against a float64 reference.
# fp32: all strategies run the same fp32 kernel as a single process would (measured errors
# are ~1e-6). bf16: the kernel itself must stay under "fwd"/"bwd" (single-device bf16
# attention vs float64 measures about 2e-3 to 7e-3 forward, up to 3e-2 backward); a
# distributed strategy in bf16 may be at most "factor" times as wrong as one device running
# the same kernel on the full sequence -- `bf16_bound` below.
TOL = {
    torch.float32: {"fwd": 1e-5, "bwd": 1e-5},
    torch.bfloat16: {"fwd": 1.5e-2, "bwd": 5e-2, "factor": 2.0, "floor": 1e-3},
}
# UPipe vs Ulysses on identical inputs: the same kernel on the same data, up to the order of
# fp32 sums (projections accumulated per stage).
TOL_SAME_KERNEL = 2e-6


# The smallest reference magnitude an error is taken relative to: the size of the operands.
# Rounding noise is relative to the operands and the intermediate sums a kernel forms, not to
# the result: where the result cancels to (near) zero -- the q/k gradients of a row that sees
# one key (a one-token sequence, a window of 1), which are exactly 0 in float64 -- fp32 leaves
# noise of order eps * |operands| (measured up to 5e-7 on this machine's CPU kernel, exactly 0
# on others: the vector width decides), and dividing it by max|ref| ~ 0 reported 1e22 for a
# right answer. The tests draw unit-scale operands (randn), so the floor is 1 times `scale`
# for every dtype (results are gathered to float64 for judging, so the dtype of the result
# says nothing of the dtype it was computed in). A wrong answer is still off by a sizeable
# part of the operands' scale, far above any tolerance of `TOL`.
REL_ERR_FLOOR = 1.0


def rel_err(actual: torch.Tensor, ref: torch.Tensor, *, scale: float = 1.0) -> float:
    """max|actual - ref| / max(max|ref|, REL_ERR_FLOOR * scale).

    `scale`: the magnitude of the operands the judged quantity is computed from, where that
    is not 1 (e.g. a loss gradient divided by the token count)."""
    ref = ref.double()
    floor = REL_ERR_FLOOR * scale
    return ((actual.double() - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


# A model's gradients (and weights) are small without being degenerate -- the loss is a mean
# over many tokens, the weights are initialised at std 0.02 -- so each is judged relative to
# itself down to this fraction of the largest of them, and absolutely below it.
MODEL_FLOOR = 1e-2


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """`rel_err` of each named tensor of a model (gradients; a checkpoint's weights) against
    the reference's, its floor `MODEL_FLOOR` times the largest reference magnitude of all of
    them (not the operands' scale 1 of `rel_err`: a gradient of 1e-3 judged against 1 would
    pass a 1% error)."""
    largest = max(g.abs().max().item() for g in ref.values())
    return {n: rel_err(grads[n], g, scale=MODEL_FLOOR * largest) for n, g in ref.items()}


def bf16_bound(single_device_err: float, summed: int = 1) -> float:
    """Allowed bf16 error of a strategy: a multiple of what one device in bf16 gets wrong.
    `summed`: the result is the fp32 sum of that many partials, each rounded to bf16 by its
    own kernel call, where the one device's call rounds it once (a kv head's gradient when
    the query heads sharing it sit on `summed` ranks, G < C): each extra rounding may add
    half a bf16 ulp, 2^-9, of the largest partial. (Measured: a windowed Ulysses / UPipe dk
    at C = 4, G = 2, 5.85e-3, where one device in a single masked call is 2.57e-3 off.)"""
    bound = max(TOL[torch.bfloat16]["factor"] * single_device_err, TOL[torch.bfloat16]["floor"])
    return bound + (summed - 1) * 2.0**-9
