"""Per-rank functions for the distributed tests (module-level so spawned ranks import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import upipe
from upipe.attention.common import forget_agreements


def make_qkv(*, B, S, H, G, d, dtype=torch.float32, seed=0):
    """Full-sequence q, k, v and an output gradient, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, d, generator=gen)
    k = torch.randn(B, S, G, d, generator=gen)
    v = torch.randn(B, S, G, d, generator=gen)
    dout = torch.randn(B, S, H, d, generator=gen)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def run_functional(rank, world_size, strategy, shape, kwargs, dtype=torch.float32):
    """Forward+backward of a functional strategy on this rank's shard.

    Returns this rank's (out, dq, dk, dv) shards as fp64 CPU tensors.
    """
    group = dist.group.WORLD
    q, k, v, dout = make_qkv(**shape, dtype=dtype)
    leaves = [upipe.shard_sequence(t, group=group).requires_grad_() for t in (q, k, v)]
    fn = getattr(upipe, f"{strategy}_attention")
    out = fn(*leaves, group=group, **kwargs)
    out.backward(upipe.shard_sequence(dout, group=group))
    return [t.detach().double() for t in (out, *(x.grad for x in leaves))]


def expect_error(rank, world_size, strategy, shapes_by_rank, kwargs):
    """Call a strategy with per-rank shapes; return (exception type name, message) or None."""
    group = dist.group.WORLD
    shape = shapes_by_rank[rank] if isinstance(shapes_by_rank, list) else shapes_by_rank
    q, k, v = (torch.randn(*s) if isinstance(s, tuple) else s for s in shape)
    fn = getattr(upipe, f"{strategy}_attention")
    forget_agreements()  # a first call: ranks whose inputs differ must exchange verdicts
    try:
        fn(q, k, v, group=group, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def reference(q, k, v, dout, *, causal=True, softmax_scale=None):
    """Full-sequence attention and its gradients in float64 (the ground truth)."""
    from upipe.kernels import attention_backward, attention_forward

    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    kw = dict(causal=causal, softmax_scale=softmax_scale, backend="reference")
    out, lse = attention_forward(q, k, v, **kw)
    return (out, *attention_backward(dout, q, k, v, out, lse, **kw))


def comm_roundtrip(rank, world_size, B, L, H, d):
    """seq_to_head / head_to_seq on known data; returns what each rank saw."""
    from upipe.comm import head_to_seq, seq_to_head

    group = dist.group.WORLD
    S = L * world_size
    # full[b, s, h, e] = a unique number; rank r holds tokens r*L .. (r+1)*L-1
    full = torch.arange(B * S * H * d, dtype=torch.float64).view(B, S, H, d)
    x_BLHd = upipe.shard_sequence(full, group=group)
    x_BShd = seq_to_head(x_BLHd, group)
    back = head_to_seq(x_BShd, group)
    # adjoint (what every strategy's backward relies on): the gradient of
    # sum(w * seq_to_head(x)) is head_to_seq(w), and the other way round
    w = torch.randn(
        x_BShd.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
    )
    w2 = torch.randn(x_BLHd.shape, dtype=torch.float64)
    y, y2 = x_BLHd.clone().normal_(), x_BShd.clone().normal_()
    dots = torch.stack(
        [
            (seq_to_head(y, group) * w).sum(),
            (y * head_to_seq(w, group)).sum(),
            (head_to_seq(y2, group) * w2).sum(),
            (y2 * seq_to_head(w2, group)).sum(),
        ]
    )
    dist.all_reduce(dots, group=group)
    return {
        "expected_BShd": full[:, :, rank * (H // world_size) : (rank + 1) * (H // world_size)],
        "x_BShd": x_BShd,
        "roundtrip_exact": torch.equal(back, x_BLHd),
        "grad_ok": torch.allclose(dots[0], dots[1], rtol=1e-12),
        "grad2_ok": torch.allclose(dots[2], dots[3], rtol=1e-12),
        "unshard_ok": torch.equal(upipe.unshard_sequence(x_BLHd, group=group), full),
    }


def attention_autograd(q, k, v, *, causal=True, scale=None):
    """softmax(QK^T)V with plain ops (differentiable; materialises S x S: tiny shapes only)."""
    H, G, S, d = q.shape[2], k.shape[2], q.shape[1], q.shape[3]
    scale = d**-0.5 if scale is None else scale
    s = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(H // G, 2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhst,bthd->bshd", s.softmax(-1), v.repeat_interleave(H // G, 2))


MODULE_ARGS = ("dim", "num_heads", "num_kv_heads", "head_dim")


def make_module_inputs(*, B, S, dim, seed=0, dtype=torch.float32, **_):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, S, dim, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, S, dim, generator=gen, dtype=torch.float64)
    # batch row b starts at position 3*b: positions are global and need not start at 0
    pos = torch.arange(S)[None] + 3 * torch.arange(B)[:, None]
    return x.to(dtype), dy.to(dtype), pos


def make_weights(cfg, seed=0, dtype=torch.float32, qk_norm=False):
    gen = torch.Generator().manual_seed(seed)
    D, H, G = cfg["dim"], cfg["num_heads"], cfg["num_kv_heads"]
    d = cfg.get("head_dim") or D // H
    shapes = {
        "q_proj": (H * d, D),
        "k_proj": (G * d, D),
        "v_proj": (G * d, D),
        "o_proj": (D, H * d),
    }
    w = {n: (torch.randn(s, generator=gen) / D**0.5).to(dtype) for n, s in shapes.items()}
    if qk_norm:  # norm weights away from 1, so that their gradients are tested
        w.update({n: (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype) for n in NORMS})
    return w


NORMS = ("q_norm", "k_norm")


def module_reference(
    cfg, *, causal=True, interleaved=False, theta=10000.0, qk_norm=False, scale=None
):
    """y, dx and the weight gradients of the attention layer on the full sequence, in fp64."""
    from upipe.rope import apply_rope, rope_cos_sin

    x, dy, pos = make_module_inputs(**cfg, dtype=torch.float64)
    weights = make_weights(cfg, dtype=torch.float64, qk_norm=qk_norm)
    w = {n: t.double().requires_grad_() for n, t in weights.items()}
    x.requires_grad_()
    B, S, _ = x.shape
    d = cfg.get("head_dim") or cfg["dim"] // cfg["num_heads"]
    cos, sin = rope_cos_sin(pos, d, theta=theta, interleaved=interleaved, dtype=torch.float64)
    q, k = (x @ w["q_proj"].t()).view(B, S, -1, d), (x @ w["k_proj"].t()).view(B, S, -1, d)
    if qk_norm:  # RMSNorm over each head's d features, written out
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * w["q_norm"]
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * w["k_norm"]
    q = apply_rope(q, cos, sin, interleaved=interleaved)
    k = apply_rope(k, cos, sin, interleaved=interleaved)
    v = (x @ w["v_proj"].t()).view(B, S, -1, d)
    y = attention_autograd(q, k, v, causal=causal, scale=scale).flatten(2) @ w["o_proj"].t()
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, **{n: t.grad for n, t in w.items()}}


def run_module(rank, world_size, cfg, kwargs, dtype=torch.float32):
    """Forward+backward of ContextParallelAttention on this rank's shard.

    Returns the y and dx shards and this rank's weight-gradient contributions (fp64).
    """
    return run_module_on(dist.group.WORLD, cfg, kwargs, dtype)


def run_module_on(group, cfg, kwargs, dtype=torch.float32):
    """`run_module` over `group`."""
    x, dy, pos = make_module_inputs(**cfg, dtype=dtype)
    layer = upipe.ContextParallelAttention(
        *(cfg.get(a) for a in MODULE_ARGS), group=group, dtype=dtype, **kwargs
    )
    qk_norm = kwargs.get("qk_norm", False)
    offset = kwargs.get("norm_offset", 0.0)  # the same norm: its weight shifted by the offset
    with torch.no_grad():
        for n, t in make_weights(cfg, dtype=dtype, qk_norm=qk_norm).items():
            getattr(layer, n).weight.copy_(t - offset if n in NORMS else t)
    xs = upipe.shard_sequence(x, group=group).requires_grad_()
    y = layer(xs, upipe.shard_sequence(pos, group=group))
    y.backward(upipe.shard_sequence(dy, group=group))
    names = ("q_proj", "k_proj", "v_proj", "o_proj") + (NORMS if qk_norm else ())
    grads = {n: getattr(layer, n).weight.grad.double() for n in names}
    return {"y": y.detach().double(), "dx": xs.grad.double(), **grads}


def functional_or_error(rank, world_size, strategy, shape, kwargs):
    """Like run_functional, but a TypeError/ValueError is returned as (type name, message)."""
    try:
        return run_functional(rank, world_size, strategy, shape, kwargs)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)


def module_under_hooks(rank, world_size, cfg, kwargs):
    """The module's gradients with saved tensors offloaded to CPU (saved-tensor hooks on)."""
    with torch.autograd.graph.save_on_cpu():
        return run_module(rank, world_size, cfg, kwargs)


def double_backward_error(rank, world_size, what):
    """Backward twice through the functional Ulysses op or the fused UPipe module."""
    group = dist.group.WORLD
    if what == "ulysses":
        q = torch.randn(1, 8, 4, 8, requires_grad=True)
        out = upipe.ulysses_attention(q, q, q, group=group)
    else:
        layer = upipe.ContextParallelAttention(16, 4, 2, group=group, strategy="upipe")
        out = layer(torch.randn(1, 8, 16), torch.arange(8)[None] + 8 * rank)
    out.sum().backward(retain_graph=True)
    try:
        out.sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def run_functional_layout(rank, world_size, strategy, shape, kwargs, layout):
    """run_functional in a given sequence layout; returns the shards gathered back in order."""
    group = dist.group.WORLD
    q, k, v, dout = make_qkv(**shape)
    leaves = [
        upipe.shard_sequence(t, group=group, layout=layout).requires_grad_() for t in (q, k, v)
    ]
    out = getattr(upipe, f"{strategy}_attention")(*leaves, group=group, layout=layout, **kwargs)
    out.backward(upipe.shard_sequence(dout, group=group, layout=layout))
    return [
        upipe.unshard_sequence(t.detach().double(), group=group, layout=layout)
        for t in (out, *(x.grad for x in leaves))
    ]


def run_module_layout(rank, world_size, cfg, kwargs, layout):
    """run_module with the sequence (x, positions, dy) in `layout`; y, dx gathered in order."""
    group = dist.group.WORLD
    x, dy, pos = make_module_inputs(**cfg)
    layer = upipe.ContextParallelAttention(
        *(cfg.get(a) for a in MODULE_ARGS), group=group, layout=layout, **kwargs
    )
    with torch.no_grad():
        for n, t in make_weights(cfg).items():
            getattr(layer, n).weight.copy_(t)
    shard = lambda t: upipe.shard_sequence(t, group=group, layout=layout)  # noqa: E731
    xs = shard(x).requires_grad_()
    y = layer(xs, shard(pos))
    y.backward(shard(dy))
    grads = {n: getattr(layer, n).weight.grad.double() for n in ("q_proj", "o_proj")}
    gather = lambda t: upipe.unshard_sequence(t, group=group, layout=layout)  # noqa: E731
    return {"y": gather(y.detach().double()), "dx": gather(xs.grad.double()), **grads}


def reference_and_one_device(shape, dtype, *, causal=True, backend=None):
    """(float64 truth, the same attention on one device in `dtype`, with `backend`'s kernel)
    for the bf16 bounds."""
    from upipe.kernels import attention_backward, attention_forward

    q, k, v, dout = make_qkv(**shape)
    ref = reference(q, k, v, dout, causal=causal)
    qb, kb, vb, db = (t.to(dtype) for t in (q, k, v, dout))
    kw = dict(causal=causal, backend=backend)
    out, lse = attention_forward(qb, kb, vb, **kw)
    return ref, (out, *attention_backward(db, qb, kb, vb, out, lse, **kw))
