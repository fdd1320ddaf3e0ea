"""`timing.count_step`'s exact counts at a third of its cost: in the simulator that already
measured the candidate's memory, at two lengths instead of three.

`timing.count_step` builds two simulators of its own (one per depth, each with a warm-up
step) and counts three lengths at each depth, because it assumes nothing about a count but
that it is a polynomial of degree 2 in S. `count_in` instead steps the jobs of the open
simulator `sim` of the memory check (the same config and depths; `JobSimulator.step` with
`depth=`, full loops) at the two shorter lengths S1 < S2 of `timing._count_setup`, and rests
on what the step is made of:

- **the attention kernel's FLOPs are c S^2 exactly** (`ATTENTION_KEYS`): each call counts
  2 B h Sq Sk (d + dv) (x 2.5 backward, `timing._attention_forward`), halved when causal,
  with Sq and Sk proportional to S (S / C per rank, S / 2C per ring block) and the number
  of calls independent of S; so one length fixes c, and the second checks it
  (c(S1) S2^2 == c(S2) S1^2, in integers);
- **every other count is affine in S**: GEMM FLOPs, collective bytes, host copies and the
  bytes of memory-bound ops grow with the tokens (no tensor of the step has more than
  linearly many elements in S: the plans of millions of tokens could not fit otherwise),
  on the lattice of whole MLP tiles and loss chunks where both lengths lie.

Where the attention check fails it counts the third length too and fits as `count_step`
does (so a violated first premise costs time, never a wrong count); where the config or the
depths are not the memory's it returns None (the caller runs `count_step`). The second
premise is not checked at run time: `tests/runs/test_plan_speed.py` compares `count_in` with
`count_step` key by key for every strategy and memory feature set (and `test_timing` checks
`count_step` against closed forms). The counts are then the same, and so the times and the
pick of `--recommend`.

Legend: S sequence, L = S / C tokens per rank, C group size, n blocks.
"""

from __future__ import annotations

from fractions import Fraction

from upipe.planner.timing import _count, _count_setup, _through

ATTENTION_KEYS = ("attention_forward_flops", "attention_backward_flops")


def count_in(sim, cfg, world: int, model, seq_len: int, *, unit: int, depths):
    """`count_step(cfg, world, model, seq_len, unit=unit, depths=depths, kernels=sim.kernels)`
    counted in the open simulator `sim` of `cfg` (module doc): the same {name: count}; None
    where `sim` cannot count it (another config or other depths: call `count_step` once
    `sim` is closed, as a process holds one simulator at a time)."""
    n_layers = model.n_layers
    want = tuple(sorted(set(depths))) if max(depths) < n_layers else (n_layers,)
    counted_cfg, xs = _count_setup(cfg, world, seq_len, unit)
    if counted_cfg != cfg or tuple(sim.depths) != want:
        return None
    runs = [[_count(sim, S, depth=n) for S in xs[:2]] for n in want]
    keys = sorted({k for at_depth in runs for c in at_depth for k in c})
    (S1, S2), (S3,) = xs[:2], xs[2:]
    for at_depth in runs:
        for key in ATTENTION_KEYS:
            c1, c2 = (c.get(key, 0) for c in at_depth)
            if c1 * S2 * S2 != c2 * S1 * S1:  # not c S^2: count the third length too
                runs = [[*c, _count(sim, S3, depth=n)] for c, n in zip(runs, want, strict=True)]
                keys = sorted({k for at_depth in runs for c in at_depth for k in c})
                return _fit(runs, keys, xs, seq_len, want, n_layers, quadratic=())
    return _fit(runs, keys, xs[:2], seq_len, want, n_layers, quadratic=ATTENTION_KEYS)


def _fit(runs, keys, xs, seq_len, depths, n_layers, *, quadratic) -> dict[str, int]:
    """Each key at `seq_len` and the model's depth from its counts `runs[depth][length]`:
    through the lengths `xs` (a polynomial of degree len(xs) - 1; for the `quadratic` keys
    c S^2 through the first), then the line through the two depths (as `count_step`)."""
    out = {}
    for key in keys:
        ys = []
        for at_depth in runs:
            c = [x.get(key, 0) for x in at_depth]
            if key in quadratic:
                ys.append(Fraction(c[0]) * seq_len * seq_len / (xs[0] * xs[0]))
            else:
                ys.append(_through(xs, c, seq_len))
        if len(ys) == 2:  # c(n) = c(n1) + (c(n1) - c(n0)) (n - n1) / (n1 - n0)
            (n0, n1), (y0, y1) = depths, ys
            ys = [y1 + (y1 - y0) * Fraction(n_layers - n1, n1 - n0)]
        out[key] = round(ys[0])
    return out
