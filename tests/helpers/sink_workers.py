"""Per-rank functions and float64 references for the attention-sink tests (test_sinks.py).

The reference appends the sink logit as an explicit extra column of the S x S scores (as
transformers' gpt-oss `eager_attention_forward` does), softmaxes, drops the column and
runs plain autograd in float64: the ground truth every strategy is compared with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from document_workers import doc_mask, module_doc_reference
from usp_workers import mesh_of
from workers import MODULE_ARGS, make_module_inputs, make_qkv, make_weights

import upipe
from upipe.attention.common import forget_agreements
from upipe.comm import sequence_positions, shard_sequence, unshard_sequence
from upipe.packing import document_positions


def make_sinks(H, seed=7):
    """Sink logits of order 1 (comparable to a row's lse at these sizes, so they matter)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, generator=gen, dtype=torch.float64) + 1.0


def sink_attention(q, k, v, allowed, sinks_H, scale=None):
    """softmax over [allowed keys' q.k, sink] with the sink column dropped, times v."""
    B, S, H, d = q.shape
    G = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    s = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(H // G, 2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    col = sinks_H.view(1, H, 1, 1).expand(B, H, S, 1)
    p = torch.cat([s, col], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhst,bthd->bshd", p, v.repeat_interleave(H // G, 2))


def _cu(cu, S):
    return [0, S] if cu is None else cu


def reference(shape, cu=None, window=None):
    """(out, dq, dk, dv, d sinks) over the full sequence in float64."""
    q, k, v, dout = (t.double().requires_grad_() for t in make_qkv(**shape))
    sinks = make_sinks(shape["H"]).requires_grad_()
    allowed = doc_mask(_cu(cu, shape["S"]), shape["S"], True, window)
    out = sink_attention(q, k, v, allowed, sinks)
    out.backward(dout.detach())
    return [t.detach() for t in (out, q.grad, k.grad, v.grad, sinks.grad)]


def one_device(shape, cu, dtype, window=None):
    """The same attention on one device in `dtype`: upipe's kernel calls, then the sinks."""
    from upipe.attention import sinks as sink_ops
    from upipe.attention.documents import local_backward, local_forward
    from upipe.packing import check_cu_seqlens

    q, k, v, dout = (t.to(dtype) for t in make_qkv(**shape))
    sinks = make_sinks(shape["H"]).to(dtype)
    bounds = check_cu_seqlens(_cu(cu, shape["S"]), shape["S"])
    kw = dict(causal=True, softmax_scale=None, backend=None, window=window)
    out, lse = local_forward(q, k, v, bounds, **kw)
    lse = sink_ops.apply_(out, lse, sinks)
    dsinks = sink_ops.grad(dout, out, lse, sinks).to(dtype)
    return [out, *local_backward(dout, q, k, v, out, lse, bounds, **kw), dsinks]


def _install():
    import cuda_emulation
    import varlen_emulation

    cuda_emulation.install()
    varlen_emulation.install()


def run(rank, world_size, strategy, shape, kwargs, cu, dtype=torch.float32, emulate=False):
    """Forward+backward of a functional strategy with sinks on a 1-D group: (out, dq, dk, dv
    gathered to the full sequence, this rank's d sinks), fp64."""
    if emulate:
        _install()
    group = dist.group.WORLD
    layout = kwargs.setdefault("layout", "zigzag" if strategy == "ring" else "contiguous")
    q, k, v, dout = make_qkv(**shape, dtype=dtype)
    sinks = make_sinks(shape["H"]).to(dtype).requires_grad_()
    shard = lambda t: shard_sequence(t, group=group, layout=layout)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    fn = getattr(upipe, f"{strategy}_attention")
    docs = None if cu is None else torch.tensor(cu)
    out = fn(*leaves, group=group, cu_seqlens=docs, sinks=sinks, **kwargs)
    out.backward(shard(dout))
    gather = lambda t: unshard_sequence(t.detach().double(), group=group, layout=layout)  # noqa: E731
    return [gather(t) for t in (out, *(x.grad for x in leaves))], sinks.grad.double()


def run_mesh(rank, world_size, dims, strategy, shape, kwargs, cu):
    """As `run` on a (dp, ring, ulysses) mesh: (positions, [out, dq, dk, dv], d sinks)."""
    mesh = mesh_of(dims)
    layout = kwargs.get("layout", "zigzag")
    q, k, v, dout = make_qkv(**shape)
    sinks = make_sinks(shape["H"]).float().requires_grad_()
    leaves = [shard_sequence(t, mesh=mesh, layout=layout).requires_grad_() for t in (q, k, v)]
    fn = getattr(upipe, f"{strategy}_attention")
    out = fn(*leaves, mesh=mesh, cu_seqlens=torch.tensor(cu), sinks=sinks, **kwargs)
    out.backward(shard_sequence(dout, mesh=mesh, layout=layout))
    pos = sequence_positions(shape["S"], mesh=mesh, layout=layout)
    res = [t.detach().double() for t in (out, *(x.grad for x in leaves))]
    return pos, res, sinks.grad.double()


WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_reference(cfg, cu, window=None):
    """y, dx, weight and sink gradients of the attention layer with sinks in fp64; RoPE
    positions restart per document (`document_workers.module_doc_reference`)."""
    sinks = make_sinks(cfg["num_heads"]).requires_grad_()

    def attend(q, k, v, allowed):
        return sink_attention(q, k, v, allowed, sinks)

    ref = module_doc_reference(cfg, cu, window, attend)
    return {**ref, "sinks": sinks.grad}


def _module(cfg, kwargs, where, emulate=False):
    if emulate:
        _install()
    layer = upipe.ContextParallelAttention(*(cfg.get(a) for a in MODULE_ARGS), sinks=True,
                                           **where, **kwargs)  # fmt: skip
    with torch.no_grad():
        for n, t in make_weights(cfg).items():
            getattr(layer, n).weight.copy_(t)
        layer.sinks.copy_(make_sinks(cfg["num_heads"]))
    return layer


def _grads(layer):
    grads = {n: getattr(layer, n).weight.grad.double() for n in WEIGHTS}
    return {**grads, "sinks": layer.sinks.grad.double()}


def run_module(rank, world_size, cfg, kwargs, cu, emulate=False):
    """ContextParallelAttention(sinks=True) on a 1-D group with documents: y, dx gathered in
    order, and this rank's weight and sink gradient shares."""
    group = dist.group.WORLD
    layer = _module(cfg, kwargs, {"group": group}, emulate)
    x, dy, _ = make_module_inputs(**cfg)
    S = x.shape[1]
    shard = lambda t: shard_sequence(t, group=group, layout=layer.layout)  # noqa: E731
    mine = sequence_positions(S, rank=rank, world_size=world_size, layout=layer.layout)
    pos = document_positions(cu, S)[mine][None].expand(x.shape[0], -1)
    xs = shard(x).requires_grad_()
    y = layer(xs, pos, cu_seqlens=torch.tensor(cu))
    y.backward(shard(dy))
    gather = lambda t: unshard_sequence(t.double(), group=group, layout=layer.layout)  # noqa: E731
    return {"y": gather(y.detach()), "dx": gather(xs.grad), **_grads(layer)}


def run_module_mesh(rank, world_size, dims, cfg, kwargs, cu):
    """ContextParallelAttention(sinks=True, mesh=): positions, y, dx, gradient shares."""
    mesh = mesh_of(dims)
    layer = _module(cfg, kwargs, {"mesh": mesh})
    x, dy, _ = make_module_inputs(**cfg)
    mine = sequence_positions(x.shape[1], mesh=mesh, layout=layer.layout)
    pos = document_positions(cu, x.shape[1])[mine][None].expand(x.shape[0], -1)
    xs = shard_sequence(x, mesh=mesh, layout=layer.layout).requires_grad_()
    y = layer(xs, pos, cu_seqlens=torch.tensor(cu))
    y.backward(shard_sequence(dy, mesh=mesh, layout=layer.layout))
    return {"pos": mine, "y": y.detach().double(), "dx": xs.grad.double(), **_grads(layer)}


def checkpointed(rank, world_size, cfg, kwargs, cu):
    """The layer inside an activation checkpoint, attention outputs "recompute" vs "keep":
    (keep's dx, weight and sink gradients equal recompute's bit for bit, recompute's
    gradients of this rank)."""
    from upipe.model.features import activation_checkpoint

    group, out = dist.group.WORLD, {}
    for mode in ("recompute", "keep"):
        layer = _module(cfg, kwargs, {"group": group})
        x, _, _ = make_module_inputs(**cfg)
        mine = sequence_positions(x.shape[1], rank=rank, world_size=world_size,
                                  layout=layer.layout)  # fmt: skip
        pos = document_positions(cu, x.shape[1])[mine][None].expand(x.shape[0], -1)
        xs = shard_sequence(x, group=group, layout=layer.layout).requires_grad_()

        def fn(h, pos, layer=layer):
            return torch.tanh(layer(h, pos, cu_seqlens=cu))

        activation_checkpoint(fn, xs, pos, attention_outputs=mode).square().sum().backward()
        out[mode] = [xs.grad, *(p.grad for p in layer.parameters())]
    same = all(torch.equal(a, b) for a, b in zip(out["recompute"], out["keep"], strict=True))
    return same


def bad_sinks(rank, world_size, shape, make):
    """Each functional op called with `make(H, rank)` as sinks (a first call: the ranks
    exchange verdicts); the ValueError messages (None where none was raised)."""
    group = dist.group.WORLD
    q, k, v, _ = make_qkv(**shape)
    q, k, v = (shard_sequence(t, group=group) for t in (q, k, v))
    errors = []
    for op in (upipe.ulysses_attention, upipe.upipe_attention, upipe.ring_attention):
        forget_agreements()
        try:
            op(q, k, v, group=group, sinks=make(shape["H"], rank))
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors
