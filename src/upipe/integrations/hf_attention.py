"""`HFContextParallelAttention`: a Hugging Face attention module's own projections (and
QK-norm) run by upipe's context-parallel strategies; `upipe.integrations.hf` puts one in place
of each decoder layer's `self_attn`.

Legend: B batch, L local tokens, D model width, H query heads, G kv heads, d head dim,
r rotary features per head (d, or fewer: partial rotary).
"""

from __future__ import annotations

import torch

from upipe.attention.module import ContextParallelAttention
from upipe.integrations.hf_archs import Arch, FusedRows, layer_window
from upipe.rope import apply_rope


def _norm_eps(norm) -> float:
    """The epsilon of a transformers RMSNorm (`variance_epsilon`: Llama-style; `eps`: Gemma's
    (1 + weight) norm); upipe's default without a norm."""
    if norm is None:
        return 1e-6
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


class HFContextParallelAttention(ContextParallelAttention):
    """A Hugging Face attention module's projections, run context-parallel.

    Takes over `hf_attn`'s projection (and QK-norm) modules themselves and is called the way
    the decoder layers call their `self_attn`: `forward(hidden_states, position_embeddings,
    ...)` with hidden_states `[B, L, D]` (this rank's tokens) and cos/sin `[B or 1, L, r]`
    for their global positions (r = d, or fewer: partial rotary); returns `(out [B, L, D],
    None)`. Inputs are validated once per model call by the hook that `apply_context_parallel`
    puts on the decoder stack. `arch` (`hf_archs.Arch`): where the q/k/v rows are (a fused
    `qkv_proj`: Phi-3), which QK-norm (per head inside the fused stages, (1 + weight) for Gemma
    3; over the whole projection: OLMo, run unfused), this layer's sliding window, attention
    sinks (the module's `sinks`, gpt-oss) and RoPE form (see `hf_archs`); the softmax scale is
    the module's `scaling`; a gated output (Qwen3-Next, Qwen3.5: q_proj gives the query and a
    gate per head, the output times sigmoid(gate) before o_proj; run unfused with the model's
    own norm modules).
    """

    def __init__(
        self, hf_attn, config, arch: Arch, *, group, mesh, strategy, heads_per_stage, backend,
        state,
    ):  # fmt: skip
        q_norm = getattr(hf_attn, "q_norm", None) if arch.qk_norm == "head" else None
        super().__init__(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            hf_attn.head_dim,
            group=group,
            mesh=mesh,
            layout="contiguous",
            strategy=strategy,
            heads_per_stage=heads_per_stage,
            backend=backend,
            softmax_scale=hf_attn.scaling,
            window=layer_window(arch, config, hf_attn.layer_idx),
            norm_eps=_norm_eps(q_norm),
            norm_offset=arch.norm_offset,
            device="meta",  # placeholders, replaced by the model's own modules below
        )
        self.arch = arch
        names = ("q_proj", "k_proj", "v_proj", "o_proj") if arch.qkv == "split" else ("o_proj",)
        for name in names:
            setattr(self, name, getattr(hf_attn, name))
        if arch.qkv == "fused":  # q/k/v_proj: views of qkv_proj's rows, per call (forward)
            del self.q_proj, self.k_proj, self.v_proj
            self.qkv_proj = hf_attn.qkv_proj
            H, G, d = config.num_attention_heads, config.num_key_value_heads, hf_attn.head_dim
            self._qkv_sizes = (H * d, G * d, G * d)
        if arch.qk_norm is not None:
            self.q_norm, self.k_norm = hf_attn.q_norm, hf_attn.k_norm
        if arch.sinks:  # the model's own parameter (gpt-oss), its gradient flowing into it
            self.sinks = hf_attn.sinks
        self.layer_idx = hf_attn.layer_idx
        self._state = state  # the model call's validated documents (set by the input hook)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        # attention_mask: None (the "upipe" implementation has no mask function; the input
        # hook rejects padding); past_key_values: rejected by the input hook too;
        # cu_seq_lens_q/k: validated by the input hook, which keeps them in the state
        B, L, _ = hidden_states.shape
        cos, sin = (t.expand(B, L, -1) for t in position_embeddings)
        if self.arch.rope_halves:  # gpt-oss: each angle rotates feature j and j + d / 2
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if self.arch.qkv == "fused":
            self.q_proj, self.k_proj, self.v_proj = FusedRows(self.qkv_proj, self._qkv_sizes).parts
        try:
            return self._attend(hidden_states, cos, sin, self._state["docs"]), None
        finally:
            if self.arch.qkv == "fused":
                del self.q_proj, self.k_proj, self.v_proj

    def _attend(self, x, cos, sin, docs=None):
        if not self.arch.unfused:
            return super()._attend(x, cos, sin, docs)
        # QK-norm over the whole projection (OLMo) or a gated output (Qwen3-Next, Qwen3.5):
        # q, k, v (and the gate) in full, then the strategy's op
        B, L, _ = x.shape
        d = self.head_dim
        q, k = self.q_proj(x), self.k_proj(x)
        gate = None
        if self.arch.attn_gate:  # [B, L, H, 2 d]: each head's query, then its gate
            q, gate = q.view(B, L, -1, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(B, L, -1)
        if self.arch.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(B, L, -1, d), k.view(B, L, -1, d)
        if self.arch.qk_norm == "head":  # the model's own modules (zero-centred weights too)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(B, L, -1, d)
        out = self._op(q, k, v, docs).flatten(2)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
