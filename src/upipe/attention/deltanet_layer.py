"""The pieces of the Gated DeltaNet layer split by heads (`upipe.attention.deltanet` has the
algorithm): the weights seen per head, the stages as this rank runs them, the packed
exchange, the local mix (conv, gates, scan), one stage's output, and Ulysses (all heads at
once, in autograd).

Legend: B batch, S full sequence, L = S / C local tokens, N = B * L, D model width, H value
heads, G key heads, d key head dim, e value head dim, K conv taps, C group size, h value and
g key heads of this rank, n heads of a stage (all ranks'), W packed width, c channels.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from upipe import heads
from upipe.comm import HeadExchange, head_to_seq, seq_to_head
from upipe.heads import Round, plan_schedule
from upipe.kernels_deltanet import Scan, causal_conv

Ranges = heads.Ranges


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaNetWeights:
    """A Gated DeltaNet layer's parameters, heads first (module doc). Value-head tensors are
    `[H, rows, X]`, or `[G, H/G, rows, X]` where the model groups value heads by key head."""

    q: torch.Tensor  # [G, d, D]
    k: torch.Tensor  # [G, d, D]
    v: torch.Tensor  # [H, e, D]
    z: torch.Tensor  # [H, e, D]
    b: torch.Tensor  # [H, 1, D]
    a: torch.Tensor  # [H, 1, D]
    conv_q: torch.Tensor  # [G, d, K]
    conv_k: torch.Tensor  # [G, d, K]
    conv_v: torch.Tensor  # [H, e, K]
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    norm: torch.Tensor  # [e]
    out: torch.Tensor  # [H, e, D] (out_proj's weight [D, H e], heads first)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def of(cls, tensors):
        return cls(**{f.name: t for f, t in zip(dataclasses.fields(cls), tensors, strict=True)})

    @property
    def heads(self) -> tuple[int, int, int, int]:
        """(H, G, d, e)."""
        return self.A_log.shape[0], self.q.shape[0], self.q.shape[1], self.norm.shape[0]


def flat_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of t with a [G, H/G] head grid merged into H heads."""
    return (t.shape[0] * t.shape[1], *t.shape[2:]) if t.dim() == 4 else tuple(t.shape)


def head_slice(w: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Heads first .. first + count - 1 of w (heads at dim 0; a [G, r, ...] grid by flat
    value head): a view, or for a grid a copy of the key heads that cover them."""
    if w.dim() != 4:
        return w.narrow(0, first, count)
    r = w.shape[1]
    j0, j1 = first // r, -(-(first + count) // r)
    return w.narrow(0, j0, j1 - j0).flatten(0, 1).narrow(0, first - j0 * r, count)


def gather_rows(w: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """Rows of the heads of every range, rank-major: `[sum(count) * rows, X]` (or a 1-D
    `[sum(count)]` for a per-head vector)."""
    parts = [head_slice(w, s, n).flatten(0, 1) if w.dim() > 1 else w.narrow(0, s, n)
             for s, n in ranges]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def add_rows_(acc: torch.Tensor, ranges: Ranges, g: torch.Tensor) -> None:
    """acc's heads of the ranges += g (rank-major rows as `gather_rows` lists them); acc has
    the flat shape (`flat_shape`), contiguous; ranges may repeat a head (summed)."""
    per = acc[0].numel()
    g = g.reshape(-1, *acc.shape[1:]) if acc.dim() > 1 else g
    off = 0
    for s, n in ranges:
        acc.narrow(0, s, n).add_(g.narrow(0, off, n))
        off += n
    assert off * per == g.numel()


@dataclasses.dataclass(frozen=True)
class Step:
    """One stage of the schedule as the layer runs it (this rank's view)."""

    keys: Ranges
    """per rank, (first key head, count): its round's key heads"""
    values: Ranges
    """per rank, (first value head, count): its value heads in this stage"""
    first: bool
    """first stage of its round: its exchange carries the round's q, k (forward)"""
    last: bool
    """last stage of its round: its exchange carries the round's dq, dk (backward)"""
    segments: tuple[heads.Segment, ...]
    """this rank's scans: (first value head, value heads, first key head, key heads), local"""

    def widths(self, keys: bool, d: int, e: int) -> tuple[int, ...]:
        """Per rank, the packed width [q | k]? [v | b | a] (module doc)."""
        return tuple(
            (2 * nk * d if keys else 0) + nv * (e + 2)
            for (_, nk), (_, nv) in zip(self.keys, self.values, strict=True)
        )

    def value_counts(self):
        """Per-rank value heads of the output's exchange; None when equal (the even one)."""
        counts = heads.counts(self.values)
        return None if len(set(counts)) == 1 else counts


def _step(rnd, s: int, C: int, rank: int) -> Step:
    """Stage s of round `rnd` as per-rank ranges. An even round's rank c holds k virtual key
    heads from rnd.first + c k (real head = virtual // m) and, of each, stage s's `up` value
    heads: one contiguous run of k up value heads (k > 1 only when up is all of them)."""
    last = s == len(rnd.stages) - 1
    if isinstance(rnd, Round):
        k, m, up = rnd.width // C, rnd.replicas, rnd.stage_width
        keys, values = [], []
        for c in range(C):
            vk = rnd.first + c * k  # the rank's first virtual key head; real = vk // m
            keys.append((vk // m, (vk + k - 1) // m - vk // m + 1))
            values.append((vk * rnd.per_kv + s * up, k * up))
        segments = ((0, k * up, 0, keys[rank][1]),)
        return Step(tuple(keys), tuple(values), s == 0, last, segments)
    return Step(rnd.kv, rnd.stages[s], s == 0, last, rnd.stage_segments[s])


@functools.lru_cache(maxsize=256)
def plan_steps(H: int, G: int, C: int, U: int, rank: int) -> tuple[Step, ...]:
    """Every stage of validated (H, G, C, U) seen from rank `rank`, in order."""
    rounds = plan_schedule(H, G, C, U, rank)
    return tuple(_step(rnd, s, C, rank) for rnd in rounds for s in range(len(rnd.stages)))


# -- the exchanges (upipe.comm's), differentiable ---------------------------------------


def packed_to_heads(t_BLW, widths, ex: HeadExchange):
    """[B, L, W] (rank c's block of widths[c] columns, rank-major) -> [B, S, widths[me]]."""
    B, L, _ = t_BLW.shape
    if len(set(widths)) == 1:
        return seq_to_head(t_BLW.view(B, L, len(widths), -1), ex.group, ex.layout).flatten(2)
    return seq_to_head(t_BLW.view(B, L, -1, 1), ex.group, ex.layout, counts=widths).flatten(2)


def packed_to_sequence(t_BSw, widths, ex: HeadExchange):
    """The inverse of `packed_to_heads`: [B, S, widths[me]] -> [B, L, W]."""
    B, S, _ = t_BSw.shape
    if len(set(widths)) == 1:
        return head_to_seq(t_BSw.unsqueeze(2), ex.group, ex.layout).flatten(2)
    return head_to_seq(t_BSw.unsqueeze(3), ex.group, ex.layout, counts=widths).flatten(2)


class ToHeads(torch.autograd.Function):
    """`packed_to_heads`; backward: `packed_to_sequence` of the gradient."""

    @staticmethod
    def forward(ctx, t_BLW, widths, ex):
        ctx.widths, ctx.ex = widths, ex
        return packed_to_heads(t_BLW.contiguous(), widths, ex)

    @staticmethod
    def backward(ctx, g_BSw):
        return packed_to_sequence(g_BSw.contiguous(), ctx.widths, ctx.ex), None, None


class ValuesToSequence(torch.autograd.Function):
    """o [B, S, h, e] (my value heads) -> [B, L, n, e] (every rank's, rank-major), per-rank
    `counts` (None: equal); backward: the inverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, o_BShe, counts, ex):
        ctx.counts, ctx.ex = counts, ex
        return ex.to_seq(o_BShe.contiguous(), counts)

    @staticmethod
    def backward(ctx, g_BLne):
        return ctx.ex.to_head(g_BLne.contiguous(), ctx.counts), None, None


# -- one stage ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeltaNetPlan:
    """The static part of one call."""

    steps: tuple[Step, ...]
    ex: HeadExchange
    rank: int
    eps: float
    """the gated norm's epsilon"""
    scan: Scan


def packed_rows(w: DeltaNetWeights, step: Step, keys: bool) -> torch.Tensor:
    """The projection rows of the step's exchange, rank c's block [q | k]? [v | b | a]:
    `[W, D]` (a copy)."""
    parts = []
    for kr, vr in zip(step.keys, step.values, strict=True):
        if keys:
            parts += [gather_rows(w.q, (kr,)), gather_rows(w.k, (kr,))]
        parts += [gather_rows(t, (vr,)) for t in (w.v, w.b, w.a)]
    return torch.cat(parts)


def project_exchange(x_ND, w: DeltaNetWeights, step: Step, plan: DeltaNetPlan, keys, B, L):
    """The step's inputs in the head layout `[B, S, w_me]` (no graph: the staged op's)."""
    H, G, d, e = w.heads
    packed_BLW = (x_ND @ packed_rows(w, step, keys).t()).view(B, L, -1)
    return packed_to_heads(packed_BLW, step.widths(keys, d, e), plan.ex)


def split_keys(recv_BSw, step: Step, rank: int, d: int, keep: bool):
    """(q | k channels, the rest) of this rank's received step inputs; `keep`: the q | k part
    outlives the step (a copy, so that the step's buffer can go)."""
    n = 2 * step.keys[rank][1] * d
    qk_BSc = recv_BSw[..., :n]
    return (qk_BSc.clone() if keep else qk_BSc), recv_BSw[..., n:]


@dataclasses.dataclass
class StageWeights:
    """The parameters one step's heads use on this rank in the head layout, as separate
    tensors (leaves in the staged backward): conv taps of its key heads' q | k and of its
    value heads, their A_log and dt_bias, and the norm weight."""

    conv_qk: torch.Tensor
    conv_v: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor

    @classmethod
    def of(cls, w: DeltaNetWeights, step: Step, rank: int):
        kr, vr = (step.keys[rank],), (step.values[rank],)
        conv_qk = torch.cat([gather_rows(w.conv_q, kr), gather_rows(w.conv_k, kr)])
        return cls(
            conv_qk=conv_qk,
            conv_v=gather_rows(w.conv_v, vr),
            A_log=gather_rows(w.A_log, vr),
            dt_bias=gather_rows(w.dt_bias, vr),
            norm=w.norm,
        )

    def tensors(self):
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @staticmethod
    def add_grads(grads: dict, grad_tensors, step: Step, rank: int, d: int) -> None:
        """Add this step's gradients of them (in `tensors()` order) into `grads` (flat fp32
        accumulators by DeltaNetWeights field)."""
        dconv_qk, dconv_v, dA, ddt, dnorm = grad_tensors
        kr, vr = (step.keys[rank],), (step.values[rank],)
        n = step.keys[rank][1] * d
        add_rows_(grads["conv_q"], kr, dconv_qk[:n])
        add_rows_(grads["conv_k"], kr, dconv_qk[n:])
        add_rows_(grads["conv_v"], vr, dconv_v)
        add_rows_(grads["A_log"], vr, dA)
        add_rows_(grads["dt_bias"], vr, ddt)
        grads["norm"].add_(dnorm)


def gated_rms_norm(o, z, weight, eps):
    """RMSNorm of o over its last dim times `weight`, gated by SiLU(z) -- the operations of
    transformers' `Qwen3NextRMSNormGated` (norm in fp32, weight in o's dtype, gate in fp32),
    written out so that the staged backward can pass its own weight leaf."""
    dtype = o.dtype
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(z.float())).to(dtype)


def mix(qk_BSc, vba_BSc, sw: StageWeights, step: Step, scan: Scan, d, e, for_backward=False):
    """This rank's heads of a step on the whole sequence: conv, gates and scan -> o_BShe
    (`for_backward`: the scan's, `upipe.kernels_deltanet.Scan`)."""
    B, S = vba_BSc.shape[:2]
    h = sw.A_log.shape[0]
    if h == 0:  # no value head here in this stage (an uneven split's last stages): an
        # empty view of the input, so that the exchanges' backward still runs on this rank
        return vba_BSc[..., :0].reshape(B, S, 0, e)
    qk_BSc = causal_conv(qk_BSc, sw.conv_qk, scan.docs)
    q_BSc, k_BSc = qk_BSc.chunk(2, dim=-1)
    q_BSgd, k_BSgd = (t.reshape(B, S, -1, d) for t in (q_BSc, k_BSc))
    v_BSc, b_BSh, a_BSh = vba_BSc.split([h * e, h, h], dim=-1)
    v_BShe = causal_conv(v_BSc, sw.conv_v, scan.docs).reshape(B, S, h, e)
    beta_BSh = b_BSh.sigmoid()
    g_BSh = -sw.A_log.float().exp() * F.softplus(a_BSh.float() + sw.dt_bias)
    outs = [
        scan(
            q_BSgd[:, :, k0 : k0 + nk],
            k_BSgd[:, :, k0 : k0 + nk],
            v_BShe[:, :, h0 : h0 + nh],
            g_BSh[..., h0 : h0 + nh],
            beta_BSh[..., h0 : h0 + nh],
            for_backward=for_backward,
        )
        for h0, nh, k0, nk in step.segments
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def gated_output(qk_BSc, vba_BSc, z_BLne, sw: StageWeights, step: Step, plan, d, e,
                 for_backward=False):  # fmt: skip
    """The step's heads (every rank's) before out_proj, `[B, L, n, e]`: mix, the exchange
    back, the gated norm with z (differentiable: the staged backward recomputes it with a
    graph, `for_backward`)."""
    o_BShe = mix(qk_BSc, vba_BSc, sw, step, plan.scan, d, e, for_backward)
    o_BLne = ValuesToSequence.apply(o_BShe, step.value_counts(), plan.ex)
    del o_BShe
    return gated_rms_norm(o_BLne, z_BLne.view(o_BLne.shape), sw.norm, plan.eps)


def ulysses_deltanet(x, w: DeltaNetWeights, plan: DeltaNetPlan):
    """All heads at once, in autograd: one exchange of q, k, v, b, a to the head layout,
    one of o back (module doc)."""
    (step,) = plan.steps
    B, L, D = x.shape
    H, G, d, e = w.heads
    x_ND = x.reshape(B * L, D)
    packed_BLW = (x_ND @ packed_rows(w, step, keys=True).t()).view(B, L, -1)
    recv_BSw = ToHeads.apply(packed_BLW, step.widths(True, d, e), plan.ex)
    del packed_BLW
    qk_BSc, vba_BSc = split_keys(recv_BSw, step, plan.rank, d, keep=False)
    z_ND = x_ND @ gather_rows(w.z, step.values).t()
    sw = StageWeights.of(w, step, plan.rank)
    out_BLne = gated_output(qk_BSc, vba_BSc, z_ND, sw, step, plan, d, e)
    return (out_BLne.reshape(B * L, -1) @ gather_rows(w.out, step.values)).view(B, L, D)
