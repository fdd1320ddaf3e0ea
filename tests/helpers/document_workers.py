"""Per-rank functions and float64 references for the document-masking tests.

The reference builds the S x S document mask explicitly (tiny shapes only) and runs plain
autograd in float64: the ground truth every strategy is compared with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from usp_workers import mesh_of
from workers import MODULE_ARGS, make_module_inputs, make_qkv, make_weights

import upipe
from upipe.attention.common import forget_agreements
from upipe.comm import sequence_positions, shard_sequence, unshard_sequence
from upipe.packing import document_positions


def doc_mask(cu, S, causal, window=None):
    """allowed[i, t]: query i may see key t (same document, and t <= i when causal, and
    i - t < window with a sliding window)."""
    doc = torch.zeros(S, dtype=torch.long)
    for e in cu[1:-1]:
        doc[e:] += 1
    allowed = doc[:, None] == doc[None, :]
    if window is not None:
        allowed &= torch.ones(S, S, dtype=torch.bool).triu(1 - window)
    return allowed & torch.ones(S, S, dtype=torch.bool).tril() if causal else allowed


def masked_attention(q, k, v, allowed, scale=None):
    """softmax over the allowed keys of q.k, times v (differentiable; [B, S, H, d])."""
    H, G, d = q.shape[2], k.shape[2], q.shape[3]
    scale = d**-0.5 if scale is None else scale
    s = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(H // G, 2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhst,bthd->bshd", s.softmax(-1), v.repeat_interleave(H // G, 2))


def doc_reference(shape, cu, causal=True, window=None):
    """(out, dq, dk, dv) over the full sequence in float64 with the document mask (and
    sliding window)."""
    q, k, v, dout = (t.double().requires_grad_() for t in make_qkv(**shape))
    out = masked_attention(q, k, v, doc_mask(cu, shape["S"], causal, window))
    out.backward(dout.detach())
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def one_device(shape, cu, dtype, causal=True, backend=None, window=None):
    """The same document-masked attention on one device in `dtype` (the bf16 baseline)."""
    from upipe.attention.documents import local_backward, local_forward
    from upipe.packing import check_cu_seqlens

    q, k, v, dout = (t.to(dtype) for t in make_qkv(**shape))
    bounds = check_cu_seqlens(cu, shape["S"])
    kw = dict(causal=causal, softmax_scale=None, backend=backend, window=window)
    out, lse = local_forward(q, k, v, bounds, **kw)
    return [out, *local_backward(dout, q, k, v, out, lse, bounds, **kw)]


def run_docs(rank, world_size, strategy, shape, kwargs, cu, dtype=torch.float32, emulate=False):
    """Forward+backward of a functional strategy with `cu_seqlens=cu` on a 1-D group; the
    results gathered back to the full sequence (fp64)."""
    if emulate:
        import cuda_emulation
        import varlen_emulation

        cuda_emulation.install()
        varlen_emulation.install()
    group = dist.group.WORLD
    layout = kwargs.setdefault("layout", "zigzag" if strategy == "ring" else "contiguous")
    q, k, v, dout = make_qkv(**shape, dtype=dtype)
    shard = lambda t: shard_sequence(t, group=group, layout=layout)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    fn = getattr(upipe, f"{strategy}_attention")
    out = fn(*leaves, group=group, cu_seqlens=torch.tensor(cu), **kwargs)
    out.backward(shard(dout))
    gather = lambda t: unshard_sequence(t.detach().double(), group=group, layout=layout)  # noqa: E731
    return [gather(t) for t in (out, *(x.grad for x in leaves))]


def run_docs_mesh(rank, world_size, dims, strategy, shape, kwargs, cu, dtype=torch.float32):
    """As `run_docs` on a (dp, ring, ulysses) mesh; returns (positions, [out, dq, dk, dv])."""
    mesh = mesh_of(dims)
    layout = kwargs.get("layout", "zigzag")
    q, k, v, dout = make_qkv(**shape, dtype=dtype)
    leaves = [shard_sequence(t, mesh=mesh, layout=layout).requires_grad_() for t in (q, k, v)]
    fn = getattr(upipe, f"{strategy}_attention")
    out = fn(*leaves, mesh=mesh, cu_seqlens=torch.tensor(cu), **kwargs)
    out.backward(shard_sequence(dout, mesh=mesh, layout=layout))
    pos = sequence_positions(shape["S"], mesh=mesh, layout=layout)
    return pos, [t.detach().double() for t in (out, *(x.grad for x in leaves))]


def module_doc_reference(cfg, cu, window=None, attend=masked_attention):
    """y, dx and weight gradients of the attention layer with the document mask (and
    sliding window) in fp64; RoPE positions restart per document. `attend(q, k, v,
    allowed)`: the attention itself (sink_workers passes one with sinks)."""
    from upipe.rope import apply_rope, rope_cos_sin

    x, dy, _ = make_module_inputs(**cfg, dtype=torch.float64)
    w = {n: t.double().requires_grad_() for n, t in make_weights(cfg).items()}
    x.requires_grad_()
    B, S, _ = x.shape
    d = cfg["dim"] // cfg["num_heads"]
    pos = document_positions(cu, S)[None].expand(B, S)
    cos, sin = rope_cos_sin(pos, d, dtype=torch.float64)
    q, k = (x @ w["q_proj"].t()).view(B, S, -1, d), (x @ w["k_proj"].t()).view(B, S, -1, d)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = (x @ w["v_proj"].t()).view(B, S, -1, d)
    y = attend(q, k, v, doc_mask(cu, S, True, window)).flatten(2) @ w["o_proj"].t()
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, **{n: t.grad for n, t in w.items()}}


def run_module_docs(rank, world_size, cfg, kwargs, cu, dtype=torch.float32):
    """ContextParallelAttention forward+backward with documents; y, dx gathered in order
    and this rank's weight-gradient contributions."""
    group = dist.group.WORLD
    default = "zigzag" if kwargs.get("strategy") == "ring" else "contiguous"
    layout = kwargs.setdefault("layout", default)
    x, dy, _ = make_module_inputs(**cfg, dtype=dtype)
    S = x.shape[1]
    layer = upipe.ContextParallelAttention(
        *(cfg.get(a) for a in MODULE_ARGS), group=group, dtype=dtype, **kwargs
    )
    with torch.no_grad():
        for n, t in make_weights(cfg, dtype=dtype).items():
            getattr(layer, n).weight.copy_(t)
    shard = lambda t: shard_sequence(t, group=group, layout=layout)  # noqa: E731
    mine = sequence_positions(S, rank=rank, world_size=world_size, layout=layout)
    pos = document_positions(cu, S)[mine][None].expand(x.shape[0], -1)
    xs = shard(x).requires_grad_()
    y = layer(xs, pos, cu_seqlens=torch.tensor(cu))
    y.backward(shard(dy))
    gather = lambda t: unshard_sequence(t.double(), group=group, layout=layout)  # noqa: E731
    grads = {n: getattr(layer, n).weight.grad.double() for n in ("q_proj", "k_proj", "o_proj")}
    return {"y": gather(y.detach()), "dx": gather(xs.grad), **grads}


def bad_docs(rank, world_size, strategy, shape, cu_by_rank):
    """A strategy called with per-rank cu_seqlens (first call: the ranks exchange verdicts);
    (exception type, message) or None."""
    group = dist.group.WORLD
    cu = cu_by_rank[rank] if isinstance(cu_by_rank, list) else cu_by_rank
    q, k, v, _ = make_qkv(**shape)
    q, k, v = (shard_sequence(t, group=group) for t in (q, k, v))
    forget_agreements()
    try:
        getattr(upipe, f"{strategy}_attention")(q, k, v, group=group, cu_seqlens=cu)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def count_docs_layer(rank, world_size, cfg, cu):
    """Counts (collectives, host syncs) of a steady-state layer call without documents, with
    `cu` as ints and with `cu` as a tensor (each after a first, agreeing call)."""
    from cuda_workers import counting

    forget_agreements()
    group = dist.group.WORLD
    x, dy, _ = make_module_inputs(**cfg)
    layer = upipe.ContextParallelAttention(*(cfg.get(a) for a in MODULE_ARGS), group=group)
    xs = shard_sequence(x, group=group).requires_grad_()
    dys = shard_sequence(dy, group=group)
    mine = sequence_positions(x.shape[1], rank=rank, world_size=world_size)
    pos = document_positions(cu, x.shape[1])[mine][None]
    out = []
    for docs in (None, tuple(cu), torch.tensor(cu)):
        layer(xs, pos, cu_seqlens=docs).backward(dys)  # agrees on a new signature
        with counting() as counts:
            layer(xs, pos, cu_seqlens=docs).backward(dys)
        out.append(dict(counts))
    return out


def varlen_calls(rank, world_size, strategy, shape, kwargs, cu, dtype):
    """`run_docs` on the emulated CUDA path; returns (results, varlen kernel calls made)."""
    import varlen_emulation

    before = dict(varlen_emulation.CALLS)
    res = run_docs(rank, world_size, strategy, shape, kwargs, cu, dtype, True)
    calls = {k: v - before.get(k, 0) for k, v in varlen_emulation.CALLS.items()}
    calls = {k: v for k, v in calls.items() if v}
    return res, calls


def run_module_docs_emulated(rank, world_size, cfg, kwargs, cu, dtype):
    """`run_module_docs` on the emulated CUDA path (backend="cuda")."""
    import cuda_emulation
    import varlen_emulation

    cuda_emulation.install()
    varlen_emulation.install()
    return run_module_docs(rank, world_size, cfg, {**kwargs, "backend": "cuda"}, cu, dtype)


def run_module_docs_mesh(rank, world_size, dims, cfg, kwargs, cu):
    """ContextParallelAttention(mesh=) with documents; (positions, y, dx, weight grads)."""
    mesh = mesh_of(dims)
    layout = kwargs.get("layout", "zigzag")
    x, dy, _ = make_module_inputs(**cfg)
    S = x.shape[1]
    layer = upipe.ContextParallelAttention(*(cfg.get(a) for a in MODULE_ARGS), mesh=mesh, **kwargs)
    with torch.no_grad():
        for n, t in make_weights(cfg).items():
            getattr(layer, n).weight.copy_(t)
    mine = sequence_positions(S, mesh=mesh, layout=layout)
    pos = document_positions(cu, S)[mine][None].expand(x.shape[0], -1)
    xs = shard_sequence(x, mesh=mesh, layout=layout).requires_grad_()
    y = layer(xs, pos, cu_seqlens=torch.tensor(cu))
    y.backward(shard_sequence(dy, mesh=mesh, layout=layout))
    grads = {n: getattr(layer, n).weight.grad.double() for n in ("q_proj", "k_proj", "o_proj")}
    return {"pos": mine, "y": y.detach().double(), "dx": xs.grad.double(), **grads}
