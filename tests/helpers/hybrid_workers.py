"""Per-rank functions for tests/distributed/test_hybrid.py: hybrid decoders (Gated DeltaNet
layers and gated full attention: Qwen3-Next, Qwen3.5, Qwen3.5-MoE), tiny and random,
converted."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hf_workers import each_document_alone

from upipe.attention.common import forget_agreements

# 2 layers: a Gated DeltaNet (4 value heads over 2 key heads of 8; 4 conv taps) and a gated
# full-attention layer (4 query / 2 kv heads of 16, a quarter of each rotating), width 64
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    intermediate_size=64,
    vocab_size=128,
    max_position_embeddings=512,
    initializer_range=0.2,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25),
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32, router_aux_loss_coef=0.5)  # fmt: skip
ARCHITECTURES = {
    # MoE in both layers (with the shared expert and its sigmoid gate)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", MOE),
    # separate in_proj_qkv / z / b / a; 6 value heads over 3 key heads: uneven on 4 ranks
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(linear_num_key_heads=3, linear_num_value_heads=6),
    ),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
}
SEQ = 128  # two chunks of the chunked scan
BATCH = 2
# documents of a packed row: one token, shorter than a shard, spanning shards and a chunk
PACKED_BOUNDS = (0, 1, 6, 75, SEQ)


def build_model(arch, seed=0, **overrides):
    """A tiny hybrid causal LM with random weights; norm weights and dt_bias moved away from
    their init so that they matter; fp32, eval mode. A = exp(A_log) is drawn from (0.01,
    0.2) instead of the init's (0.01, 16): the decay per token exp(-A softplus(a + dt_bias))
    then stays near 1, so the recurrent state carries across chunks and shards (a decay of
    exp(-30) per token would hide a state lost at a shard's start), and the gradient of A_log
    -- a sum over every token of terms of both signs -- is not dominated by rounding."""
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.2, generator=gen).log())
            elif any(k in name for k in ("bias", "norm")):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randint(0, BASE["vocab_size"], (BATCH, SEQ), generator=gen)


def reference(arch, packed=False, router=False):
    """The unmodified model on one process: loss (with router=True transformers' loss with
    coef * its aux loss), parameter gradients, state dict. `packed`: each document of
    PACKED_BOUNDS alone, the loss over every document's next tokens."""
    model = build_model(arch)
    ids = make_batch()
    if not packed:
        out = model(input_ids=ids, labels=ids, **({"output_router_logits": True} if router else {}))
        loss = out.loss
    else:
        loss = each_document_alone(model, ids, PACKED_BOUNDS)[1]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, model.state_dict()


def run_cases(rank, world_size, arch, state, cases):
    """Each case (strategy, heads_per_stage, packed, options) through the converted model:
    (loss, this rank's parameter gradients, repr of the linear layer). options: keywords of
    apply_context_parallel, plus "router" (the model's own loss with
    output_router_logits=True) and "model_loss" (the model's own loss, labels= and
    shift_labels=)."""
    from upipe.integrations.hf import apply_context_parallel, causal_lm_loss, shard_batch
    from upipe.packing import document_positions

    group = dist.group.WORLD
    results = []
    for strategy, U, packed, options in cases:
        options = dict(options)
        router, own = options.pop("router", False), options.pop("model_loss", False)
        model = build_model(arch, seed=123)
        model.load_state_dict(state)
        apply_context_parallel(model, group=group, strategy=strategy, heads_per_stage=U, **options)
        kw = {}
        if packed:
            kw["position_ids_BS"] = document_positions(PACKED_BOUNDS, SEQ).expand(BATCH, SEQ)
        batch = shard_batch(make_batch(), group=group, **kw)
        labels = batch.pop("labels")
        if router or own:
            extra = {"output_router_logits": True} if router else {}
            loss = model(**batch, labels=labels, shift_labels=labels, **extra).loss
        else:
            loss = causal_lm_loss(model(**batch).logits, labels, group=group)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, repr(model.model.layers[0].linear_attn)))
    return results


def hybrid_errors(rank, world_size, cases):
    """Each case -> the ValueError message it raised on this rank (None if it did not)."""
    from upipe.integrations.hf import apply_context_parallel, shard_batch

    group = dist.group.WORLD
    found = {}
    for name in cases:
        forget_agreements()
        try:
            _error_case(name, group, apply_context_parallel, shard_batch)
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


def _error_case(name, group, apply_context_parallel, shard_batch):
    import upipe

    if name == "ring":
        apply_context_parallel(build_model("qwen3_next"), group=group, strategy="ring")
    elif name == "mesh_ring":
        mesh = upipe.make_mesh(ring=2, ulysses=dist.get_world_size() // 2)
        apply_context_parallel(build_model("qwen3_5"), mesh=mesh)
    elif name == "value_heads":  # 2 value heads cannot be split over 4 ranks
        model = build_model("qwen3_5", linear_num_key_heads=1, linear_num_value_heads=2)
        apply_context_parallel(model, group=group)
    elif name == "stages":  # a stage of 3 value heads does not fit 4 heads over the ranks
        apply_context_parallel(build_model("qwen3_next"), group=group, heads_per_stage=3)
    elif name == "stage_inputs":  # not a mode of the stages
        apply_context_parallel(build_model("qwen3_next"), group=group, linear_stage_inputs="drop")
    elif name == "key_heads":  # 3 key heads cannot be shared by 4 value heads
        model = build_model("qwen3_5", linear_num_key_heads=3, linear_num_value_heads=4)
        apply_context_parallel(model, group=group)
    elif name == "activation":
        apply_context_parallel(build_model("qwen3_5", hidden_act="gelu"), group=group)
    elif name == "vision":
        import transformers

        config = transformers.Qwen3_5Config(text_config=BASE)
        with torch.device("meta"):  # (its vision tower is large; the refusal reads the class)
            model = transformers.Qwen3_5ForConditionalGeneration(config)
        apply_context_parallel(model, group=group)
    elif name == "documents_rank0":  # rank 0's boundaries are bad: every rank must raise
        model = apply_context_parallel(build_model("qwen3_5"), group=group)
        batch = shard_batch(make_batch(), group=group)
        batch.pop("labels")
        if dist.get_rank() == 0:
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 7, SEQ + 1])
        model(**batch)
