"""upipe.jax: Ulysses and UPipe context-parallel attention in JAX (docs/jax.md).

Per-device functions to call inside `jax.shard_map` over one mesh axis that splits the
sequence: `ulysses_attention` / `upipe_attention` (q, k, v in; `attention`), the attention
layer with projections and RoPE (`layer`), the local blockwise kernel (`kernel`).
Needs the `jax` extra (`pip install 'upipe[jax]'`); `import upipe` does not import it.
"""

from upipe.jax.attention import POLICY, StageGrid, ulysses_attention, upipe_attention
from upipe.jax.kernel import attention
from upipe.jax.layer import apply_rope, attention_layer, rope_cos_sin

__all__ = [
    "POLICY",
    "StageGrid",
    "apply_rope",
    "attention",
    "attention_layer",
    "rope_cos_sin",
    "ulysses_attention",
    "upipe_attention",
]
