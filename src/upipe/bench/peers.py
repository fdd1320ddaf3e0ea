"""The benchmarked methods behind one small interface: upipe's own strategies and the peers.

Legend: B batch, S full sequence, L = S / C local tokens, H query heads, G kv heads,
n heads of either kind, d head dim, C ranks.

Every method takes the same inputs: q `[B, L, H, d]`, k/v `[B, L, G, d]` (already
projected), this rank's tokens in the method's own sequence layout, which `shard` cuts from
the full `[B, S, n, d]` tensor and `unshard` gathers back in token order (for the check
against the float64 reference). A method is used in four steps:

    reason = method.problem(H=..., G=..., C=..., S=..., device=...)  # parent, before spawning
    method.setup(group, device)                                      # each rank, once
    with method.context():                                           # each fwd+bwd
        method(q_BLHd, k_BLGd, v_BLGd, causal=...).backward(dout_BLHd)

`problem` returns why the method cannot run here (peer not installed, device unsupported,
shape not allowed) as a one-line message, or None: a missing peer is skipped with that
message, never an error. Each peer gets its documented best configuration for the device:
DeepSpeed-Ulysses with SDPA as its local attention (on CPU the same flash kernel upipe uses),
yunchang with flash-attn, torch `context_parallel` with SDPA's fused CUDA kernels.
Peers are imported only inside `setup`, so listing the methods costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util

import torch
import torch.distributed as dist
import torch.nn.functional as F

import upipe
from upipe.attention.registry import STRATEGIES, get_strategy, heads_problem
from upipe.heads import check_heads_per_stage, even_ulysses, kv_problem

# The versions the adapters were tested with (the `bench` extra pins the runnable ones).
TESTED = {"deepspeed": "0.19.8", "yunchang": "0.6.4"}

# Why yunchang cannot run forward+backward on CPU -- verified with yunchang 0.6.4 and torch
# 2.13 (CPU build) on 2 gloo ranks for every AttnType, UlyssesAttention and
# LongContextAttention. Not probed at run time: a half-run ring step would leave its
# point-to-point sends pending and could hang the other methods' collectives.
YUNCHANG_CPU_REASON = (
    "yunchang 0.6.4 has no CPU forward+backward: its fwd-bwd attention for the torch "
    "AttnTypes (ring_pytorch_attn_func) calls aten::_scaled_dot_product_flash_attention "
    "('Could not run ... with arguments from the CPU backend'; efficient likewise), its "
    "math path raises 'Not implemented backward for PyTorch attention types', torch_cudnn "
    "finds 'No viable backend', and fa/fa3/flashinfer/aiter/sage/npu need CUDA or NPU "
    "packages"
)


def installed_version(package: str) -> str | None:
    """The installed distribution's version, or None; does not import the package."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Method:
    """One benchmarked attention; see the module docstring. Picklable (sent to the ranks)."""

    name = "method"
    peer: str | None = None
    """PyPI package of a peer, None for upipe's own."""
    layout = "contiguous"
    """Sequence layout on a 1-D group (see `upipe.shard_sequence`)."""
    inputs = "op"
    """What it takes: "op" (q, k, v; dout) or "layer" (x; dy: `upipe.bench.layer`)."""

    def problem(self, *, H: int, G: int, C: int, S: int, device: str) -> str | None:
        return None

    def version(self) -> str:
        return upipe.__version__ if self.peer is None else (installed_version(self.peer) or "")

    def setup(self, group, device: torch.device) -> None:
        self.group = group

    def shard(self, t_BSnd: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of the full `[B, S, n, d]` tensor, in the method's layout."""
        return upipe.shard_sequence(t_BSnd, group=self.group, layout=self.layout)

    def unshard(self, t_BLnd: torch.Tensor) -> torch.Tensor:
        """Gather every rank's tokens back in token order (not differentiable). Works for
        any `shard`: each rank's token indices are `shard` applied to the positions."""
        C = dist.get_world_size(self.group)
        S = t_BLnd.shape[1] * C
        pos_L = self.shard(torch.arange(S, device=t_BLnd.device).view(1, S, 1, 1)).view(-1)
        parts = [torch.empty_like(t_BLnd) for _ in range(C)]
        poss = [torch.empty_like(pos_L) for _ in range(C)]
        dist.all_gather(parts, t_BLnd.contiguous(), group=self.group)
        dist.all_gather(poss, pos_L, group=self.group)
        full_BSnd = t_BLnd.new_empty(t_BLnd.shape[0], S, *t_BLnd.shape[2:])
        for part, pos in zip(parts, poss, strict=True):
            full_BSnd[:, pos] = part
        return full_BSnd

    def leaves(self, local: list[torch.Tensor]):
        """This rank's inputs as fresh leaves, and the output gradient, from the local cuts
        of the drawn tensors (q, k, v, dout)."""
        *inputs, dout = local
        return [t.clone().requires_grad_() for t in inputs], dout

    def results(self, out: torch.Tensor, leaves) -> list[torch.Tensor]:
        """What is checked against the reference, whole (out, dq, dk, dv in token order)."""
        return [self.unshard(t) for t in (out.detach(), *(x.grad for x in leaves))]

    def context(self):
        return contextlib.nullcontext()

    def __call__(self, q_BLHd, k_BLGd, v_BLGd, *, causal: bool) -> torch.Tensor:
        raise NotImplementedError


def _heads_problem(H, G, C, what):
    """The peers' rule: plain Ulysses' even split, no kv head replicated (DeepSpeed asserts
    G >= its group size)."""
    if not even_ulysses(H, G, C):
        return f"{what} needs H ({H}) and G ({G}) divisible by the ranks ({C})"
    return None


class UpipeMethod(Method):
    """A strategy of upipe's registry by its functional op: ulysses, upipe (U heads per
    stage), ring, usp (on a ring-of-2 x ulysses-C/2 mesh)."""

    def __init__(self, kind: str, U: int | None = None, backend: str | None = None):
        self.kind, self.U, self.spec, self.backend = kind, U, get_strategy(kind), backend
        self.name = f"{kind}(U={U})" if self.spec.heads_per_stage else kind
        self.layout = self.spec.layout

    def problem(self, *, H, G, C, S, device):
        if self.spec.needs_ring_and_ulysses:
            if C < 2 or C % 2:
                return (
                    f"{self.kind} runs on a ring-of-2 x ulysses-C/2 mesh; needs an even C, got {C}"
                )
            C //= 2
        elif self.layout == "zigzag" and S % (2 * C):
            return f"{self.kind} (zigzag) needs S divisible by 2C={2 * C}"
        if kv_problem(H, G):
            return f"{self.name} needs G ({G}) dividing H ({H})"
        if heads_problem(self.spec, H, G, C) is not None:
            return f"{self.name} splits heads: needs at least C={C} query heads, got H={H}"
        if self.spec.heads_per_stage:
            try:
                check_heads_per_stage(H, G, C, self.U)
            except ValueError as e:
                return f"{self.kind}: {e}"
        return None

    def setup(self, group, device):
        super().setup(group, device)
        self.mesh = None
        if self.spec.needs_ring_and_ulysses:  # collective: every rank builds it
            C = torch.distributed.get_world_size(group)
            self.mesh = upipe.make_mesh(ring=2, ulysses=C // 2, device_type=device.type)

    def shard(self, t_BSnd):
        if self.mesh is not None:
            return upipe.shard_sequence(t_BSnd, mesh=self.mesh)
        return super().shard(t_BSnd)

    def unshard(self, t_BLnd):
        if self.mesh is not None:
            return upipe.unshard_sequence(t_BLnd, mesh=self.mesh)
        return upipe.unshard_sequence(t_BLnd, group=self.group, layout=self.layout)

    def __call__(self, q_BLHd, k_BLGd, v_BLGd, *, causal):
        where = {"group": self.group} if self.mesh is None else {"mesh": self.mesh}
        if self.spec.heads_per_stage:
            where["heads_per_stage"] = self.U
        return self.spec.op(q_BLHd, k_BLGd, v_BLGd, causal=causal, backend=self.backend, **where)


def _sdpa_BSnd(q_BShd, k_BSgd, v_BSgd, causal):
    """SDPA on `[B, S, n, d]` tensors (GQA by `enable_gqa`); `[B, S, h, d]` out."""
    out_BhSd = F.scaled_dot_product_attention(
        q_BShd.transpose(1, 2),
        k_BSgd.transpose(1, 2),
        v_BSgd.transpose(1, 2),
        is_causal=causal,
        enable_gqa=q_BShd.shape[2] != k_BSgd.shape[2],
    )
    return out_BhSd.transpose(1, 2)


class _CausalSDPA(torch.nn.Module):
    """DeepSpeed's local attention: SDPA (on CPU the flash kernel, on CUDA flash/efficient)."""

    def __init__(self):
        super().__init__()
        self.causal = True

    def forward(self, q_BShd, k_BSgd, v_BSgd, *args, **kwargs):
        return _sdpa_BSnd(q_BShd, k_BSgd, v_BSgd, self.causal)


class DeepSpeedUlysses(Method):
    """DeepSpeed's `DistributedAttention` (DeepSpeed-Ulysses) around SDPA, contiguous layout.

    For `[B, S, n, d]`: scatter_idx=2 (heads), gather_idx=1 (sequence), batch_dim_idx=0.
    On gloo it needs `deepspeed.init_distributed(dist_backend="gloo")` after torch's own
    init; its first use compiles a small CPU shared-memory extension (minutes, once).
    """

    name = "deepspeed-ulysses"
    peer = "deepspeed"

    def problem(self, *, H, G, C, S, device):
        if installed_version("deepspeed") is None:
            return (
                f"deepspeed is not installed (pip install 'upipe[bench]', which pins "
                f"deepspeed=={TESTED['deepspeed']})"
            )
        return _heads_problem(H, G, C, self.name)

    def setup(self, group, device):
        super().setup(group, device)
        import logging

        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        backend = "nccl" if device.type == "cuda" else "gloo"
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        self.local = _CausalSDPA()
        self.attn = DistributedAttention(self.local, group, scatter_idx=2, gather_idx=1)

    def __call__(self, q_BLHd, k_BLGd, v_BLGd, *, causal):
        self.local.causal = causal
        return self.attn(q_BLHd, k_BLGd, v_BLGd, batch_dim_idx=0)


class YunchangAttention(Method):
    """yunchang's UlyssesAttention ("ulysses") or LongContextAttention ("usp", ring of 2 x
    ulysses C/2) with flash-attn (its documented GPU backend). CUDA only; see
    `YUNCHANG_CPU_REASON`. Not exercised on this project's CPU machines."""

    peer = "yunchang"

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"yunchang-{kind}"

    def problem(self, *, H, G, C, S, device):
        if device != "cuda":
            return YUNCHANG_CPU_REASON
        if installed_version("yunchang") is None:
            return (
                f"yunchang is not installed (pip install yunchang=={TESTED['yunchang']} flash-attn)"
            )
        if installed_version("flash_attn") is None:
            return "yunchang needs flash-attn on CUDA for forward+backward (pip install flash-attn)"
        if self.kind == "usp" and (C < 2 or C % 2):
            return f"yunchang-usp runs on a ring-of-2 x ulysses-C/2 mesh; needs an even C, got {C}"
        return _heads_problem(H, G, C // 2 if self.kind == "usp" else C, self.name)

    def setup(self, group, device):
        super().setup(group, device)
        from yunchang import LongContextAttention, UlyssesAttention, set_seq_parallel_pg
        from yunchang.kernels import AttnType

        C = dist.get_world_size(group)
        ring = 2 if self.kind == "usp" else 1
        set_seq_parallel_pg(C // ring, ring, dist.get_rank(group), C)
        if self.kind == "usp":
            self.attn = LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.FA)
        else:
            self.attn = UlyssesAttention(group, attn_type=AttnType.FA)

    def shard(self, t_BSnd):
        if self.kind != "usp":
            return super().shard(t_BSnd)
        from yunchang import EXTRACT_FUNC_DICT

        C = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        return EXTRACT_FUNC_DICT["zigzag"](t_BSnd, rank, world_size=C, rd=2, ud=C // 2)

    def __call__(self, q_BLHd, k_BLGd, v_BLGd, *, causal):
        return self.attn(q_BLHd, k_BLGd, v_BLGd, causal=causal)


class TorchContextParallel(Method):
    """PyTorch's `context_parallel` (ring attention patched into SDPA, load-balanced layout).

    Its ring handlers cover SDPA's flash/efficient/cudnn ops, which are CUDA-only; on CPU
    SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, which has no DTensor sharding
    rule. Whether it runs is probed on the ranks (`setup` raises with torch's message).
    """

    name = "torch-cp"
    peer = "torch"

    def version(self):
        return torch.__version__

    def problem(self, *, H, G, C, S, device):
        if S % (2 * C):
            return f"torch context_parallel (load-balanced) needs S divisible by 2C={2 * C}"
        return None

    def setup(self, group, device):
        super().setup(group, device)
        from torch.distributed.device_mesh import DeviceMesh

        self.mesh = DeviceMesh.from_group(group, device.type)
        C = dist.get_world_size(group)
        probe = [torch.randn(1, 4 * C, 2, 8, device=device) for _ in range(3)]
        local = [self.shard(t).requires_grad_() for t in probe]
        try:
            with self.context():  # the same error on every rank, before any collective
                self(*local, causal=True).sum().backward()
        except Exception as exc:
            raise RuntimeError(
                f"torch {torch.__version__} context_parallel cannot run SDPA on "
                f"{device.type}: its ring handlers cover SDPA's flash/efficient/cudnn "
                f"kernels only (CUDA); here: {type(exc).__name__}: {exc}"
            ) from exc

    def shard(self, t_BSnd):
        from torch.distributed.tensor.experimental import context_parallel

        buf = t_BSnd.clone()
        with context_parallel(
            self.mesh, buffers=[buf], buffer_seq_dims=[1], no_restore_buffers={buf}
        ):
            pass
        return buf.contiguous()

    def context(self):
        from torch.distributed.tensor.experimental import context_parallel

        # the inputs are already sharded (`shard`); context_parallel insists on a buffer
        dummy = torch.empty(1, 2 * self.mesh.size(), device=self.mesh.device_type)
        return context_parallel(
            self.mesh, buffers=[dummy], buffer_seq_dims=[1], no_restore_buffers={dummy}
        )

    def __call__(self, q_BLHd, k_BLGd, v_BLGd, *, causal):
        return _sdpa_BSnd(q_BLHd, k_BLGd, v_BLGd, causal)


PEERS = ("deepspeed-ulysses", "yunchang-ulysses", "yunchang-usp", "torch-cp")
DEFAULT_METHODS = ("ulysses", "upipe", "upipe:8", "ring", "usp", *PEERS)


def make_method(spec: str, C: int, *, backend: str | None = None) -> Method:
    """A strategy of the registry ('ulysses', 'ring', 'usp'; 'upipe' with U = C heads per
    stage, 'upipe:8' with U = 8) running upipe's local kernel `backend` (`upipe.kernels`),
    or a peer in PEERS."""
    kind, _, u = spec.partition(":")
    entry = STRATEGIES.get(kind)
    if entry is not None and entry.context_parallel:
        if entry.heads_per_stage:
            return UpipeMethod(kind, int(u) if u else C, backend)
        if not u:
            return UpipeMethod(kind, backend=backend)
    if spec == "deepspeed-ulysses":
        return DeepSpeedUlysses()
    if spec in ("yunchang-ulysses", "yunchang-usp"):
        return YunchangAttention(spec.split("-")[1])
    if spec == "torch-cp":
        return TorchContextParallel()
    raise ValueError(
        f"unknown method {spec!r}; choose from ulysses, upipe, upipe:U, ring, usp, "
        f"{', '.join(PEERS)}"
    )
