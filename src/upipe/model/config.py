"""Model configuration and presets (Llama-3 / Qwen3-style decoders, dense or mixture-of-experts)."""

from __future__ import annotations

import dataclasses

from upipe.heads import kv_problem
from upipe.rope import Llama3RopeScaling


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelConfig:
    vocab_size: int = 257
    """Vocabulary size (257 = the byte-level tokenizer: 256 bytes + end-of-document)."""
    hidden_size: int = 128
    """Model width D (Hugging Face's hidden_size)."""
    n_layers: int = 2
    """Number of decoder blocks."""
    n_heads: int = 8
    """Query heads H."""
    n_kv_heads: int = 4
    """Key/value heads G (G < H: grouped-query attention)."""
    head_dim: int = 16
    """Head dimension d (need not be hidden_size / n_heads, as in Qwen3)."""
    ffn_dim: int = 384
    """Hidden width of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Llama3RopeScaling | None = None
    """Llama 3.1's "llama3" scaling of the RoPE frequencies (None: plain RoPE)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """lm_head shares the input embedding's weight."""
    sliding_window: int | None = None
    """Causal sliding window of the sliding-attention layers (token i sees keys
    i-sliding_window+1 .. i, as transformers' `sliding_window`); None: none."""
    layer_types: tuple[str, ...] | None = None
    """Per layer "sliding_attention" or "full_attention" (transformers' `layer_types`); None
    with a `sliding_window`: every layer slides (Mistral)."""
    n_experts: int = 0
    """Experts E of each block's mixture-of-experts MLP (`upipe.model.moe`); 0: the dense
    SwiGLU MLP of `ffn_dim` (the MoE fields below are then unused)."""
    experts_per_token: int = 2
    """Experts k each token is routed to (the router's top-k; Hugging Face's
    num_experts_per_tok)."""
    expert_ffn_dim: int = 0
    """Hidden width F of each expert's SwiGLU (Hugging Face's moe_intermediate_size)."""
    shared_expert_ffn_dim: int = 0
    """Hidden width of a shared expert, a SwiGLU every token goes through besides its k
    routed experts, added ungated (as in DeepSeek-V2/V3); 0: none."""
    router_weights: str = "softmax_renorm"
    """How the router weighs a token's k experts (`upipe.model.moe.ROUTER_WEIGHTS`):
    "softmax" -- the top-k of the softmax over all E logits, as they are (Qwen3-MoE with
    norm_topk_prob false); "softmax_renorm" -- the same, divided by their sum (Mixtral,
    Qwen3-MoE with norm_topk_prob true); "topk_softmax" -- a softmax over the k largest
    logits (gpt-oss; equal to softmax_renorm in exact arithmetic, computed in that order)."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the training objective (Switch Transformer's
    alpha; Hugging Face's router_aux_loss_coef): loss + coef * aux, aux the mean over the
    MoE blocks of E * sum_e f_e P_e (`upipe.model.moe`)."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        problem = kv_problem(self.n_heads, self.n_kv_heads, query="n_heads", kv="n_kv_heads")
        if problem:
            raise ValueError(problem)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings), got {self.head_dim}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {w!r}")
        if self.layer_types is not None:
            kinds = ("sliding_attention", "full_attention")
            if len(self.layer_types) != self.n_layers or set(self.layer_types) - set(kinds):
                raise ValueError(
                    f"layer_types must list {self.n_layers} entries (n_layers), each one of "
                    f"{kinds}; got {self.layer_types!r}"
                )
            if w is None and "sliding_attention" in self.layer_types:
                raise ValueError("layer_types has sliding_attention layers: set sliding_window")

        if self.n_experts:
            self._check_moe()

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: full attention)."""
        if self.layer_types is not None and self.layer_types[i] == "full_attention":
            return None
        return self.sliding_window

    def _check_moe(self) -> None:
        E, k = self.n_experts, self.experts_per_token
        if E < 1 or not 1 <= k <= E:
            raise ValueError(
                f"experts_per_token ({k}) must be in 1..n_experts ({E}): route each token to "
                f"at most as many experts as there are (n_experts=0 is the dense MLP)"
            )
        if self.expert_ffn_dim < 1 or self.shared_expert_ffn_dim < 0:
            raise ValueError(
                f"expert_ffn_dim must be >= 1 and shared_expert_ffn_dim >= 0 (0: no shared "
                f"expert), got {self.expert_ffn_dim} and {self.shared_expert_ffn_dim}"
            )
        weights = ("softmax", "softmax_renorm", "topk_softmax")  # = moe.ROUTER_WEIGHTS
        if self.router_weights not in weights:
            raise ValueError(
                f"router_weights must be one of {weights}, got {self.router_weights!r}"
            )
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(
                f"router_aux_loss_coef must be >= 0 (0: no load-balancing loss), got "
                f"{self.router_aux_loss_coef}"
            )

    def _mlp_params(self, experts: int) -> int:
        """One block's MLP parameters with `experts` of its experts counted: 3 D F for the
        dense SwiGLU; for MoE the router E D, 3 D F per expert and 3 D F_s shared."""
        D = self.hidden_size
        if not self.n_experts:
            return 3 * D * self.ffn_dim
        return self.n_experts * D + 3 * D * (
            experts * self.expert_ffn_dim + self.shared_expert_ffn_dim
        )

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count: embeddings, per block 4 projections + the MLP + norms.

        `active`: the parameters one token's forward uses -- with MoE the router, its k
        experts and the shared one (not the other E - k); the same as the total for a dense
        model. Qwen3-30B-A3B: 30.5B in all, 3.3B active."""
        D, H, G, d = self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim
        experts = self.experts_per_token if active else self.n_experts
        attn = D * d * (2 * H + 2 * G) + 2 * D + (2 * d if self.qk_norm else 0)
        block = attn + self._mlp_params(experts)
        head = 0 if self.tie_embeddings else self.vocab_size * D
        return self.vocab_size * D + self.n_layers * block + D + head


PRESETS: dict[str, ModelConfig] = {
    # runs on a CPU in seconds: byte vocabulary, 2 blocks
    "tiny": ModelConfig(),
    # the same with Qwen3's QK-norm and tied embeddings (2 kv heads: replicated on 4 ranks)
    "tiny-qwen3": ModelConfig(n_kv_heads=2, qk_norm=True, tie_embeddings=True),
    # sliding-window layers of 64 tokens alternating with full ones (as gpt-oss, Gemma 3)
    "tiny-sliding": ModelConfig(
        n_layers=4, sliding_window=64,
        layer_types=("sliding_attention", "full_attention") * 2,
    ),
    # the shapes of the published checkpoints (Hugging Face config.json)
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5,
    ),
    "qwen3-32b": ModelConfig(
        vocab_size=151936, hidden_size=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
        ffn_dim=25600, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
    ),
    # the tiny model with an MoE MLP: 8 experts of width 96, 2 per token, and a shared one
    "tiny-moe": ModelConfig(
        n_experts=8, experts_per_token=2, expert_ffn_dim=96, shared_expert_ffn_dim=96,
        router_aux_loss_coef=0.01,
    ),
    # Qwen/Qwen3-30B-A3B: transformers 5's Qwen3MoeConfig defaults give the widths, heads,
    # experts (128, 8 per token, moe_intermediate_size 768), vocabulary, eps and aux coef;
    # the depth (48), head_dim 128, rope_theta 1e6 and norm_topk_prob true are the hub's
    # config.json as we remember it (not verifiable offline; the defaults say 24 layers)
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        ffn_dim=6144, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, n_experts=128,
        experts_per_token=8, expert_ffn_dim=768, router_weights="softmax_renorm",
        router_aux_loss_coef=0.001,
    ),
    "llama3-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
        ffn_dim=28672, rope_theta=500000.0, norm_eps=1e-5,
    ),
}  # fmt: skip


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, with fields replaced by `overrides`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
