"""Model configuration and presets (Llama-3 / Qwen3-style decoders)."""

from __future__ import annotations

import dataclasses

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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
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

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: full attention)."""
        if self.layer_types is not None and self.layer_types[i] == "full_attention":
            return None
        return self.sliding_window

    def num_params(self) -> int:
        """Parameter count: embeddings, per block 4 projections + 3 MLP matrices + norms."""
        D, H, G, d, F = self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim
        block = D * d * (2 * H + 2 * G) + 3 * D * F + 2 * D + (2 * d if self.qk_norm else 0)
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
