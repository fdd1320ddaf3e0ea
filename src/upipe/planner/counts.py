"""`timing.count_step`'s exact counts at a fraction of its cost: in the simulator that
already measured the candidate's memory, at the length itself or at two lengths instead of
three.

`timing.count_step` builds two simulators of its own (one per depth, each warmed up) and
counts three lengths at each depth, because it assumes nothing about a count but that it is
a polynomial of degree 2 in S. `count_in` instead steps the jobs of the open simulator `sim`
of the memory check (the same config and depths; `JobSimulator.step` with `depth=`, the
ring's steps and chunk scans in full), and rests on what the step is made of:

- **on the lattice of `timing._count_setup`** (S a multiple k >= 2 of its unit U: whole MLP
  tiles and loss chunks, two tiles or more, where count_step's three lengths lie) it counts
  S itself, once per depth, its tile loops cut to two tiles with the second counted for
  every later one (`sampled.repeated_tiles`): a tile after the first does what the second
  does (`upipe.loops`: only the first iteration may allocate an output or a `.grad`), and
  on the lattice every tile is whole. Where count_step's polynomial is exact, the count of
  S is its value at S;
- **elsewhere, the attention kernel's FLOPs are c S^2 exactly** (`ATTENTION_KEYS`): each
  call counts 2 B h Sq Sk (d + dv) (x 2.5 backward, `timing._attention_forward`), halved
  when causal, with Sq and Sk proportional to S (S / C per rank, S / 2C per ring block) and
  the number of calls independent of S; so one length fixes c, and the second checks it
  (c(S1) S2^2 == c(S2) S1^2, in integers);
- **and every other count is affine in S**: GEMM FLOPs, collective bytes, host copies and
  the bytes of memory-bound ops grow with the tokens (no tensor of the step has more than
  linearly many elements in S: the plans of millions of tokens could not fit otherwise),
  on the lattice of whole MLP tiles and loss chunks where both lengths lie (the two shorter
  lengths S1 < S2 of `timing._count_setup`, counted with full loops).

Where the attention check fails it counts the third length too and fits as `count_step`
does (so a violated premise costs time, never a wrong count); where the config or the
depths are not the memory's it returns None (the caller runs `count_step`). The premises
are not checked at run time: `tests/runs/test_plan_speed.py` compares `count_in` with
`count_step` key by key for every strategy and memory feature set, on the lattice and off
it (and `test_timing` checks `count_step` against closed forms). The counts are then the
same, and so the times and the pick of `--recommend`.

Legend: S sequence, L = S / C tokens per rank, C group size, n blocks, U the lattice's unit.
"""

from __future__ import annotations

from fractions import Fraction

from upipe.planner.timing import COUNT_MULTIPLES, _count, _count_setup, _through

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
    U = xs[0] // COUNT_MULTIPLES[0]  # the lattice's unit
    if seq_len % U == 0 and seq_len >= 2 * U:  # on the lattice: S itself (module doc)
        runs = [[_count(sim, seq_len, depth=n, repeat_tiles=True)] for n in want]
        keys = sorted({k for at_depth in runs for c in at_depth for k in c})
        return _fit(runs, keys, [seq_len], seq_len, want, n_layers, quadratic=())
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
