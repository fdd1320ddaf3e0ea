"""The Hugging Face architectures `apply_context_parallel` converts, and what each one needs:
one table (`ARCHITECTURES`), the refusals of the ones it cannot convert yet (`BLOCKED`), and
the per-architecture pieces the integration is built from -- where the q/k/v rows are, which
QK-norm, which decoder-layer form.

Legend: B batch, L tokens of this rank, D width, H query heads, G kv heads, d head dim,
T tile tokens.

What differs between the supported decoders, and how upipe runs it:
- q/k/v projections: separate `q_proj`/`k_proj`/`v_proj` (Llama, ...), or one fused
  `qkv_proj` `[(H + 2G) d, D]` (Phi-3), whose row blocks are handed to the attention as
  views (`FusedRows`: one split per call, so the weight gradient is one concatenation).
- QK-norm: none; over each head's d features ("head": Qwen3, Qwen3-MoE; Gemma 3's
  zero-centred "(1 + weight)" form: `norm_offset`), inside UPipe's fused stages; or over the
  whole projection of a token, all H d (resp. G d) features at once ("projection": OLMo 2 /
  OLMo 3). The latter couples all heads of a token, so the heads cannot be projected stage
  by stage: q, k, v are projected and normalised in full by the model's own norm modules,
  then the staged (not fused) UPipe op runs -- exact, but the memory saving of the fused
  projections is lost (q/k/v `[B, L, H d]` exist).
- The softmax scale: the attention module's own `scaling` (head_dim ** -0.5; Gemma 3:
  query_pre_attn_scalar ** -0.5), handed to the op.
- Sliding windows (`window`, `layer_window`): where the model's own code applies
  `config.sliding_window` -- on every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE: their
  decoder stack picks the sliding mask whenever config.sliding_window is set; Qwen3-MoE's
  config sets it to None unless use_sliding_window), or on the layers whose
  `config.layer_types` entry is "sliding_attention" (Qwen2 / Qwen3, whose configs derive
  layer_types from use_sliding_window and max_window_layers; OLMo 3, Gemma 3, gpt-oss). Token
  i then sees keys i-w+1 .. i, transformers' `sliding_window_overlay`; upipe's ops take it as
  `window=w` (`upipe.attention.window`), so any sequence length is exact.
- Attention sinks (gpt-oss): the module's own `sinks` parameter `[H]` is the layer's
  `sinks` (`upipe.attention.sinks`); its gradient flows into it.
- RoPE: cos/sin from the model's rotary embedding, one pair for all layers or one per layer
  type (OLMo 3, Gemma 3: `rotary_embeddings`); rotate-half form over r <= d features (r < d:
  Phi-3's partial rotary), or gpt-oss's halves form (`rope_halves`: cos/sin of d / 2 angles,
  the two halves of each head rotated by them -- the rotate-half form with each angle twice).
- Decoder layer (for upipe's own layer forward under `tiled_mlp` / `activation_checkpoint`):
  "pre_norm", h = x + attn(norm_1(x)), y = h + mlp(norm_2(h)) (Llama, Mistral, Qwen, Mixtral,
  gpt-oss, Phi-3 with resid_pdrop = 0); "post_norm", h = x + norm_1(attn(x)),
  y = h + norm_2(mlp(h)) (OLMo 2 / 3); "sandwich", four norms, h = x + norm_2(attn(norm_1(x))),
  y = h + norm_4(mlp(norm_3(h))) (Gemma 3: input / post-attention / pre- and post-feed-forward
  layernorms).
- MoE (Mixtral, Qwen3-MoE, gpt-oss, Qwen3-Next, Qwen3.5-MoE): the model's sparse MoE block
  (with its shared expert, where it has one) stays as it is (routing is per token, so tiles
  of tokens route as the whole does; gpt-oss's returns (hidden, router scores), of which the
  layer keeps the first); its router aux loss is computed over the whole sequence
  (`upipe.integrations.hf_moe`).
- Hybrid decoders (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): most layers' token mixer is a Gated
  DeltaNet (`linear_attn`, run by `upipe.integrations.hf_deltanet`), the others gated full
  attention: q_proj gives each head's query and an output gate `[H, 2 d]`, the output is
  multiplied by sigmoid(gate) before o_proj; QK-norm per head with a zero-centred weight
  (x * (1 + w), the model's own norm modules); partial rotary. The gate is per token and
  head, outside the attention: such layers run unfused (q, k, v and the gate projected in
  full, then the strategy's op), like OLMo's.
"""

from __future__ import annotations

import dataclasses
import functools

import torch.nn.functional as F

from upipe.model.features import tiled_recompute


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arch:
    """What upipe needs to know of a Hugging Face decoder architecture (module doc)."""

    qkv: str = "split"
    """"split" (q_proj, k_proj, v_proj) or "fused" (one qkv_proj)."""
    qk_norm: str | None = None
    """None, "head" (RMSNorm over each head's d) or "projection" (over all heads' H d)."""
    norm_offset: float = 0.0
    """The "head" QK-norm multiplies by norm_offset + weight: 1.0 for the zero-centred
    "(1 + weight)" RMSNorm (Gemma 3, Qwen3-Next), run inside the fused stages as the model's
    own norm computes it (`upipe.attention.staged_layer.rms_norm`)."""
    layer: str = "pre_norm"
    """The decoder layer's form: "pre_norm", "post_norm" or "sandwich"."""
    router: bool = False
    """Mixture-of-experts layers with top-k routers (an aux loss)."""
    window: str | None = None
    """Where config.sliding_window applies: None (nowhere), "all" (every layer) or
    "layer_types" (the "sliding_attention" layers); module doc, `layer_window`."""
    sinks: bool = False
    """Attention sinks: the attention module's `sinks` parameter (gpt-oss)."""
    rope_halves: bool = False
    """cos/sin of d / 2 angles rotating the two halves of each head (gpt-oss)."""
    attn_gate: bool = False
    """Gated attention output: q_proj rows [H, 2 d] give the query and a gate per head
    (Qwen3-Next, Qwen3.5); runs unfused."""
    hybrid: bool = False
    """Gated DeltaNet layers (`linear_attn`) between the attention layers."""

    @property
    def unfused(self) -> bool:
        """Whether the attention projections run in full before the strategy's op."""
        return self.attn_gate or self.qk_norm == "projection"


# Qwen3-Next / Qwen3.5: zero-centred QK-norm per head, gated attention output, DeltaNet layers
_HYBRID = dict(qk_norm="head", norm_offset=1.0, attn_gate=True, hybrid=True)

ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": Arch(),
    "MistralForCausalLM": Arch(window="all"),
    "Qwen2ForCausalLM": Arch(window="layer_types"),
    "Qwen3ForCausalLM": Arch(qk_norm="head", window="layer_types"),
    "Qwen3MoeForCausalLM": Arch(qk_norm="head", router=True, window="all"),
    "MixtralForCausalLM": Arch(router=True, window="all"),
    "Olmo2ForCausalLM": Arch(qk_norm="projection", layer="post_norm"),
    "Olmo3ForCausalLM": Arch(qk_norm="projection", layer="post_norm", window="layer_types"),
    "Phi3ForCausalLM": Arch(qkv="fused", window="all"),
    "Gemma3ForCausalLM": Arch(
        qk_norm="head", norm_offset=1.0, layer="sandwich", window="layer_types"
    ),
    "GptOssForCausalLM": Arch(router=True, window="layer_types", sinks=True, rope_halves=True),
    "Qwen3NextForCausalLM": Arch(**_HYBRID, router=True),
    "Qwen3_5ForCausalLM": Arch(**_HYBRID),
    "Qwen3_5MoeForCausalLM": Arch(**_HYBRID, router=True),
}
"""The supported architectures (by class name: transformers is not imported)."""

PLANNED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
)
"""Those `upipe plan --hf-config` simulates: the dense decoders, whose time model and shapes
(`hf_shapes`) count a dense MLP and fused attention projections -- not the experts of an MoE
model, OLMo's unfused attention or Phi-3's fused rows -- and the hybrid Qwen3-Next, whose
memory (Gated DeltaNet layers, gated attention, FSDP2-sharded experts) and time are both
those of the Hugging Face model itself (`upipe.planner.hf`,
tests/distributed/test_plan_hybrid.py)."""


def _gemma2(cfg) -> str:
    return (
        "Gemma2ForCausalLM is not supported: its attention logit soft-capping "
        f"(attn_logit_softcapping={cfg.attn_logit_softcapping}: tanh on every score) is not in "
        "upipe's attention kernels, and the architecture is not tested; Gemma3ForCausalLM is "
        "supported"
    )


def _gemma3_multimodal(cfg) -> str:
    return (
        "Gemma3ForConditionalGeneration is not supported: the image tokens attend to each other "
        "both ways (a mask upipe's causal kernels do not have) and the vision tower is not "
        "context-parallel; the text model, Gemma3ForCausalLM (a Gemma3TextConfig), is supported"
    )


def _vision(text_class):
    def problem(cfg) -> str:
        return (
            f"the vision-language model is not supported: convert its text model, "
            f"{text_class} (built from config.text_config)"
        )

    return problem


BLOCKED = {
    "Gemma3ForConditionalGeneration": _gemma3_multimodal,
    "Gemma2ForCausalLM": _gemma2,
    "Qwen3_5ForConditionalGeneration": _vision("Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": _vision("Qwen3_5MoeForCausalLM"),
}
"""Architectures refused with what blocks them (`upipe.integrations.hf` docs, "Supported")."""


def config_problem(cfg) -> str | None:
    """A feature of a supported architecture's config that upipe does not compute, or None."""
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap:
        return (
            f"attn_logit_softcapping={softcap} (tanh on every attention score) is not "
            "supported: upipe's attention kernels have no soft-capping; set "
            "config.attn_logit_softcapping = None"
        )
    if getattr(cfg, "use_bidirectional_attention", False):
        return (
            "use_bidirectional_attention=True is not supported: upipe's windows and kernels "
            "are causal; set config.use_bidirectional_attention = False"
        )
    return None


def layer_window(arch: Arch, cfg, layer_idx: int) -> int | None:
    """The sliding window of decoder layer `layer_idx`, where the model applies it (module
    doc), or None."""
    window = getattr(cfg, "sliding_window", None)
    if arch.window == "all":
        return window
    if arch.window == "layer_types":
        kind = (getattr(cfg, "layer_types", None) or [])[layer_idx : layer_idx + 1]
        return window if kind == ["sliding_attention"] else None
    return None


def architecture(model) -> Arch:
    """The `Arch` of a transformers causal LM; ValueError naming what blocks it otherwise."""
    names = [c.__name__ for c in type(model).__mro__]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
        if name in BLOCKED:
            raise ValueError(BLOCKED[name](model.config))
    raise ValueError(
        f"{type(model).__name__} is not supported; supported architectures: "
        f"{', '.join(ARCHITECTURES)}"
    )


def memory_problem(model, arch: Arch) -> str | None:
    """Why upipe's own layer forward (tiled_mlp / activation_checkpoint) would compute
    something else than this model's layers, or None."""
    cfg = model.config
    for name in ("resid_pdrop", "router_jitter_noise"):  # (Phi-3, Mixtral)
        value = getattr(cfg, name, 0.0) or 0.0
        if value:
            return (
                f"{name}={value} with tiled_mlp / activation_checkpoint: the recomputation "
                f"would draw other random numbers than the forward; set config.{name} = 0.0 "
                "or turn those options off"
            )
    return None


class FusedRows:
    """q_proj, k_proj and v_proj of a fused `qkv_proj` for one call: views of its weight's
    row blocks `[H d | G d | G d, D]`, made by one split (its backward: one concatenation),
    each usable as a bias-free `torch.nn.Linear`."""

    def __init__(self, qkv_proj, sizes):
        self.parts = [_Rows(w) for w in qkv_proj.weight.split(sizes)]


class _Rows:
    def __init__(self, weight):
        self.weight, self.bias = weight, None

    def __call__(self, x):
        return F.linear(x, self.weight)


def layer_forward(arch: Arch):
    """upipe's forward of one decoder layer of `arch` (the module doc's forms):
    `fn(layer, memory, hidden_states, position_embeddings=None, **kwargs)`."""
    return {"pre_norm": _pre_norm_layer, "post_norm": _post_norm_layer}.get(
        arch.layer, _sandwich_layer
    )


def _attention(layer, x_BLD, position_embeddings, kwargs):
    """The layer's token mixer: its attention, or a hybrid's Gated DeltaNet."""
    kwargs.pop("attention_mask", None)  # None here (see upipe.integrations.hf_memory)
    if getattr(layer, "linear_attn", None) is not None:
        return layer.linear_attn(hidden_states=x_BLD, attention_mask=None, **kwargs)
    out_BLD, _ = layer.self_attn(
        hidden_states=x_BLD, position_embeddings=position_embeddings, attention_mask=None, **kwargs
    )
    return out_BLD


def _mlp(layer, x_BTD):
    """The layer's MLP output (gpt-oss's MoE block returns (hidden, router scores))."""
    out = layer.mlp(x_BTD)
    return out[0] if isinstance(out, tuple) else out


def _pre_norm_layer(layer, memory, hidden_states, position_embeddings=None, **kwargs):
    """h = x + attn(norm_1(x)), then y = h + mlp(norm_2(h)), the second half in tiles with
    `tiled_mlp`; norm_1 runs in tiles, keeping only its input."""
    x_BLD, opt = hidden_states, memory.options
    normed_BLD = tiled_recompute(layer.input_layernorm, x_BLD, opt.mlp_tile)
    h_BLD = x_BLD + _attention(layer, normed_BLD, position_embeddings, kwargs)
    if not opt.tiled_mlp:
        return h_BLD + _norm_then_mlp(layer, h_BLD)
    fn = functools.partial(_norm_then_mlp, layer)
    return tiled_recompute(fn, h_BLD, opt.mlp_tile, residual=True)


def _norm_then_mlp(layer, h_BTD):
    return _mlp(layer, layer.post_attention_layernorm(h_BTD))


def _post_norm_layer(layer, memory, hidden_states, position_embeddings=None, **kwargs):
    """h = x + norm_1(attn(x)), then y = h + norm_2(mlp(h)), the second half in tiles with
    `tiled_mlp`; norm_1 runs in tiles, keeping only its input."""
    x_BLD, opt = hidden_states, memory.options
    attn_BLD = _attention(layer, x_BLD, position_embeddings, kwargs)
    h_BLD = x_BLD + tiled_recompute(layer.post_attention_layernorm, attn_BLD, opt.mlp_tile)
    del attn_BLD
    if not opt.tiled_mlp:
        return h_BLD + _mlp_then_norm(layer, h_BLD)
    fn = functools.partial(_mlp_then_norm, layer)
    return tiled_recompute(fn, h_BLD, opt.mlp_tile, residual=True)


def _mlp_then_norm(layer, h_BTD):
    return layer.post_feedforward_layernorm(_mlp(layer, h_BTD))


def _sandwich_layer(layer, memory, hidden_states, position_embeddings=None, **kwargs):
    """h = x + norm_2(attn(norm_1(x))), then y = h + norm_4(mlp(norm_3(h))), the second half
    in tiles with `tiled_mlp`; norm_1 and norm_2 run in tiles, keeping only their inputs."""
    x_BLD, opt = hidden_states, memory.options
    normed_BLD = tiled_recompute(layer.input_layernorm, x_BLD, opt.mlp_tile)
    attn_BLD = _attention(layer, normed_BLD, position_embeddings, kwargs)
    del normed_BLD
    h_BLD = x_BLD + tiled_recompute(layer.post_attention_layernorm, attn_BLD, opt.mlp_tile)
    del attn_BLD
    if not opt.tiled_mlp:
        return h_BLD + _normed_mlp_normed(layer, h_BLD)
    fn = functools.partial(_normed_mlp_normed, layer)
    return tiled_recompute(fn, h_BLD, opt.mlp_tile, residual=True)


def _normed_mlp_normed(layer, h_BTD):
    return layer.post_feedforward_layernorm(_mlp(layer, layer.pre_feedforward_layernorm(h_BTD)))


def rotary_embeddings(base, x_BLD, position_ids):
    """The decoder stack's cos/sin for each layer: one pair for all (Llama, ...), or one per
    layer type where the rotary embedding takes it (OLMo 3: `rotary_emb(x, pos, layer_type)`)."""
    types = getattr(base.config, "layer_types", None)
    if isinstance(getattr(base.rotary_emb, "rope_type", None), dict):  # per layer type
        by_type = {t: base.rotary_emb(x_BLD, position_ids, t) for t in sorted(set(types))}
        return [by_type[t] for t in types]
    cos_sin = base.rotary_emb(x_BLD, position_ids=position_ids)
    return [cos_sin] * base.config.num_hidden_layers


def rope_types(rotary_emb) -> tuple[str, ...]:
    """The rope types of a model's rotary embedding (one, or one per layer type)."""
    rope_type = rotary_emb.rope_type
    return tuple(rope_type.values()) if isinstance(rope_type, dict) else (rope_type,)
