"""Next-token loss over a sequence-sharded batch: label shifting, chunked cross-entropy and the
mean over the *global* count of valid tokens.

Legend: B batch, S full sequence, L local sequence, D model width, V vocabulary, N tokens.

Labels are shifted on the full sequence *before* it is sharded (`shift_labels`), so the last
token of one rank's shard is labelled with the first token of the next rank's shard, and the
loss needs no communication apart from the final sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from upipe import loops
from upipe.kernels import acc_dtype

IGNORE_INDEX = -100


def shift_labels(input_ids_BS: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """labels[:, i] = input_ids[:, i + 1]; the last position gets `ignore_index`."""
    labels_BS = torch.full_like(input_ids_BS, ignore_index)
    labels_BS[:, :-1] = input_ids_BS[:, 1:]
    return labels_BS


def cross_entropy_sum(
    hidden_BLD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_BL: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    bias_V: torch.Tensor | None = None,
    norm: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Sum over valid tokens of -log softmax(norm(hidden) @ weight.T + bias)[label], in fp32.

    `norm`: a row-wise module applied to the hidden states first (the final RMSNorm), or None.

    With `chunk_tokens` neither the `[N, V]` logits nor the normalised `[N, D]` hidden
    states exist: `chunk_tokens` rows at a time, the forward normalises the chunk, computes
    its loss *and* its gradients (`_FusedChunkedCrossEntropy`), so the logits are computed
    once, not again in backward, and the norm runs once. Memory beyond the inputs: two
    `[chunk_tokens, V]` fp32 blocks while a chunk runs, the gradient of the hidden states
    (`[N, D]`, fp32 for half inputs) and the fp32 weight gradient that becomes `.grad`.
    Without grad (evaluation) only the loss is computed, chunk by chunk.
    """
    h_ND, labels_N = hidden_BLD.reshape(-1, hidden_BLD.shape[-1]), labels_BL.reshape(-1)
    if chunk_tokens is None:
        h_ND = h_ND if norm is None else norm(h_ND)
        logits_NV = F.linear(h_ND, weight_VD, bias_V).float()
        return F.cross_entropy(logits_NV, labels_N, ignore_index=ignore_index, reduction="sum")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    params = () if norm is None else tuple(norm.parameters())
    inputs = [t for t in (h_ND, weight_VD, bias_V, *params) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        # the hidden states go in with their own shape, so that their gradient comes back
        # as a tensor of its own, not a view (which the checkpoint before would have to copy)
        return _FusedChunkedCrossEntropy.apply(
            hidden_BLD, weight_VD, bias_V, labels_N, chunk_tokens, ignore_index, norm, *params
        )
    total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
    for s in loops.tile_starts(h_ND.shape[0], chunk_tokens):
        h_nD = h_ND[s : s + chunk_tokens]
        logp_nV = _log_probs(h_nD if norm is None else norm(h_nD), weight_VD, bias_V)
        total += F.nll_loss(
            logp_nV, labels_N[s : s + chunk_tokens], ignore_index=ignore_index, reduction="sum"
        )
        del logp_nV
    return total


def _log_probs(h_nD, weight_VD, bias_V):
    """log softmax of one chunk's logits, in fp32 (the logits freed at once)."""
    return torch.log_softmax(F.linear(h_nD, weight_VD, bias_V).float(), dim=-1)


class _FusedChunkedCrossEntropy(torch.autograd.Function):
    """loss = sum_n [lse(z_n) - z_n[y_n]] over valid n, z_n = W norm(h_n) + b, with the
    gradients computed in the same pass, chunk by chunk:

        d loss / d z_n = softmax(z_n) - onehot(y_n)      (0 for ignored n)
        dW = sum_n (d loss / d z_n)^T norm(h_n),  db = sum_n d loss / d z_n,
        d loss / d norm(h_n) = (d loss / d z_n) W,  then back through the chunk's norm:
        dh_n and the norm's parameter gradients (`torch.autograd.grad`, not into .grad)

    The loss is a graph's last node, so the gradient that reaches it in backward is one
    scalar g (1, or the Trainer's loss scale): backward only multiplies the saved gradients
    by g (dh is rounded to h's dtype then, the parameters' to theirs). The logits are
    computed once per step (a chunk's forward GEMM), not once more in backward: 3 GEMMs of
    N x V x D instead of 4. Per chunk the loss is `nll_loss(log_softmax(z))`, which is what
    `F.cross_entropy` computes (so each chunk's loss is that of the unchunked loss's rows;
    only the sum over chunks is in another order), and softmax(z) is exp of those
    log-probabilities, as `F.cross_entropy`'s own backward computes it. Parameter gradients
    are summed in fp32 and rounded once, in backward."""

    @staticmethod
    def forward(ctx, hidden_BLD, weight_VD, bias_V, labels_N, chunk, ignore_index, norm, *params):
        needs = ctx.needs_input_grad
        h_ND = hidden_BLD.reshape(-1, hidden_BLD.shape[-1])
        params_wanted = [p for p, want in zip(params, needs[7:], strict=True) if want]
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        # dh is kept in fp32 for half-precision h, so that scaling it by g in backward
        # rounds it once (one [N, D] half tensor more, at the loss only)
        dh_BLD = None
        if needs[0]:
            dh_BLD = h_ND.new_empty(hidden_BLD.shape, dtype=acc_dtype(h_ND.dtype))
        dh_ND = None if dh_BLD is None else dh_BLD.view(h_ND.shape)
        grads32 = [  # W, b, the norm's parameters: fp32 sums
            None if t is None or not want else torch.zeros_like(t, dtype=torch.float32)
            for t, want in zip(
                (weight_VD, bias_V, *params), (needs[1], needs[2], *needs[7:]), strict=True
            )
        ]
        for s in loops.tile_starts(h_ND.shape[0], chunk):
            x_nD, y_n = h_ND[s : s + chunk], labels_N[s : s + chunk]
            h_nD = x_nD
            if norm is not None:  # a small graph: the chunk's norm, back-propagated below
                with torch.enable_grad():
                    x_nD = x_nD.detach().requires_grad_(needs[0])
                    h_nD = norm(x_nD)
            dz_nV = _log_probs(h_nD.detach(), weight_VD, bias_V)
            total += F.nll_loss(dz_nV, y_n, ignore_index=ignore_index, reduction="sum")
            dz_nV.exp_()  # softmax
            valid_n1 = (y_n != ignore_index).unsqueeze(1)
            # - onehot(y) on valid rows, without a data-dependent index (no device sync)
            dz_nV.scatter_add_(1, y_n.clamp_min(0).unsqueeze(1), -valid_n1.to(dz_nV.dtype))
            dz_nV *= valid_n1
            if grads32[0] is not None:
                grads32[0].addmm_(dz_nV.T, h_nD.detach().float())
            if grads32[1] is not None:
                grads32[1] += dz_nV.sum(0)
            if dh_ND is not None or params_wanted:
                # in the weights' dtype (bf16 inputs, fp32 accumulation): no fp32 copy of W
                dh_nD = dz_nV.to(weight_VD.dtype) @ weight_VD
                del dz_nV
                if norm is not None:
                    wrt = ([x_nD] if dh_ND is not None else []) + params_wanted
                    got = list(torch.autograd.grad(h_nD, wrt, dh_nD.to(h_nD.dtype)))
                    dh_nD = got.pop(0) if dh_ND is not None else None
                    for acc, g in zip([a for a in grads32[2:] if a is not None], got, strict=True):
                        acc += g
                if dh_ND is not None:
                    dh_ND[s : s + chunk] = dh_nD
            del h_nD, x_nD
        ctx.grads = (dh_BLD, *grads32)
        ctx.dtypes = (
            h_ND.dtype,
            *(None if t is None else t.dtype for t in (weight_VD, bias_V, *params)),
        )
        return total

    @staticmethod
    def backward(ctx, grad):
        grads, dtypes = ctx.grads, ctx.dtypes
        del ctx.grads
        out = [
            None if t is None else t.mul_(grad).to(dtype)
            for t, dtype in zip(grads, dtypes, strict=True)
        ]
        return out[0], out[1], out[2], None, None, None, None, *out[3:]


def count_valid(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of positions whose label is not `ignore_index`, as an fp32 scalar."""
    return (labels != ignore_index).sum().float()


def _checked(count: torch.Tensor) -> torch.Tensor:
    if count.item() == 0:
        raise ValueError("no valid tokens in the batch on any rank (every label is ignored)")
    return count


def global_count(num_valid: torch.Tensor, group=None) -> torch.Tensor:
    """`num_valid` summed over the ranks of `group` (fp32 scalar, the same on every rank);
    ValueError if it is 0 (every label ignored)."""
    count = num_valid.detach().float().clone()
    if group is not None or dist.is_initialized():
        dist.all_reduce(count, group=group)
    return _checked(count)


def global_token_mean(
    loss_sum: torch.Tensor, num_valid: torch.Tensor, group=None, *, total_count=None
) -> torch.Tensor:
    """The loss averaged over every valid token of all ranks in `group`.

    Returns the same value on every rank, computed as transformers computes its causal-LM
    loss (`fixed_cross_entropy`: the sum, then one division): total / count with total =
    sum_r loss_sum_r and count = sum_r num_valid_r, so one process gives exactly
    `F.cross_entropy(..., reduction="mean")`. Its gradient on rank r is rank r's share,
    d loss_sum_r / count, so summing parameter gradients over the ranks (what context
    parallelism and FSDP with a sum reduction do) gives exactly the gradient of the global
    mean. Padding (ignored labels) is handled by the counts; a rank holding only padding
    contributes 0 to both sums.

    `total_count`: divide by this global count instead (`global_count` of the valid tokens
    of all the micro-batches of an optimizer step): each micro-batch then returns its share
    of the step's mean, and the shares and their gradients add up to the mean over every
    token of every micro-batch -- gradient accumulation equals one big batch.
    """
    reduce = group is not None or dist.is_initialized()
    if total_count is None:  # one all-reduce for both sums
        sums = torch.stack([loss_sum.detach().float(), num_valid.detach().float()])
        if reduce:
            dist.all_reduce(sums, group=group)
        total, total_count = sums.unbind()
        _checked(total_count)
    else:
        total = loss_sum.detach().float().clone()
        if reduce:
            dist.all_reduce(total, group=group)
    return _ShareOfMean.apply(loss_sum.float(), total, total_count)


class _ShareOfMean(torch.autograd.Function):
    """value: total / count, bit for bit (no `loss_sum + (total - loss_sum)`, which is one
    rounding away from `total` and may differ between ranks); gradient: d loss_sum / count."""

    @staticmethod
    def forward(ctx, loss_sum, total, count):
        ctx.save_for_backward(count)
        return total / count

    @staticmethod
    def backward(ctx, grad):
        (count,) = ctx.saved_tensors
        return grad / count, None, None
