"""`HFContextParallelDeltaNet`: a Hugging Face Gated DeltaNet layer (the linear attention of
Qwen3-Next and Qwen3.5) run context-parallel by `upipe.attention.deltanet`;
`upipe.integrations.hf` puts one in place of each hybrid decoder layer's `linear_attn`.

Legend: B batch, L local tokens, D model width, H value heads, G key heads, r = H / G,
d key head dim, e value head dim, K conv taps.

It holds the layer's own modules and parameters under their names -- `in_proj_qkvz` and
`in_proj_ba` (Qwen3-Next) or `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`
(Qwen3.5), `conv1d`, `A_log`, `dt_bias`, `norm`, `out_proj` -- so the state-dict keys are
unchanged, and per call sees their weights per head (`weights`):

- Qwen3-Next's in_proj_qkvz `[G (d + d + r e + r e), D]` groups each key head's q, k and its
  r value heads' v, z rows; in_proj_ba `[G (r + r), D]` their b, a. Viewed as `[G, ...]`
  and split, value rows become `[G, r, e, D]` grids (views; a stage copies its own rows).
- Qwen3.5's in_proj_qkv `[G d | G d | H e, D]` in the conv's channel order, and separate
  z, b, a projections: plain views.
- conv1d's taps `[G d | G d | H e, 1, K]` (q, k, v channels, as the model concatenates
  them) and out_proj `[D, H e]` (seen heads first) alike for both.

The scan (`scan_backend`, `upipe.kernels_deltanet`) is by default fla's kernel on CUDA when
installed, else upipe's own chunked rule (`upipe.kernels_delta_rule`); "torch" runs the
model's own torch implementation (`torch_chunk_gated_delta_rule` of the model's module,
unwrapped from transformers' kernel dispatch). Refused (ValueError at conversion):
conv biases, an activation other than SiLU (the variants these models do not have).
"""

from __future__ import annotations

import importlib
import inspect

import torch.distributed as dist
from torch import nn

from upipe.attention.deltanet import (
    STAGE_INPUTS,
    DeltaNetWeights,
    all_heads,
    check_stages,
    gated_deltanet,
)
from upipe.heads import kv_problem

SPLIT_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
FUSED_NAMES = ("in_proj_qkvz", "in_proj_ba")
SCAN_NAME = "torch_chunk_gated_delta_rule"


def torch_scan(hf_module):
    """The plain Python function `torch_chunk_gated_delta_rule` of a Gated DeltaNet model's
    module. transformers wraps it in its kernel dispatch (`functools.wraps`: unwrapped by
    `inspect.unwrap`); from 5.25 that wrapper is also held by a `kernels` hub module, an
    `nn.Module` whose `forward` calls the function it closes over (kernels 0.19,
    `_create_func_module`), which has neither `__wrapped__` nor the function's globals (the
    planner's cut-short scan patches `range` there: `upipe.planner.sampled`)."""
    scan = getattr(hf_module, SCAN_NAME)
    if isinstance(scan, nn.Module):
        cells = type(scan).forward.__closure__ or ()
        found = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
        if len(found) != 1:
            raise RuntimeError(
                f"{hf_module.__name__}.{SCAN_NAME} is a {type(scan).__qualname__} module "
                f"whose forward closes over {len(found)} functions, not 1: this transformers "
                "wraps its scan in a way upipe does not know (tested: 5.24, 5.25)"
            )
        scan = found[0]
    scan = inspect.unwrap(scan)
    if not inspect.isfunction(scan) or scan.__name__ != SCAN_NAME:
        raise RuntimeError(f"{hf_module.__name__}.{SCAN_NAME} unwraps to {scan!r}, not a function")
    return scan


def is_deltanet(module) -> bool:
    """A transformers Gated DeltaNet layer (Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,
    Qwen3_5MoeGatedDeltaNet), by class name."""
    return type(module).__name__.endswith("GatedDeltaNet")


def deltanet_problem(layer) -> str | None:
    """Why `layer` (a Gated DeltaNet) is a variant upipe does not run, or None."""
    name = type(layer).__name__
    if not any(all(hasattr(layer, n) for n in names) for names in (FUSED_NAMES, SPLIT_NAMES)):
        return f"{name}: unknown projections (neither {FUSED_NAMES} nor {SPLIT_NAMES})"
    if layer.conv1d.bias is not None:
        return f"{name} with a conv1d bias is not supported (these models have none)"
    if layer.activation not in ("silu", "swish"):
        return (
            f"{name} with activation {layer.activation!r} is not supported: the convolution's "
            "activation is SiLU in these models"
        )
    problem = kv_problem(layer.num_v_heads, layer.num_k_heads, query="value heads", kv="key heads")
    return f"{name}: {problem}" if problem else None


class HFContextParallelDeltaNet(nn.Module):
    """A Hugging Face Gated DeltaNet layer on this rank's tokens (module doc); called as the
    decoder layer calls `linear_attn`: `forward(hidden_states [B, L, D], ...)` -> `[B, L, D]`.
    `strategy`: "upipe" (`heads_per_stage` value heads per stage; `keyword`: its name in
    error messages; `stage_inputs`: `upipe.attention.deltanet.STAGE_INPUTS`) or "ulysses"."""

    def __init__(self, hf_layer, *, group, strategy, heads_per_stage, state,
                 keyword="heads_per_stage", stage_inputs="recompute"):  # fmt: skip
        super().__init__()
        if stage_inputs not in STAGE_INPUTS:
            raise ValueError(
                f"linear_stage_inputs must be one of {STAGE_INPUTS}, got {stage_inputs!r}"
            )
        problem = deltanet_problem(hf_layer)
        if problem:
            raise ValueError(problem)
        self.fused = hasattr(hf_layer, "in_proj_qkvz")
        # the layer's own parameters and modules, by name and in its order (state dict)
        for name, p in hf_layer.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, child in hf_layer.named_children():
            self.add_module(name, child)
        self.layer_idx = hf_layer.layer_idx
        self.H, self.G = hf_layer.num_v_heads, hf_layer.num_k_heads
        self.d, self.e = hf_layer.head_k_dim, hf_layer.head_v_dim
        C = dist.get_world_size(group)
        U = all_heads(self.H, C) if strategy == "ulysses" else heads_per_stage
        check_stages(self.H, self.G, C, U, keyword)
        self.group, self.strategy, self.heads_per_stage = group, strategy, heads_per_stage
        self.stage_inputs = stage_inputs
        self.scan_backend = None  # auto: fla on CUDA where installed, else "upipe"
        hf_module = importlib.import_module(type(hf_layer).__module__)
        self.reference = torch_scan(hf_module)
        self._state = state  # the model call's validated documents (set by the input hook)

    def extra_repr(self) -> str:
        return (
            f"strategy={self.strategy!r}, value_heads={self.H}, key_heads={self.G}, "
            f"heads_per_stage={self.heads_per_stage}, stage_inputs={self.stage_inputs!r}, "
            f"group_size={dist.get_world_size(self.group)}"
        )

    def weights(self) -> DeltaNetWeights:
        """The parameters seen per head (module doc); views of the model's."""
        H, G, d, e, r = self.H, self.G, self.d, self.e, self.H // self.G
        D = self.out_proj.weight.shape[0]
        if self.fused:
            qkvz = self.in_proj_qkvz.weight.view(G, 2 * d + 2 * r * e, D)
            q, k, v, z = qkvz.split([d, d, r * e, r * e], dim=1)
            v, z = v.unflatten(1, (r, e)), z.unflatten(1, (r, e))
            b, a = (t.unsqueeze(2) for t in self.in_proj_ba.weight.view(G, 2 * r, D).split(r, 1))
        else:
            q, k, v = self.in_proj_qkv.weight.split([G * d, G * d, H * e])
            q, k, v = q.view(G, d, D), k.view(G, d, D), v.view(H, e, D)
            z = self.in_proj_z.weight.view(H, e, D)
            b, a = self.in_proj_b.weight.view(H, 1, D), self.in_proj_a.weight.view(H, 1, D)
        taps = self.conv1d.weight.squeeze(1)
        cq, ck, cv = taps.split([G * d, G * d, H * e])
        return DeltaNetWeights(
            q=q, k=k, v=v, z=z, b=b, a=a,
            conv_q=cq.view(G, d, -1), conv_k=ck.view(G, d, -1), conv_v=cv.view(H, e, -1),
            A_log=self.A_log, dt_bias=self.dt_bias, norm=self.norm.weight,
            out=self.out_proj.weight.view(D, H, e).permute(1, 2, 0),
        )  # fmt: skip

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        # attention_mask: None here (the input hook rejects padding); cache: rejected too;
        # documents: validated by the input hook, which keeps them in the state
        return gated_deltanet(
            hidden_states,
            self.weights(),
            group=self.group,
            reference=self.reference,
            strategy=self.strategy,
            heads_per_stage=self.heads_per_stage,
            cu_seqlens=self._state["docs"],
            backend=self.scan_backend,
            eps=self.norm.variance_epsilon,
            stage_inputs=self.stage_inputs,
        )
