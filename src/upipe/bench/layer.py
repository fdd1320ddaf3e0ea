"""`upipe bench --layer`: each strategy as the whole attention layer, and its float64 reference.

Legend: B batch, S full sequence, L = S / C local tokens, D = H*d model width, H query
heads, G kv heads, d head dim, C ranks.

A layer method runs `upipe.ContextParallelAttention` (q/k/v projections, RoPE, attention,
o_proj) on x `[B, L, D]` with the output gradient dy `[B, L, D]`; its results are y and dx
(gathered in token order) and the four weight gradients (summed over the ranks: each rank's
are its own tokens' share). Every rank loads the same weights (`layer_weights`, drawn from
the seed), so the reference is one process running the same function in float64:

    q = rope(x Wq^T), k = rope(x Wk^T), v = x Wv^T,  y = attention(q, k, v) Wo^T

with the attention of `upipe.kernels` (float64, blockwise, no S x S matrix) and autograd
for the rest. The peers are attention ops on q/k/v, not layers, so they do not take part.
With `window` (a causal sliding window) the reference runs the window's tiled kernel calls
(`upipe.attention.window`); with `sinks` (gpt-oss attention sinks, one logit per head, drawn
from the seed) it applies them as every strategy does (`upipe.attention.sinks`), and the
results gain the sinks' gradient "dsinks" (summed over the ranks). Those two helpers are
tested against explicit fp64 masks and sink columns in tests/distributed/test_window.py and
tests/distributed/test_sinks.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import upipe
from upipe.attention import sinks as sink_ops
from upipe.attention.window import block_backward, block_forward
from upipe.bench.peers import UpipeMethod
from upipe.rope import apply_rope, rope_cos_sin

RESULTS = ("y", "dx", "dWq", "dWk", "dWv", "dWo")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def result_names(sinks: bool) -> tuple[str, ...]:
    """What a layer method returns: `RESULTS`, and "dsinks" with sinks."""
    return (*RESULTS, "dsinks") if sinks else RESULTS


def layer_weights(seed: int, H: int, G: int, d: int, sinks: bool = False) -> dict:
    """The layer's weights, fp32, the same on every rank: N(0, 1/D) entries, so that
    activations keep unit scale; with `sinks` also "sinks" `[H]`, N(0, 1) logits."""
    gen = torch.Generator().manual_seed(seed + 1)  # not the inputs' stream
    D = H * d
    shapes = {"q_proj": (H * d, D), "k_proj": (G * d, D), "v_proj": (G * d, D), "o_proj": (D, D)}
    w = {name: torch.randn(*shape, generator=gen) / D**0.5 for name, shape in shapes.items()}
    if sinks:
        w["sinks"] = torch.randn(H, generator=gen)
    return w


class _Attention64(torch.autograd.Function):
    """upipe.kernels' attention with its own backward (float64 reference)."""

    @staticmethod
    def forward(ctx, q_BSHd, k_BSGd, v_BSGd, sinks_H, causal, window):
        kw = dict(q0=0, k0=0, causal=causal, window=window, softmax_scale=None, backend=None)
        out_BSHd, lse = block_forward(q_BSHd, k_BSGd, v_BSGd, **kw)
        if sinks_H is not None:
            lse = sink_ops.apply_(out_BSHd, lse, sinks_H)
        ctx.save_for_backward(q_BSHd, k_BSGd, v_BSGd, out_BSHd, lse, sinks_H)
        ctx.kw = kw
        return out_BSHd

    @staticmethod
    def backward(ctx, dout_BSHd):
        q, k, v, out, lse, sinks_H = ctx.saved_tensors
        dsinks = None if sinks_H is None else sink_ops.grad(dout_BSHd, out, lse, sinks_H)
        grads = block_backward(dout_BSHd, q, k, v, out, lse, **ctx.kw)
        return (*grads, dsinks, None, None)


def layer_reference(x_BSD, dy_BSD, weights, *, H: int, G: int, causal: bool, window=None):
    """(y, dx, dWq, dWk, dWv, dWo, and with weights["sinks"] dsinks) of the layer on the
    full sequence, in float64; `window`: a causal sliding window, or None."""
    B, S, D = x_BSD.shape
    d = D // H
    x = x_BSD.detach().to(torch.float64, copy=True).requires_grad_()  # (a leaf of its own)
    W = {name: w.double().requires_grad_() for name, w in weights.items()}
    cos, sin = rope_cos_sin(torch.arange(S).expand(B, S), d, dtype=torch.float64)
    q_BSHd = apply_rope((x @ W["q_proj"].T).view(B, S, H, d), cos, sin)
    k_BSGd = apply_rope((x @ W["k_proj"].T).view(B, S, G, d), cos, sin)
    v_BSGd = (x @ W["v_proj"].T).view(B, S, G, d)
    sinks_H = W.get("sinks")
    out_BSHd = _Attention64.apply(q_BSHd, k_BSGd, v_BSGd, sinks_H, causal, window)
    y_BSD = out_BSHd.flatten(2) @ W["o_proj"].T
    y_BSD.backward(dy_BSD.double())
    sink_grad = () if sinks_H is None else (sinks_H.grad,)
    return (y_BSD.detach(), x.grad, *(W[name].grad for name in _PROJECTIONS), *sink_grad)


class UpipeLayer(UpipeMethod):
    """A 1-D-group strategy of upipe's registry as `ContextParallelAttention`."""

    inputs = "layer"

    def __init__(
        self, kind, U=None, *, shape, seed: int, causal: bool, backend=None, window=None,
        sinks=False,
    ):  # fmt: skip
        super().__init__(kind, U, backend)
        self.name = f"layer:{self.name}" + (f" w={window}" if window else "")
        self.name += " sinks" if sinks else ""
        self.shape, self.seed, self.causal = shape, seed, causal
        self.window, self.sinks = window, sinks
        self.variant = (window, sinks)  # its reference (`upipe.bench.run.step_inputs`)
        self.result_names = result_names(sinks)

    def problem(self, *, H, G, C, S, device):
        if self.spec.needs_ring_and_ulysses:
            return f"{self.kind} takes a mesh; --layer runs the layer on a 1-D group"
        return super().problem(H=H, G=G, C=C, S=S, device=device)

    def setup(self, group, device):
        super().setup(group, device)
        H, G, d = self.shape
        self.layer = upipe.ContextParallelAttention(
            H * d,
            H,
            G,
            d,
            group=group,
            strategy=self.kind,
            heads_per_stage=self.U,
            causal=self.causal,
            backend=self.backend,
            window=self.window,
            sinks=self.sinks,
            device=device,
        )
        with torch.no_grad():
            for name, w in layer_weights(self.seed, H, G, d, self.sinks).items():
                p = getattr(self.layer, name)
                (p if name == "sinks" else p.weight).copy_(w)
        self.dtype = None

    def leaves(self, local):
        x_BLD, dy_BLD = local
        if self.dtype != x_BLD.dtype:
            self.layer.to(x_BLD.dtype)
            self.dtype = x_BLD.dtype
        self.layer.zero_grad(set_to_none=True)
        S = x_BLD.shape[1] * dist.get_world_size(self.group)
        self.positions_BL = self.shard(torch.arange(S, device=x_BLD.device).expand(1, S))
        return [x_BLD.clone().requires_grad_()], dy_BLD

    def __call__(self, x_BLD, *, causal):  # causal: fixed when the layer was built
        n = x_BLD.shape[1]  # the warm-up cuts every local tensor to its first n tokens
        return self.layer(x_BLD, self.positions_BL[:, :n].expand(x_BLD.shape[0], n))

    def results(self, out, leaves):
        grads = []
        for name in _PROJECTIONS:
            g = getattr(self.layer, name).weight.grad.clone()
            dist.all_reduce(g, group=self.group)
            grads.append(g)
        if self.sinks:  # each rank's share (its heads, or its rows on a ring), summed
            g = self.layer.sinks.grad.clone()
            dist.all_reduce(g, group=self.group)
            grads.append(g)
        return [self.unshard(out.detach()), self.unshard(leaves[0].grad), *grads]
