"""The planner's search: the longest multiple of a step whose simulated memory fits, in as
few simulated steps as the shape of the memory allows.

What it rests on (and what `tests/runs/test_plan.py` and `tests/runs/test_plan_speed.py` check):
- **monotonic**: no part of the memory decreases with the sequence length, so the answer is
  the unique S that fits with S + step not fitting, whatever lengths were tried on the way:
  every guess below only changes how many steps are simulated, never the answer;
- **piecewise linear**: each part -- the device peak of each phase (forward, backward,
  optimizer) and the host bytes -- is the largest of sums of tensors that each grow
  linearly with the tokens, so once two measured lengths lie on the part's last linear
  piece, the line through them meets the budget at the answer. The guess is the first
  length where any part's line meets it (the parts apart: the overall peak can change
  phase between two lengths, each phase's line does so far less often).

The first length tried is `first` steps (the planner's 16: 1M tokens at the default 64K
granularity, where the memory features' plans are linear already), then twice that (at
least 16), so that the line through the two is the last piece's; a length that cannot fit
by a lower bound of the memory (`device_floor`) is not tried (`over`: the search starts at
one step and doubles below it). A line's crossing
between a length that fits and one that does not is rounded up: where a part is convex (a
simulated depth's peak is the largest of sums that each grow linearly) the chord lies
above it and meets the budget early, so the answer is at least the crossing rounded down
and the length above it is the likelier last one (Llama3-8B's UPipe U=8 with checkpoints
of 2 blocks on 8 GPUs: the chord from 32 to 226 steps crosses at 176.6, the answer is 177,
one simulated step fewer). A line's guess that does not halve the bracket twice in a row
is replaced by bisection, so the search also ends on peaks that are not linear.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

GROWTH = 16  # the longest jump beyond a length known to fit


def _parts(v) -> Sequence[float]:
    return v if isinstance(v, tuple | list) else (v,)


def max_fitting(
    peak: Callable[[int], float | Sequence[float]],
    budget: float,
    step: int,
    max_len: int,
    *,
    first: int = 1,
    over: int | None = None,
):
    """Largest multiple S of `step` (<= max_len) with peak(S) <= budget, for a `peak` that
    does not decrease with S; 0 if not even `step` fits. Returns (S, {S: peak(S) measured}).

    `peak` may return several parts (each non-decreasing; S fits if all are within the
    budget): each part's line is followed on its own (module doc). `first`: the first
    length tried, in steps (then 2 first, then the lines' guesses). `over`: a length in
    steps known not to fit (by a lower bound of the peak, `device_floor`), so the search
    stays below it and grows by doubling until a second length is known. The answer is
    exact: S fits and S + step does not (or S is the limit)."""
    seen: dict[int, float | Sequence[float]] = {}

    def value(k: int):
        if k * step not in seen:
            seen[k * step] = peak(k * step)
        return _parts(seen[k * step])

    k_max = max_len // step
    if k_max < 1:
        return 0, seen
    # lo fits (0: nothing does yet); hi does not (beyond the limit, or `over`)
    lo, hi = 0, min(k_max + 1, over or k_max + 1)
    order, slow = [], 0
    guess = max(1, min(first, k_max))
    while hi - lo > 1:
        bracketed = hi <= k_max
        if bracketed and slow >= 2:
            guess, slow = (lo + hi) // 2, 0
        k = min(max(guess, lo + 1), hi - 1, GROWTH * max(lo, 1))
        width = hi - lo
        if max(value(k)) <= budget:
            lo = k
        else:
            hi = k
        line = len(order) >= 2  # (k was a line's guess, not the first nor one step)
        order.append(k)
        slow = slow + 1 if line and bracketed and 2 * (hi - lo) > width else 0
        guess = _next_guess(order, value, budget, lo, hi, below_over=over is not None)
    return lo * step, seen


def _next_guess(
    order: list[int], value, budget: float, lo: int, hi: int, below_over: bool = False
) -> int:
    """Where to look next: below the first length if nothing fits yet; beyond the only
    length known, twice it and at least `GROWTH` (`below_over`: twice it); else where the
    first part's line through the last two lengths meets the budget, rounded up between a
    length that fits and one that does not (module doc), down beyond both (if every part is
    flat so far, `GROWTH` times the longest that fits)."""
    if lo == 0:
        return 1
    if len(order) < 2:  # (one length, which fits)
        return 2 * lo if below_over else max(2 * lo, GROWTH)
    a, b = order[-2], order[-1]
    crossings = []
    for ya, yb in zip(value(a), value(b), strict=True):
        slope = (yb - ya) / (b - a)
        if slope > 0:
            crossings.append(b + (budget - yb) / slope)
    if not crossings:
        return GROWTH * lo
    between = min(a, b) == lo and max(a, b) == hi  # (the two lengths bracket the answer)
    return (math.ceil if between else math.floor)(min(crossings))


def device_floor(cfg, world: int, model) -> int:
    """Bytes every rank's device holds for certain in a step of `cfg` (a `TrainConfig`) on
    `world` ranks, of `model`'s shapes (`upipe.train.fits.state_bytes`'s terms): the
    weights, gradients and AdamW states (4 P e_m, / world with FSDP; none with
    --fsdp-offload, which keeps them on the host) and, without the chunked loss, the rank's
    B L V logits in fp32 and their log-softmax, both live while the loss's log_softmax runs
    (`upipe.loss.cross_entropy_sum` and transformers' loss upcast the logits first): 8 B L V
    bytes in any compute dtype. Used only to bound the search (`max_fitting`'s `first` and
    `over`)."""
    from upipe.train.config import DTYPES

    e_m = DTYPES[cfg.master_dtype].itemsize
    P = model.num_params()
    state = 0 if cfg.fsdp_offload else 4 * P * e_m // (world if cfg.fsdp else 1)
    dp, ring, uly = cfg.degrees(world)
    logits = 0 if cfg.chunked_loss else cfg.batch_size * cfg.seq_len // (ring * uly)
    return state + logits * model.vocab_size * (4 + 4)
