"""`ContextParallelAttention`: a Llama/Qwen attention layer over a sequence-sharded input.

Legend: B batch, L local tokens, D model width, H query heads, G kv heads, d head dim.

Parameters are `torch.nn.Linear` layers named and shaped as in Hugging Face Llama/Qwen
(`q_proj` [H*d, D], `k_proj`/`v_proj` [G*d, D], `o_proj` [D, H*d]), so their weights load
unchanged. They are built without bias; biases put in later (`upipe.integrations.hf` for
Qwen2) are applied. Strategies (`registry.STRATEGIES` lists what each needs):
- "ulysses": q/k/v projections and RoPE in autograd, `ulysses_attention` (on a mesh
  `usp_attention`), then `o_proj`;
- "upipe": the fused staged op (fused.py): projections, RoPE and o_proj run per stage
  inside the op and are recomputed in backward, so full-head q/k/v and the full attention
  output gradient never exist. On a mesh each stage's attention is ring attention over the
  ring dim;
- "ring" (group only): projections and RoPE in autograd, `ring_attention` (all heads stay on
  every rank; the default layout is the load-balanced "zigzag"), then `o_proj`.
On a 2-D mesh (`mesh=`, dims "ring" x "ulysses") x is this rank's part in the mesh layout of
`upipe.comm`; the heads are split over the ulysses dim.
"""

from __future__ import annotations

import torch
from torch import nn

from upipe.attention.common import (
    DocumentsArg,
    _divisors,
    agree_across_ranks,
    check_group,
    check_layout,
    check_ring_layout,
    resolve_groups,
)
from upipe.attention.fused import fused_upipe_attention
from upipe.attention.registry import MODULE_STRATEGIES, check_heads, get_strategy
from upipe.attention.schedule import check_heads_per_stage, plan_schedule
from upipe.attention.sinks import check_sinks
from upipe.attention.staged_layer import rms_norm
from upipe.attention.usp import usp_attention
from upipe.attention.window import check_window
from upipe.comm import check_layout_name
from upipe.kernels import BACKENDS, check_kernel
from upipe.rope import apply_rope, rope_cos_sin


class ContextParallelAttention(nn.Module):
    """Causal self-attention with RoPE on this rank's shard of the sequence.

    `forward(x, position_ids)`: x `[B, L, D]` holds this rank's tokens, position_ids
    `[B, L]` their global positions; returns `[B, L, D]`. With `group` (C ranks) rank r holds
    its tokens in `layout`: "contiguous" (default; tokens r*L .. (r+1)*L-1) or "zigzag"
    (chunks r and 2C-1-r of 2C, `shard_sequence(x, group=group, layout="zigzag")`); with
    `mesh` (`upipe.make_mesh`) the tokens of `shard_sequence(x, mesh=mesh, layout=layout)`
    (layout of the ring dim, default "zigzag"; `sequence_positions(S, mesh=mesh)` gives
    their positions), and C is the ulysses size.
    Exactly one of group/mesh. All ranks call it together (it communicates).
    `window`: a causal sliding window (token i sees keys i-window+1 .. i, as transformers'
    `sliding_window` on a "sliding_attention" layer; None: full attention), with work
    proportional to the window (`upipe.attention.window`).
    `sinks`: attention sinks as gpt-oss (transformers' `GptOssAttention.sinks`): a parameter
    `sinks` `[H]` (initialised to 0; in the layer's dtype) whose entry h is a logit added to
    every row's softmax denominator of query head h (`upipe.attention.sinks`). Its gradient
    on each rank is the rank's share (its heads, or on a ring its rows), like the weights':
    the sum over the ranks is the full gradient.
    `qk_norm`: RMSNorm over each head's d features of q and k before RoPE (Qwen3; modules
    `q_norm`, `k_norm`), times `norm_offset` + weight: 0.0 as torch's `nn.RMSNorm`, 1.0 the
    zero-centred "(1 + weight)" norm of Gemma 3 and Qwen3-Next (`staged_layer.rms_norm`; the
    weights then start at 0).
    `overlap` (strategy "upipe"): start each next stage's all-to-alls while the current
    stage's attention runs (same results bit for bit; costs up to 8 stage buffers, 8U/H of
    one [B, L, H*d] tensor; `upipe.attention.fused`). None: on for CUDA inputs of at most
    64K gathered tokens, where the exchanges are a visible share of the time, off for
    longer ones (under 5% to gain, memory matters) and on CPU (`fused.default_overlap`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int | None = None,
        *,
        group=None,
        mesh=None,
        layout: str | None = None,
        strategy: str = "upipe",
        heads_per_stage: int | None = None,
        overlap: bool | None = None,
        rope_theta: float = 10000.0,
        rope_scaling=None,
        rope_interleaved: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        causal: bool = True,
        backend: str | None = None,
        window: int | None = None,
        sinks: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        ulysses, self.ring_group, R, self.agree = resolve_groups(group, mesh)
        C = check_group(ulysses)
        if layout is not None:
            check_layout_name(layout)
        cp = "context-parallel size" if mesh is None else "ulysses size"
        spec = get_strategy(strategy, MODULE_STRATEGIES)
        if mesh is not None and not spec.mesh:
            on_mesh = [name for name in MODULE_STRATEGIES if get_strategy(name).mesh]
            raise ValueError(f"strategy {strategy!r} takes group=; on a mesh use one of {on_mesh}")
        for name, val in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"hidden_size ({hidden_size}) is not divisible by num_heads ({num_heads}); "
                    "pass head_dim"
                )
            head_dim = hidden_size // num_heads
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings), got {head_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}); valid: "
                f"{_divisors(num_heads)}"
            )
        problem = check_heads(strategy, num_heads, num_kv_heads, C, size=cp)
        if problem:
            raise ValueError(problem)
        self.rounds = None  # the stage schedule of a staged strategy (upipe's fused op)
        if spec.heads_per_stage:
            heads_per_stage = check_heads_per_stage(num_heads, num_kv_heads, C, heads_per_stage)
            rank = torch.distributed.get_rank(ulysses)
            self.rounds = plan_schedule(num_heads, num_kv_heads, C, heads_per_stage, rank)
        elif heads_per_stage is not None or overlap:
            staged = [name for name in MODULE_STRATEGIES if get_strategy(name).heads_per_stage]
            what = "heads_per_stage" if heads_per_stage is not None else "overlap"
            raise ValueError(f"{what} applies to strategy={staged[0]!r} only")
        self.overlap = overlap
        # the sequence layout: of the group (1-D), or of the mesh's ring dim (2-D)
        self.group, self.mesh = ulysses, mesh
        self.layout = layout or (spec.layout if mesh is None else "zigzag")
        self.strategy, self.heads_per_stage = strategy, heads_per_stage
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = (
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.rope_scaling = rope_scaling  # `upipe.rope.Llama3RopeScaling` or None
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        check_window(window, causal)
        self.causal, self.backend, self.window = causal, backend, window
        kw = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, **kw)
        if not isinstance(sinks, bool):
            raise ValueError(
                f"sinks must be a bool (a learned [num_heads] parameter), got {sinks!r}"
            )
        sink_param = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.register_parameter("sinks", sink_param if sinks else None)
        # QK-norm (Qwen3): RMSNorm over each head's d features of q and k, before RoPE, times
        # norm_offset + weight (the weight starts at 1 - norm_offset: a plain RMSNorm)
        self.norm_eps, self.norm_offset = norm_eps, float(norm_offset)
        self.q_norm = self.k_norm = None
        if qk_norm:
            kw = dict(eps=norm_eps, device=device, dtype=dtype)
            self.q_norm, self.k_norm = nn.RMSNorm(head_dim, **kw), nn.RMSNorm(head_dim, **kw)
            if self.norm_offset:
                for norm in (self.q_norm, self.k_norm):
                    nn.init.constant_(norm.weight, 1.0 - self.norm_offset)

    def extra_repr(self) -> str:
        return (
            f"strategy={self.strategy!r}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, heads_per_stage={self.heads_per_stage}, "
            + ("" if self.window is None else f"window={self.window}, ")
            + ("" if self.sinks is None else "sinks=True, ")
            + f"group_size={torch.distributed.get_world_size(self.group)}"
            + ("" if self.mesh is None else f", ring={self.mesh['ring'].size()}")
        )

    def _validate(self, x, position_ids, cu_seqlens=None):
        """Validates on every rank (the same error everywhere); returns the validated
        document boundaries (a tuple of ints) or None."""
        docs = DocumentsArg(cu_seqlens)

        def local():
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"x must be [batch, local_seq, {self.hidden_size}], got {got}")
            if not isinstance(position_ids, torch.Tensor) or position_ids.shape != x.shape[:2]:
                got = (
                    tuple(position_ids.shape)
                    if isinstance(position_ids, torch.Tensor)
                    else type(position_ids).__name__
                )
                raise ValueError(
                    f"position_ids must be [batch, local_seq] = {tuple(x.shape[:2])}, got {got}"
                )
            if position_ids.dtype.is_floating_point:
                raise ValueError(f"position_ids must be integers, got {position_ids.dtype}")
            if x.dtype != self.q_proj.weight.dtype:
                raise ValueError(
                    f"x has dtype {x.dtype} but the weights have {self.q_proj.weight.dtype}"
                )
            C = torch.distributed.get_world_size(self.group)
            R = 1 if self.mesh is None else self.mesh["ring"].size()
            if self.mesh is None:
                check_layout(self.layout, x.shape[1], C)
            else:
                check_ring_layout(self.layout, C * x.shape[1], R, C)
            docs.check(R * C * x.shape[1])
            check_kernel(self.backend, x.device, x.dtype, self.head_dim)
            check_sinks(self.sinks, self.num_heads, x.device)

        def signature():
            sig = {"x shape": tuple(x.shape), "dtype": str(x.dtype), "backend": self.backend}
            sig["sinks"] = self.sinks is not None
            return {**sig, **docs.signature()}

        group, cohort = self.agree or (self.group, None)
        device = x.device if isinstance(x, torch.Tensor) else None
        agree_across_ranks(group, local, signature, cohort, device)
        return docs.bounds

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """`cu_seqlens`: document boundaries `[0, e_1, ..., S]` of the full sequence (1-D
        integer tensor or ints, the same on every rank and batch row): each token attends
        only within its document (`upipe.attention.documents`); position_ids then usually
        restart per document (`upipe.packing.document_positions`). None: one document."""
        docs = self._validate(x, position_ids, cu_seqlens)
        d = self.head_dim
        cos, sin = rope_cos_sin(
            position_ids,
            d,
            theta=self.rope_theta,
            interleaved=self.rope_interleaved,
            dtype=x.dtype,
            scaling=self.rope_scaling,
        )
        return self._attend(x, cos, sin, docs)

    def _attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs=None
    ) -> torch.Tensor:
        """The layer on validated x `[B, L, D]` with RoPE cos/sin `[B, L, d]` for its tokens
        and validated document boundaries `docs` (a tuple of ints, or None).

        Projection biases, where the projections have them (Hugging Face Qwen2 and
        `attention_bias=True` models, see `upipe.integrations.hf`), are applied too."""
        d = self.head_dim
        if self.rounds is not None:  # upipe's fused op: projections inside the stages
            y = fused_upipe_attention(
                x,
                self.q_proj.weight,
                self.k_proj.weight,
                self.v_proj.weight,
                self.o_proj.weight,
                cos,
                sin,
                rounds=self.rounds,
                head_dim=d,
                group=self.group,
                causal=self.causal,
                backend=self.backend,
                rope_interleaved=self.rope_interleaved,
                q_norm=None if self.q_norm is None else self.q_norm.weight,
                k_norm=None if self.k_norm is None else self.k_norm.weight,
                norm_eps=self.norm_eps,
                norm_offset=self.norm_offset,
                q_bias=self.q_proj.bias,
                k_bias=self.k_proj.bias,
                v_bias=self.v_proj.bias,
                layout=self.layout if self.mesh is None else "contiguous",
                ring_group=self.ring_group,
                ring_layout=self.layout,
                overlap=self.overlap,
                docs=docs,
                window=self.window,
                sinks=self.sinks,
            )
            return y if self.o_proj.bias is None else y + self.o_proj.bias
        B, L, _ = x.shape
        rot = dict(interleaved=self.rope_interleaved)
        q, k = self.q_proj(x).view(B, L, -1, d), self.k_proj(x).view(B, L, -1, d)
        if self.q_norm is not None:
            q, k = self._qk_norm(self.q_norm, q), self._qk_norm(self.k_norm, k)
        q, k = apply_rope(q, cos, sin, **rot), apply_rope(k, cos, sin, **rot)
        v = self.v_proj(x).view(B, L, -1, d)
        kw = dict(causal=self.causal, backend=self.backend, cu_seqlens=docs, window=self.window)
        kw["sinks"] = self.sinks
        if self.mesh is None:
            op = get_strategy(self.strategy).op
            out = op(q, k, v, group=self.group, layout=self.layout, **kw)
        else:  # ulysses on a mesh: USP
            out = usp_attention(q, k, v, mesh=self.mesh, layout=self.layout, **kw)
        return self.o_proj(out.flatten(2))

    def _qk_norm(self, norm, t_BLnd):
        """The QK-norm module's own call, or with `norm_offset` its weight through
        `staged_layer.rms_norm` (as the fused op computes it)."""
        if not self.norm_offset:
            return norm(t_BLnd)
        return rms_norm(t_BLnd, norm.weight, self.norm_eps, self.norm_offset)
