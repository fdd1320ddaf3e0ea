"""Per-rank functions for tests/distributed/test_hf.py (module-level so spawned ranks import
them)."""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

from upipe.attention.common import forget_agreements

# tiny decoders: 8 query heads, 4 kv heads (GQA, and Ulysses at 4 ranks), head dim 8, 2 layers
BASE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=2,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.2,
)
ARCHITECTURES = {
    # llama3 rope scaling: cos/sin must come from the model's own rotary embedding
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),  # QK-norm
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),  # sliding_window 4096 > sequence
    # MoE: 4 experts, top 2; Qwen3-MoE with a dense MLP in layer 1 (mlp_only_layers)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
        ),
    ),  # fmt: skip
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    # QK-norm over the whole projection, norms after attention and MLP
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(eos_token_id=None)),
    # a sliding layer whose window (4096) holds the sequence, and a RoPE per layer type
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(eos_token_id=None, layer_types=["sliding_attention", "full_attention"]),
    ),
    # fused qkv_proj and gate_up_proj; partial rotary (half of each head rotates)
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=None,
            eos_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5),
        ),
    ),
}
# sliding windows (12 tokens) shorter than every rank's shard and the sequence, Gemma 3 and
# gpt-oss (tests/distributed/test_hf_archs.py: an architecture's strategies and options in one
# cluster call)
WINDOW = 12
WINDOWED = {
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    # the window on layer 1 only, as Qwen2's config derives layer_types from max_window_layers
    "qwen2_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "phi3_window": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {**ARCHITECTURES["phi3"][2], "sliding_window": WINDOW},
    ),
    "olmo3_window": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        {**ARCHITECTURES["olmo3"][2], "sliding_window": WINDOW},
    ),
    # softmax scale 32 ** -0.5 (head dim 8), (1 + w) norms, a RoPE per layer type
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=8,
            query_pre_attn_scalar=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
                "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0),
            },
        ),
    ),
    # sinks, sliding / full layers, q/k/v/o biases, 4 experts (top 2), yarn RoPE (its default)
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1.5e5,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),  # fmt: skip
    ),
}
SEQ = 64
BATCH = 2


def build_model(arch, seed=0, **overrides):
    """A small causal LM of `arch` with random weights, biases and norm weights away from
    their init (zeros/ones) so that they matter; fp32, eval mode (no dropout)."""
    import transformers

    config_name, model_name, extra = {**ARCHITECTURES, **WINDOWED}[arch]
    config = getattr(transformers, config_name)(**{**BASE_CONFIG, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randint(0, BASE_CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)


def model_in(arch, dtype, **config):
    """build_model(arch, **config) in `dtype` (float64: transformers' grouped-GEMM experts
    take fp32 / bf16 / fp16 only, so MoE experts run its eager loop there; the same
    function)."""
    if dtype == torch.float32:
        return build_model(arch, **config)
    return build_model(arch, experts_implementation="eager", **config).to(dtype)


@contextlib.contextmanager
def summing_router_grads(model, sums: dict | None):
    """While open, adds to `sums[name of a router's bias]` the sum over tokens of |dL/d logit|
    per expert, sum_t |g_t|, of each MoE router with a bias (gpt-oss: its bias gradient is
    sum_t g_t): the scale its fp32 rounding is relative to (`sums=None`: nothing recorded)."""
    handles = []

    def record(name):
        def forward_hook(module, args, out):
            def grad_hook(g_TE):
                sums[name] = sums.get(name, 0) + g_TE.detach().abs().sum(0)

            out[0].register_hook(grad_hook)  # the router's logits, [tokens, experts]

        return forward_hook

    if sums is not None:
        for n, m in model.named_modules():
            if n.endswith("mlp.router") and isinstance(getattr(m, "bias", None), torch.Tensor):
                handles.append(m.register_forward_hook(record(f"{n}.bias")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reference(arch, dtype=torch.float32, router_sums=None):
    """The unmodified model on one process: logits, loss, parameter gradients, state dict
    (float64: the same weights, computed in float64); `router_sums`: `summing_router_grads`."""
    model = model_in(arch, dtype)
    ids = make_batch()
    with summing_router_grads(model, router_sums):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads, model.state_dict()


def run_context_parallel(rank, world_size, arch, strategy, state, load_after, mesh_shape=None):
    """Forward + backward of the context-parallel model on this rank's block.

    The model is built with other random weights, then the reference `state` is loaded
    before or after `apply_context_parallel` (`load_after`). Returns (local logits, loss,
    parameter gradients, parameter names of the converted model, repr of one attention).
    """
    import upipe
    from upipe.integrations.hf import apply_context_parallel, causal_lm_loss, shard_batch

    model = build_model(arch, seed=123)
    if not load_after:
        model.load_state_dict(state)
    if mesh_shape is None:
        cp = dict(group=dist.group.WORLD)
    else:
        cp = dict(mesh=upipe.make_mesh(ring=mesh_shape[0], ulysses=mesh_shape[1]))
    apply_context_parallel(model, strategy=strategy, **cp)
    if load_after:
        model.load_state_dict(state)
    batch = shard_batch(make_batch(), **cp)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = causal_lm_loss(logits, batch["labels"], **cp)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads, repr(model.model.layers[0].self_attn)


def expect_errors(rank, world_size, cases):
    """Each case (name, what) -> the ValueError message it raised on this rank, or None."""
    from upipe.integrations.hf import apply_context_parallel, shard_batch

    group = dist.group.WORLD
    found = {}
    for name in cases:
        msg = None
        forget_agreements()  # a first call: ranks whose inputs differ must exchange verdicts
        try:
            _error_case(name, group, apply_context_parallel, shard_batch)
        except ValueError as e:
            msg = str(e)
        found[name] = msg
    return found


def _error_case(name, group, apply_context_parallel, shard_batch):
    if name == "dynamic_rope":
        rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
        apply_context_parallel(build_model("llama", rope_parameters=rope), group=group)
    elif name == "unsupported_model":
        apply_context_parallel(build_model("llama").model, group=group)
    elif name == "heads":  # a stage of 3 heads does not divide 8 heads over 2 ranks
        apply_context_parallel(build_model("llama"), group=group, heads_per_stage=3)
    else:
        model = apply_context_parallel(build_model("llama"), group=group)
    batch = shard_batch(make_batch(), group=group)
    kw = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    if name == "padding":
        mask = torch.ones_like(batch["input_ids"])
        mask[:, :3] = 0
        kw["attention_mask"] = mask
    elif name == "no_positions":
        del kw["position_ids"]
    elif name == "labels":
        kw["labels"] = batch["labels"]
    elif name == "shift_labels_shape":
        kw["labels"] = kw["shift_labels"] = batch["labels"][:, 1:]
    elif name == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**kw)
    elif name == "packed":  # positions restart mid-shard (a second document)
        kw["position_ids"] = kw["position_ids"].clone()
        kw["position_ids"][:, 5:] -= kw["position_ids"][:, 5:6]
    elif name == "documents_vs_positions":  # boundaries given, positions not restarting
        kw["cu_seq_lens_q"] = kw["cu_seq_lens_k"] = torch.tensor([0, 7, SEQ])
    elif name == "padding_rank0" and dist.get_rank() == 0:  # every rank must still raise
        kw["attention_mask"] = torch.zeros_like(batch["input_ids"])
    model(**kw)


# documents of a packed row: shorter than a shard, one token, spanning shards, to the end
PACKED_BOUNDS = (0, 5, 6, 30, SEQ)


def packed_reference(arch, bounds=PACKED_BOUNDS, dtype=torch.float32, router_sums=None):
    """The unmodified model on each document separately (one process): logits concatenated,
    the loss over every document's next tokens (a document's last token has none), gradients,
    state dict; `router_sums`: `summing_router_grads`."""
    model = model_in(arch, dtype)
    with summing_router_grads(model, router_sums):
        logits, loss = each_document_alone(model, make_batch(), bounds)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads, model.state_dict()


def each_document_alone(model, ids, bounds):
    """(logits [B, S, V], loss) of `model` fed each document of `bounds` (the same for every
    row) as a sequence of its own: the loss over every document's next tokens (a document's
    last token has none)."""
    import torch.nn.functional as F

    logits, loss_sum, count = [], 0.0, 0
    for a, b in itertools.pairwise(bounds):
        part = model(input_ids=ids[:, a:b]).logits
        logits.append(part)
        if b - a > 1:
            loss_sum = loss_sum + F.cross_entropy(
                part[:, :-1].flatten(0, 1), ids[:, a + 1 : b].flatten(), reduction="sum"
            )
            count += ids.shape[0] * (b - a - 1)
    return torch.cat(logits, dim=1), loss_sum / count


def run_packed(rank, world_size, arch, strategy, state, bounds=PACKED_BOUNDS):
    """A packed batch (positions restarting per document) through the converted model, the
    way transformers' packing hands it over; returns what `run_context_parallel` does."""
    from upipe.integrations.hf import apply_context_parallel, causal_lm_loss, shard_batch
    from upipe.packing import document_positions

    group = dist.group.WORLD
    model = apply_context_parallel(build_model(arch, seed=123), group=group, strategy=strategy)
    model.load_state_dict(state)
    positions_BS = document_positions(bounds, SEQ).expand(BATCH, SEQ)
    batch = shard_batch(make_batch(), position_ids_BS=positions_BS, group=group)
    assert batch["cu_seq_lens_q"].tolist() == list(bounds)
    labels = batch.pop("labels")
    logits = model(**batch).logits
    loss = causal_lm_loss(logits, labels, group=group)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads, repr(model.model.layers[0].self_attn)


def model_losses(rank, world_size, arch, state, reference_logits):
    """The loss of the converted model three ways: causal_lm_loss on its logits, the model's
    own (labels= with shift_labels=), and its share given the global count of valid labels
    (num_items_in_batch, as transformers' Trainer passes it); and causal_lm_loss on this
    rank's block of the unmodified model's logits."""
    from upipe.comm import shard_sequence
    from upipe.integrations.hf import apply_context_parallel, causal_lm_loss, shard_batch

    group = dist.group.WORLD
    model = apply_context_parallel(build_model(arch, seed=123), group=group)
    model.load_state_dict(state)
    batch = shard_batch(make_batch(), group=group)
    labels = batch.pop("labels")
    ours = causal_lm_loss(model(**batch).logits, labels, group=group)
    own = model(**batch, labels=labels, shift_labels=labels).loss
    count = (labels != -100).sum()
    dist.all_reduce(count, group=group)
    share = model(**batch, labels=labels, shift_labels=labels, num_items_in_batch=count).loss
    reference_BLV = shard_sequence(reference_logits, group=group)
    on_reference = causal_lm_loss(reference_BLV, labels, group=group)
    return ours.item(), own.item(), share.item(), on_reference.item()
