"""Ulysses and UPipe attention in JAX, per device inside `jax.shard_map` over one mesh axis.

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads (query
head h uses kv head h // (H / G)), d head dim, C size of the mesh axis, U heads per stage,
u = U / C query heads per device per stage, k kv heads per device per round.

Ulysses: q_BLHd, k_BLGd, v_BLGd --seq_to_head--> [B, S, H/C | G/C, d], local attention,
out_BShd --head_to_seq--> out_BLHd. Autodiff keeps what the kernel keeps (q, k, v, out in the
head layout, lse) -- 2(H + G')/C heads over S tokens (G' = max(G, C)), plus the
exchanges' transients.

UPipe: the same, H / U times on U heads (`upipe.heads.plan_rounds`' GQA-aware stages, the
PyTorch op's schedule): per round the round's C*k kv heads are exchanged once, then each of
its stages exchanges its U query heads, attends and sends its output back:

    for r in rounds:   k_BSkd, v_BSkd = seq_to_head(kv heads of r)
        for s in stages of r:   out_BSud = attention(seq_to_head(q_BLUd of (r, s)), k_BSkd, v_BSkd)
                                out_BLHd[heads of (r, s)] = head_to_seq(out_BSud)

Both loops are `lax.scan`s, so one stage's buffers exist at a time, and each body is a
`jax.checkpoint` with `POLICY`: backward keeps only the kernel's output and log-sum-exp per
stage (the paper's residuals; one [B, L, H, d] tensor and [B, H, S]/C fp32 in all) and
recomputes the rest -- the stage's q, a round's k and v and their exchanges -- before
running the kernel's backward. dK/dV of a round are summed over its stages (in the
cotangent of the round's k_BSkd, v_BSkd) and sent back once.

When G < C the G kv heads are repeated C / G times before the exchange (every device gets
the one its query heads use); autodiff sums the copies' gradients.

Validation runs while tracing, before any collective is staged, and is the same on every
device and process of the mesh.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from upipe.heads import check_heads_per_stage, even_problem, kv_problem, plan_rounds
from upipe.jax.comm import head_to_seq, seq_to_head
from upipe.jax.kernel import LSE, OUT, attention

POLICY = jax.checkpoint_policies.save_only_these_names(OUT, LSE)
"""What backward keeps of a UPipe stage: the kernel's output and log-sum-exp."""


def check_heads(H: int, G: int, C: int) -> None:
    """ValueError unless G divides H and the heads split evenly over the C devices
    (`upipe.heads`: C | H, and G, C dividing one another; this port has no uneven split)."""
    problem = kv_problem(H, G)
    if problem:
        raise ValueError(problem)
    problem = even_problem(H, G, C, size="mesh axis size")
    if problem:
        raise ValueError(
            f"{problem} (the PyTorch ops split other head counts unevenly; upipe.jax does not)"
        )


def check_qkv(q, k, v) -> tuple[int, int]:
    """(H, G) of q `[B, L, H, d]` and k, v `[B, L, G, d]`, or a ValueError naming the shapes."""
    shapes = tuple(tuple(getattr(t, "shape", ())) for t in (q, k, v))
    if any(len(s) != 4 for s in shapes) or shapes[1] != shapes[2]:
        raise ValueError(f"q, k, v must be [B, L, H, d], [B, L, G, d] twice; got {shapes}")
    if shapes[0][:2] != shapes[1][:2] or shapes[0][3] != shapes[1][3]:
        raise ValueError(f"q {shapes[0]} and k, v {shapes[1]} differ in B, L or d")
    return shapes[0][2], shapes[1][2]


@dataclasses.dataclass(frozen=True)
class StageGrid:
    """The head schedule of `upipe.heads.plan_rounds` as array axes. Query heads
    form the grid [rounds, width, stages, stage_width] (row-major, = H): stage (r, s) is
    rows `width` of round r, columns s; the `width` = C*k virtual kv heads of round r are
    real kv heads r*width/replicas .. each repeated `replicas` times. Listed rank-major, so
    after `seq_to_head` device c holds u query heads and the k kv heads they use (standard
    GQA locally)."""

    rounds: int
    width: int
    stages: int
    stage_width: int
    replicas: int

    @classmethod
    def plan(cls, H: int, G: int, C: int, heads_per_stage) -> StageGrid:
        check_heads(H, G, C)
        rounds = plan_rounds(H, G, C, check_heads_per_stage(H, G, C, heads_per_stage))
        first = rounds[0]
        return cls(len(rounds), first.width, len(first.stages), first.stage_width, first.replicas)

    def _grid(self, t, axis):
        shape = (self.rounds, self.width, self.stages, self.stage_width)
        return t.reshape(*t.shape[:axis], *shape, *t.shape[axis + 1 :])

    def take_q(self, t, axis, r, s):
        """Stage (r, s)'s U query heads of t (H heads at `axis`)."""
        t = lax.dynamic_index_in_dim(self._grid(t, axis), r, axis, keepdims=False)
        t = lax.dynamic_index_in_dim(t, s, axis + 1, keepdims=False)
        return t.reshape(*t.shape[:axis], -1, *t.shape[axis + 2 :])

    def put_q(self, t, axis, r, s, x):
        """t with stage (r, s)'s query heads (H at `axis`) replaced by x (U at `axis`)."""
        grid = self._grid(t, axis)
        x = x.reshape(*x.shape[:axis], 1, self.width, 1, self.stage_width, *x.shape[axis + 1 :])
        start = [0] * grid.ndim
        start[axis], start[axis + 2] = r, s
        return lax.dynamic_update_slice(grid, x.astype(t.dtype), start).reshape(t.shape)

    def take_kv(self, t, axis, r):
        """Round r's `width` virtual kv heads of t (G real heads at `axis`)."""
        real = t.reshape(*t.shape[:axis], self.rounds, -1, *t.shape[axis + 1 :])
        real = lax.dynamic_index_in_dim(real, r, axis, keepdims=False)
        return jnp.repeat(real, self.replicas, axis=axis) if self.replicas > 1 else real


def run_stages(carry, grid: StageGrid, kv_of_round, stage):
    """Folds `stage(carry, r, s, kv)` over rounds r and their stages s, `kv = kv_of_round(r)`
    computed once per round; rounds and stages are scans of checkpointed bodies (`POLICY`)."""

    def one_round(carry, r):
        kv = kv_of_round(r)

        def one_stage(carry, s):
            return stage(carry, r, s, kv), None

        body = jax.checkpoint(one_stage, policy=POLICY, prevent_cse=False)
        return lax.scan(body, carry, jnp.arange(grid.stages))[0], None

    body = jax.checkpoint(one_round, policy=POLICY, prevent_cse=False)
    return lax.scan(body, carry, jnp.arange(grid.rounds))[0]


def ulysses_attention(
    q_BLHd, k_BLGd, v_BLGd, *, axis_name, causal=True, softmax_scale=None, block_size=512
):
    """Ulysses attention of this device's tokens (call inside `shard_map`; the sequence is
    split contiguously over `axis_name`). q `[B, L, H, d]`, k/v `[B, L, G, d]` -> `[B, L, H,
    d]`. C must divide H, and G and C one another (G < C: kv heads replicated)."""
    H, G = check_qkv(q_BLHd, k_BLGd, v_BLGd)
    C = lax.axis_size(axis_name)
    check_heads(H, G, C)
    m = max(1, C // G)
    k_BLGd, v_BLGd = (jnp.repeat(t, m, axis=2) if m > 1 else t for t in (k_BLGd, v_BLGd))
    q_BShd, k_BSkd, v_BSkd = (seq_to_head(t, axis_name) for t in (q_BLHd, k_BLGd, v_BLGd))
    out_BShd = attention(
        q_BShd, k_BSkd, v_BSkd, causal=causal, scale=softmax_scale, block_size=block_size
    )
    return head_to_seq(out_BShd, axis_name)


def upipe_attention(
    q_BLHd,
    k_BLGd,
    v_BLGd,
    *,
    axis_name,
    heads_per_stage=None,
    causal=True,
    softmax_scale=None,
    block_size=512,
):
    """`ulysses_attention` in stages of `heads_per_stage` (U) heads; the same result. U
    defaults to C (one head per device per stage); valid: multiples of C that divide H and
    fit the GQA schedule (the ValueError lists them); U = H is one stage."""
    H, G = check_qkv(q_BLHd, k_BLGd, v_BLGd)
    grid = StageGrid.plan(H, G, lax.axis_size(axis_name), heads_per_stage)
    attend = functools.partial(attention, causal=causal, scale=softmax_scale, block_size=block_size)

    def kv_of_round(r):
        return tuple(seq_to_head(grid.take_kv(t, 2, r), axis_name) for t in (k_BLGd, v_BLGd))

    def stage(out_BLHd, r, s, kv):
        q_BSud = seq_to_head(grid.take_q(q_BLHd, 2, r, s), axis_name)
        out_BLUd = head_to_seq(attend(q_BSud, *kv), axis_name)
        return grid.put_q(out_BLHd, 2, r, s, out_BLUd)

    return run_stages(jnp.zeros_like(q_BLHd), grid, kv_of_round, stage)
