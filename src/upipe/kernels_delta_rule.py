"""The chunked gated delta rule with a backward of its own: the scan backend "upipe" of the
Gated DeltaNet layer (`upipe.kernels_deltanet`), for the CPU and for CUDA without fla.

Legend: B batch, S sequence, h value heads, g key heads (value head i reads key head
i // (h / g)), d key head dim, e value head dim, T = 64 tokens a chunk, n chunks.

It computes what transformers' `torch_chunk_gated_delta_rule` computes (the same operations
in the same order, in fp32, or fp64 for fp64 inputs), split in two:

- the chunk-local part, independent per chunk (all chunks at once, in autograd), with
  q, k l2-normalised and q scaled by d^-1/2, beta in (0, 1), g <= 0 (log decays):

      c = cumsum(g) in the chunk         R_ij = exp(c_i - c_j) for i >= j, else 0
      M = I + strict lower part of (beta K K^T * R)      (unit lower triangular)
      u = M^-1 (beta V)    w = M^-1 (beta e^c K)    P = (Q K^T) * R
      Q' = e^c Q    K' = e^(c_T - c) K    lam = e^(c_T)

- the recurrence across chunks (a Python loop; state X `[d, e]` per head, X_0 = 0):

      v' = u - w X     o = Q' X + P v'     X_next = lam X + K'^T v'

  and its gradient by hand, walking the chunks backwards with the carried dX:

      dv' = P^T do + K' dX_next      dP = do v'^T      dQ' = do X^T      dK' = v' dX_next^T
      dlam = <X, dX_next>    du = dv'    dw = -dv' X^T    dX = Q'^T do + lam dX_next - w^T dv'

Blocks: a sequence longer than `block` tokens (`BLOCK`, 16,384) runs one block at a time,
the state carried across: forward computes a block's local part, its loop and its output,
then frees them; backward first runs the loop block by block for every chunk's state
(without a graph; a `for_backward` forward kept them), then walks the blocks backwards,
each recomputing its local part with a graph, running the loop's gradient with the carried
dX and writing its slice of the input gradients. The local part -- most of the bytes -- then
exists for one block, not the sequence (tests/unit/test_delta_rule.py measures the peak at
S = 2,048 and blocks of 256 tokens at a quarter of one block's); the states, the input
gradients and one block's buffers remain, for one more computation of the local part in
backward.

Why not autograd through transformers' function: its loop writes each chunk's output into a
slice of one tensor, and autograd copies that whole tensor's gradient once per chunk in
backward (torch's CopySlices node, torch/csrc/autograd/functions/tensor.h: "grad[idx] =
fn(grad[idx]), but out-of-place"; O(n S) bytes); its backward also needs its forward's
graph, so a layer that recomputes its forward for backward (UPipe's stages) runs the scan's
forward twice. Here the forward saves only its inputs, as fla's kernel does
(`fla/ops/gated_delta_rule/chunk.py`); the backward recomputes the chunk-local part with a
graph and the chunk states X_c (`[n, d, e]` per head), runs the loop above, and
differentiates the local part against its result (`torch.autograd.grad`). A forward called
with `for_backward=True` -- a recomputation right before its backward -- builds that graph
and keeps the states at once, so its backward recomputes nothing. On CUDA (without fla) the
loops launch four (forward) and five (backward) small kernels a chunk and no host
synchronisation: launch-bound at long sequences, where fla's kernel is the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from upipe import loops
from upipe.kernels import acc_dtype

T = 64
"""tokens per chunk (transformers' and fla's)"""


def _l2norm(x, eps=1e-6):
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' `l2norm`, fla's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _local(q_BSgd, k_BSgd, v_BShe, g_BSh, beta_BSh):
    """The chunk-local part (module doc) of padded, chunked fp32 copies: u, w, P, Q', K'
    `[B, h, n, T, .]` and lam `[B, h, n]`."""
    h, g = v_BShe.shape[2], q_BSgd.shape[2]
    dtype = acc_dtype(v_BShe.dtype)
    if h != g:
        q_BSgd, k_BSgd = (t.repeat_interleave(h // g, dim=2) for t in (q_BSgd, k_BSgd))
    q, k, v, beta, decay = (
        t.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
        for t in (q_BSgd, k_BSgd, v_BShe, beta_BSh, g_BSh)
    )
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    S = q.shape[2]
    pad = -S % T
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, decay = (F.pad(t, (0, pad)) for t in (beta, decay))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.unflatten(2, (-1, T)) for t in (q, k, k_beta, v_beta))
    c = decay.unflatten(2, (-1, T)).cumsum(dim=-1)
    upper = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    R = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * R
    P = (q @ k.transpose(-1, -2)) * R
    decayed_k_beta = k_beta * c.exp().unsqueeze(-1)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    q_dec = q * c.exp().unsqueeze(-1)
    k_dec = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    lam = c[..., -1].exp()
    return u, w, P, q_dec, k_dec, lam


def _recurrence(local, X=None, states=None):
    """The loop across chunks (module doc), no graph, from the state X `[b, d, e]` (b = B h;
    None: zeros; updated in place): (X_c, v'_c) of every chunk, `[n, b, d, e]` (written
    into `states` where given) and `[n, b, T, e]` (chunk-major: each iteration writes
    contiguous blocks), and the final state.
    Four in-place operations a chunk; everything else is batched over the chunks."""
    u, w, _, _, k_dec, lam = (t.flatten(0, 1) for t in local)  # [b, n, ...]
    b, n, _, e = u.shape
    k_dec_t, lam = k_dec.transpose(-1, -2), lam[..., None, None]
    states = u.new_empty(n, b, w.shape[-1], e) if states is None else states
    v_new = u.new_empty(n, b, *u.shape[2:])
    X = u.new_zeros(b, w.shape[-1], e) if X is None else X
    for c in loops.chunk_steps(n):
        states[c].copy_(X)
        torch.baddbmm(u[:, c], w[:, c], X, alpha=-1, out=v_new[c])  # v' = u - w X
        X.mul_(lam[:, c]).baddbmm_(k_dec_t[:, c], v_new[c])  # X = lam X + K'^T v'
    return states, v_new, X


def _corrected_values(local, states):
    """v' = u - w X of every chunk from the chunks' states (batched), chunk-major."""
    u, w = (t.flatten(0, 1) for t in local[:2])  # [b, n, T, .]
    return (u - w @ states.transpose(0, 1)).transpose(0, 1)


def _output(local, states, v_new):
    """o = Q' X + P v' of every chunk, `[B, h, n, T, e]` (batched)."""
    _, _, P, q_dec, _, _ = local
    o = q_dec @ _chunk_last(states, P.shape)
    o += P @ _chunk_last(v_new, P.shape)
    return o


def _chunk_last(t_nb, shape):
    """A chunk-major `[n, b, ...]` seen as `[B, h, n, ...]` (b = B h) for `shape[:2]`."""
    return t_nb.transpose(0, 1).unflatten(0, shape[:2])


def _recurrence_backward(local, states, v_new, do, dX=None):
    """(the gradient of the loop's inputs (u, w, P, Q', K', lam), that of its initial state)
    for the output gradient `do` `[B, h, n, T, e]` and the final state's dX `[b, d, e]`
    (None: zeros; updated in place) (module doc): the carried dX in a loop of five in-place
    operations a chunk, the rest batched over the chunks."""
    u, w, P, q_dec, k_dec, lam = local
    shape = u.shape
    X, v_new = _chunk_last(states, shape), _chunk_last(v_new, shape)
    P_t_do = (P.transpose(-1, -2) @ do).flatten(0, 1)  # [b, n, T, e]
    q_t_do = (q_dec.transpose(-1, -2) @ do).flatten(0, 1)  # [b, n, d, e]
    k_dec, w_t = k_dec.flatten(0, 1), w.flatten(0, 1).transpose(-1, -2)
    lam_b = lam.flatten(0, 1)[..., None, None]
    n, b = states.shape[:2]
    dv_new = u.new_empty(n, b, *shape[3:])
    dX_next = torch.empty_like(states)
    dX = u.new_zeros(states.shape[1:]) if dX is None else dX
    for c in reversed(loops.chunk_steps(n)):
        dX_next[c].copy_(dX)
        torch.baddbmm(P_t_do[:, c], k_dec[:, c], dX, out=dv_new[c])  # P^T do + K' dX
        dX.mul_(lam_b[:, c]).add_(q_t_do[:, c]).baddbmm_(w_t[:, c], dv_new[c], alpha=-1)
    del P_t_do, q_t_do
    dv_new, dX_next = _chunk_last(dv_new, shape), _chunk_last(dX_next, shape)
    dP = do @ v_new.transpose(-1, -2)
    dq_dec = do @ X.transpose(-1, -2)
    dk_dec = v_new @ dX_next.transpose(-1, -2)
    dlam = (X * dX_next).sum(dim=(-2, -1))
    dw = -(dv_new @ X.transpose(-1, -2))
    return (dv_new, dw, dP, dq_dec, dk_dec, dlam), dX


def _unchunk(o_BhnTe, S, dtype):
    """[B, h, n, T, e] -> [B, S, h, e] in `dtype` (padding dropped)."""
    o_BhSe = o_BhnTe.flatten(2, 3)[:, :, :S]
    return o_BhSe.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def _chunked(do_BShe, n, dtype):
    """The inverse of `_unchunk` for a gradient: [B, S, h, e] -> [B, h, n, T, e] in `dtype`."""
    do_BhSe = do_BShe.transpose(1, 2).to(dtype)
    return F.pad(do_BhSe, (0, 0, 0, n * T - do_BhSe.shape[2])).unflatten(2, (n, T))


def _local_graph(inputs, needs_grad):
    """(leaves detached from `inputs`, the local part computed from them with a graph)."""
    needs = needs_grad[: len(inputs)]  # (not the flag)
    leaves = [t.detach().requires_grad_(n) for t, n in zip(inputs, needs, strict=True)]
    with torch.enable_grad():
        return leaves, _local(*leaves)


def _grads(leaves, local, dlocal):
    """The leaves' gradients (None where not needed) from the local part's."""
    wanted = [t for t in leaves if t.requires_grad]
    roots = [(t, dt) for t, dt in zip(local, dlocal, strict=True) if t.requires_grad]
    outputs, grad_outputs = zip(*roots, strict=True)
    grads = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True))
    return [next(grads) if t.requires_grad else None for t in leaves]


def _blocks(S, block):
    """(first token, tokens, first chunk, chunks) of each block of `block` tokens."""
    return [(a, min(block, S - a), a // T, -(-min(block, S - a) // T))
            for a in loops.tile_starts(S, block)]  # fmt: skip


def _cut(inputs, a, length):
    """Tokens a .. a + length - 1 of each `[B, S, ...]` input."""
    return [t.narrow(1, a, length) for t in inputs]


class _DeltaRule(torch.autograd.Function):
    """Forward and backward in blocks of `block` tokens (`delta_rule`): the chunk-local part
    of one block exists at a time, the states carried across; with one block, a
    `for_backward` forward keeps the local graph too."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, for_backward, block):
        inputs = (q, k, v, g, beta)
        S = v.shape[1]
        blocks = _blocks(S, block)
        ctx.for_backward, ctx.block, ctx.local, ctx.states = for_backward, block, None, None
        if for_backward and len(blocks) == 1:
            leaves, local = _local_graph(inputs, ctx.needs_input_grad)
            detached = [t.detach() for t in local]
            ctx.leaves, ctx.local, ctx.loop = leaves, local, _recurrence(detached)[:2]
            return _unchunk(_output(detached, *ctx.loop), S, v.dtype)
        ctx.save_for_backward(*inputs)
        if len(blocks) == 1 and not for_backward:
            local = _local(*inputs)
            return _unchunk(_output(local, *_recurrence(local)[:2]), S, v.dtype)
        o = v.new_empty(v.shape)
        states = _all_states(inputs) if for_backward else None  # (else a block's at a time)
        X = None
        for a, length, c0, n in blocks:
            local = _local(*_cut(inputs, a, length))
            block_states = None if states is None else states[c0 : c0 + n]
            block_states, v_new, X = _recurrence(local, X, block_states)
            o.narrow(1, a, length).copy_(
                _unchunk(_output(local, block_states, v_new), length, v.dtype)
            )
            del local, block_states, v_new
        ctx.states = states
        return o

    @staticmethod
    def backward(ctx, do):
        blocks = _blocks(do.shape[1], ctx.block)
        if ctx.local is not None:  # one block, kept by a for_backward forward
            leaves, local, loop = ctx.leaves, ctx.local, ctx.loop
            ctx.leaves = ctx.local = ctx.loop = None  # (freed once the gradients are computed)
        elif ctx.for_backward and ctx.states is None:
            raise RuntimeError(
                "delta_rule(for_backward=True) runs its backward once (its graph is freed)"
            )
        elif len(blocks) == 1:  # the local graph gives the states as well
            leaves, local = _local_graph(ctx.saved_tensors, ctx.needs_input_grad)
            loop = _recurrence([t.detach() for t in local])[:2]
        if len(blocks) == 1:
            dlocal, _ = _recurrence_backward(
                [t.detach() for t in local], *loop, _chunk_do(do, local)
            )
            del loop
            return (*_grads(leaves, local, dlocal), None, None)
        inputs = ctx.saved_tensors
        states, ctx.states = ctx.states, None
        if states is None:  # the chunk states, block by block (no graph)
            states, X = _all_states(inputs), None
            for a, length, c0, n in blocks:
                local = _local(*_cut(inputs, a, length))
                X = _recurrence(local, X, states[c0 : c0 + n])[2]
                del local
            del X
        needs = ctx.needs_input_grad[:5]
        grads = [
            torch.zeros_like(t) if need else None for t, need in zip(inputs, needs, strict=True)
        ]
        dX = None
        for a, length, c0, n in reversed(blocks):
            leaves, local = _local_graph(_cut(inputs, a, length), needs)
            detached = [t.detach() for t in local]
            block_states = states[c0 : c0 + n]
            v_new = _corrected_values(detached, block_states)
            do_block = _chunk_do(do.narrow(1, a, length), local)
            dlocal, dX = _recurrence_backward(detached, block_states, v_new, do_block, dX)
            del v_new, do_block, detached
            for grad, part in zip(grads, _grads(leaves, local, dlocal), strict=True):
                if grad is not None:
                    grad.narrow(1, a, length).copy_(part)
            del leaves, local, dlocal
        return (*grads, None, None)


def _all_states(inputs):
    """An empty buffer for the state entering every chunk, `[n, B h, d, e]` (allocated
    whole, so that its bytes do not depend on how many blocks run: `upipe.planner.sampled`
    runs two)."""
    q, v = inputs[0], inputs[2]
    B, S, h, e = v.shape
    shape = (-(-S // T), B * h, q.shape[-1], e)
    return v.new_empty(shape, dtype=acc_dtype(v.dtype))


def _chunk_do(do, local):
    """The output gradient chunked as the local part (`_chunked`)."""
    return _chunked(do, local[0].shape[2], local[0].dtype)


BLOCK = 16384
"""tokens a block (`delta_rule`): beyond it the chunk-local part is computed a block at a time"""


def delta_rule(q_BSgd, k_BSgd, v_BShe, g_BSh, beta_BSh, *, for_backward=False, block=BLOCK):
    """The chunked gated delta rule (module doc) from a zero state, q and k l2-normalised
    in the kernel: o `[B, S, h, e]` in v's dtype, differentiable w.r.t. every input.
    Arguments as transformers' `torch_chunk_gated_delta_rule` takes them (g fp32).
    `for_backward`: this call recomputes a forward whose backward follows at once (keep
    the chunk states -- and, for a sequence of one block, the local graph -- so that the
    backward does not recompute them). `block` (a multiple of 64): the tokens whose
    chunk-local part exists at once; a longer sequence runs in blocks, its backward
    recomputing the local part once more (for the states) unless `for_backward` kept them."""
    if block <= 0 or block % T:
        raise ValueError(f"block must be a positive multiple of {T} tokens, got {block}")
    return _DeltaRule.apply(q_BSgd, k_BSgd, v_BShe, g_BSh, beta_BSh, for_backward, block)
