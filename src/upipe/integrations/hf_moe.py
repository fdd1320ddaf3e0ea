"""The router aux loss of Hugging Face mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss)
over a sequence split across ranks.

Legend: E experts, k experts per token, N_l tokens of this rank in MoE layer l, C ranks.

transformers' `load_balancing_loss_func` (output_router_logits=True; with labels the model
adds router_aux_loss_coef times it to the loss) is, over the router logits of every MoE layer
and token it sees,

    aux = E * sum_e f_e P_e,   f_e = n_e / N,   P_e = (sum over rows of softmax(logits))_e / N

with n_e the top-k assignments to expert e and N the rows of all layers. On one rank of a
split sequence that is its shard's balance, not the sequence's: the product of the two means
is not the mean of the products. Here the counts n_e, the probability sums and N are summed
over the sequence's ranks (one all-reduce of 2E + 1 numbers per model call), so every rank
holds the whole sequence's aux; its gradient is this rank's share,
E * sum_e f_e (dP_e of this rank's rows), which summed over the ranks is the whole gradient
(as for the token-mean loss, `upipe.integrations.hf.causal_lm_loss`).

The routers' logits are recorded by forward hooks on the routers during the model call, and
the model's own aux (over the shard) is turned off (`output_router_logits=False` inside). With
`tiled_mlp` / `activation_checkpoint` (or transformers' gradient checkpointing) the MoE blocks
run without an autograd graph in forward and are recomputed in backward, after the aux loss
exists: its gradient would be lost, so `output_router_logits=True` is refused there with a
ValueError (`problem`).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist


def is_router(module) -> bool:
    """A top-k router of a transformers MoE block (MixtralTopKRouter, Qwen3MoeTopKRouter,
    GptOssTopKRouter: output[0] is the router logits, biased for gpt-oss)."""
    return type(module).__name__.endswith("TopKRouter")


class RouterLoss:
    """What `install` put on a model: its routers' hooks and the aux loss (module doc)."""

    def __init__(self, model, group):
        cfg = model.config
        self.experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        self.top_k, self.coef = cfg.num_experts_per_tok, cfg.router_aux_loss_coef
        self.default, self.group = bool(cfg.output_router_logits), group
        self.recording: list | None = None  # the call's router logits, while one runs

    def hook(self, module, args, output):
        if self.recording is not None:
            self.recording.append(output[0])  # router_logits [N_l, E]

    def wanted(self, output_router_logits) -> bool:
        return self.default if output_router_logits is None else bool(output_router_logits)

    def aux_loss(self, logits) -> torch.Tensor:
        """The whole sequence's aux (module doc) from this rank's router logits, as transformers
        computes it per layer: softmax in the logits' dtype, top-k, sums in fp32."""
        E = self.experts
        counts = torch.zeros(E, dtype=torch.float32, device=logits[0].device)
        probs = torch.zeros_like(counts)
        rows = 0
        for layer_logits in logits:
            weights = torch.softmax(layer_logits, dim=-1)
            _, chosen = torch.topk(weights, self.top_k, dim=-1)
            counts = counts + torch.bincount(chosen.flatten(), minlength=E).float()
            probs = probs + weights.float().sum(dim=0)
            rows += weights.shape[0]
        total = torch.cat([counts, probs.detach(), counts.new_tensor([rows])])
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        counts_g, probs_g, rows_g = total[:E], total[E : 2 * E], total[2 * E]
        share = E * torch.sum(counts_g / rows_g * (probs / rows_g))
        whole = E * torch.sum(counts_g / rows_g * (probs_g / rows_g))
        return share - share.detach() + whole


def problem(model, router_logits: bool) -> str | None:
    """Why a call with `output_router_logits=router_logits` cannot give the aux loss's
    gradient (module doc), or None."""
    if not router_logits:
        return None
    memory = getattr(model, "upipe_memory", None)
    base = model.model
    hf_checkpointing = base.training and any(
        getattr(layer, "gradient_checkpointing", False) for layer in base.layers
    )
    if (memory is not None and memory.options.layers_replaced) or hf_checkpointing:
        return (
            "output_router_logits=True (the router aux loss) with tiled_mlp / "
            "activation_checkpoint / gradient checkpointing is not supported: the MoE blocks "
            "run without a graph in forward and are recomputed in backward, after the aux loss "
            "is computed, so its gradient would be lost; turn those off, or train without the "
            "aux loss (output_router_logits=False, the config's default)"
        )
    return None


def install(model, group) -> RouterLoss | None:
    """Hooks on the routers of `model` and its forward on the instance (module doc); None for
    a model without routers."""
    routers = [m for m in model.modules() if is_router(m)]
    if not routers:
        return None
    loss = RouterLoss(model, group)
    for router in routers:
        router.register_forward_hook(loss.hook)
    inner = model.forward

    @functools.wraps(type(model).forward)  # its signature: the Trainer reads it
    def forward(self, *args, output_router_logits=None, **kwargs):
        if not loss.wanted(output_router_logits):
            return inner(*args, output_router_logits=False, **kwargs)
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        loss.recording = []
        try:
            out = inner(*args, output_router_logits=False, **kwargs)
            logits = tuple(loss.recording)
        finally:
            loss.recording = None
        aux = loss.aux_loss(logits)
        total = None if out.loss is None else out.loss + loss.coef * aux.to(out.loss.device)
        return MoeCausalLMOutputWithPast(
            loss=total, aux_loss=aux, logits=out.logits, router_logits=logits
        )

    model.forward = types.MethodType(forward, model)
    return loss
