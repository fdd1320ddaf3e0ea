"""Context-parallel attention strategies, one file each, listed in `registry`.

The functional ops share one signature, `op(q, k, v, *, group | mesh, causal,
softmax_scale, backend, layout, cu_seqlens)`: `usp_attention` takes a 2-D `mesh`,
`ring_attention` and `ulysses_attention` a 1-D `group`, `upipe_attention` either (and
`heads_per_stage`). `cu_seqlens` (document boundaries of packed sequences) is handled by
`documents` (which kernel calls a block makes) and `varlen` (one CUDA call for all).
`registry.STRATEGIES` says what each one needs (group or mesh, default layout, kv-head
rule); `ContextParallelAttention` (module.py) is the layer that projects, applies RoPE and
calls one of them. `gated_deltanet` (deltanet.py) is the linear attention of hybrid models
(Qwen3-Next, Qwen3.5) split by heads the same ways (Ulysses, UPipe stages).

Under `torch.compile` each strategy op is one clean graph break (`torch.compiler.disable`):
the rest of the model compiles, and the op runs as written. Its buffers are freed and its
exchanges ordered by hand for memory (stage by stage, collectives on their own streams),
which a traced graph would not keep; the validation exchange (`common`) runs outside any
graph too, and is skipped once the inputs' signature was agreed.
"""

from upipe.attention.deltanet import gated_deltanet
from upipe.attention.module import ContextParallelAttention
from upipe.attention.registry import STRATEGIES, Strategy, get_strategy
from upipe.attention.ring import ring_attention
from upipe.attention.ulysses import ulysses_attention
from upipe.attention.upipe import upipe_attention
from upipe.attention.usp import usp_attention

__all__ = [
    "STRATEGIES",
    "ContextParallelAttention",
    "Strategy",
    "gated_deltanet",
    "get_strategy",
    "ring_attention",
    "ulysses_attention",
    "upipe_attention",
    "usp_attention",
]
