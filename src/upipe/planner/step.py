"""One rank's training step under fake tensors: the memory of `upipe train` without the GPUs.

`StepSimulator(cfg, world)` builds rank 0 of a `world`-rank job with the very code of
`upipe train` (`upipe.train.Trainer`: device mesh, model, parallelize step, memory features,
FSDP2, AdamW) inside `FakeTensorMode` on the fake process-group backend
(`upipe.memory.simulate`), then `step(seq_len)` runs one training step -- forward, backward,
optimizer -- and measures that rank's memory the way `Trainer.step` does on CPU: persistent
bytes (parameters, optimizer states) plus the step's peak of live storages. Nothing is
allocated and nothing is computed; a step costs about 0.1 ms per operator, and the loops
whose iterations repeat the same memory (sequence tiles, ring steps) are cut short
(`upipe.planner.sampled`), so a step costs the same at any length and ring size and gives
the worst rank's peak.

The simulator is `JobSimulator` (fake process group, fake tensors, loops cut short, depth
extrapolated), stepping a `SimulatedJob` -- one rank's model, optimizer and tracker with
`set_length`, `forward_backward` and `optimizer_step` -- through `measure_step`. Two jobs
implement it: `TrainerJob` (`upipe train`'s `Trainer`, built by `StepSimulator`) and
`upipe.planner.hf.HFJob` (a Hugging Face model converted by `apply_context_parallel`, built by
`HFStepSimulator`: `upipe plan --hf-config`).

What the simulation replaces, and why it does not change the memory:
- The device is a fake *CPU* (fake CUDA tensors crash the backward on a CPU-only build).
  Memory is counted per storage, so the device type does not matter -- except that the CPU
  attention kernel stands in for the CUDA one: the CPU flash kernel and flash-attn both take
  GQA natively and return an fp32 log-sum-exp, so their buffers agree.
- Activation offload keeps the checkpointed block inputs on the *meta* device: the
  offloader's host arena (`upipe.model.offload`, allocated at its exact size on CUDA too) is
  counted apart as host bytes (`host_peak_bytes`), the rest is device memory.
- FSDP2's CPU offload (`--fsdp-offload`) keeps its tensors on the fake CPU like everything
  else -- FSDP2 requires offloaded shards on a "cpu" device, and the optimizer needs
  parameters, gradients and states on one device -- and the tracker counts them as host
  memory (`StepTracker.to_host`, `StepTracker.on_host`): the sharded parameters from the
  start, the AdamW states and everything else the optimizer phase allocates (clipping and
  AdamW run on the host), and each gradient shard from its device-to-host copy on. The two
  copies CUDA makes and the CPU does not (there `.to(device)` and `.to("cpu")` return the
  tensor itself) are made here: each shard's host-to-device copy before its unit's
  all-gather (`_h2d_all_gather_inputs`, in `_kernels("cuda")`), and each reduce-scattered
  gradient shard's copy to the host, after which the device's reduce-scatter output is freed
  (`_grad_to_host`, a post-accumulate-grad hook, which FSDP2 calls right after it sets the
  gradient). Pinned host buffers are counted at their size (CUDA's caching host allocator
  rounds each up to a power of two: up to 2x for some shards, not counted).
- Data-dependent scalars have no value under fake tensors; `StepTracker` answers them:
  `.item()` gives 1 (the loss printed, the token count checked > 0, AdamW's step count in
  its bias correction: none of them shapes a tensor). The step has no other
  data-dependent operator (the chunked loss needs no `nonzero`).
- RMSNorm runs as CUDA's fused kernel would (`kernels="cuda"`, the default): the CPU build's
  composite `F.rms_norm` makes and saves fp32 copies of its input, CUDA's `_fused_rms_norm`
  saves only x and the per-row rstd (for the model's norms and the QK-norm inside the
  fused UPipe op alike). The fused UPipe op's fp32 accumulations (y's row chunks, dx)
  likewise: on CUDA an out_dtype GEMM adds into the fp32 buffer in place
  (`upipe.gemm.addmm_acc_`), the CPU path first makes an fp32 copy of each operand.
  Likewise the attention backward is charged the in-kernel buffers of the CUDA kernel
  planned for (`attention_kernel`; flash-attn 2's by default: an fp32 dq accumulator, and
  for GQA dk/dv expanded to the query heads; see `StepTracker`), which the CPU kernel does
  not allocate. Smaller workspaces (cuBLAS, the forward's) are left to the planner's
  reserve.
- The batch is synthetic (ids, labels and positions `[B, L]` int64, as on the device).
- The optimizer states (and FSDP2's unsharded parameter storages) are made by a warm-up
  without a step (`_warm_up`; the Hugging Face path: one unmeasured step), so the measured
  step is a steady-state step (states persistent, gradients set to None).
- On CUDA, AdamW defaults to its foreach implementation, which briefly holds one extra
  state-sized temporary during the optimizer step; the fake CPU runs the per-parameter loop.
  The optimizer phase is reported apart (`phase_bytes`) so this can be judged: at long
  sequences the backward, not the optimizer step, sets the peak.

Legend: B batch, S sequence, L = S / C tokens per rank, C context-parallel size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import weakref
from unittest import mock

import torch

from upipe.kernels_cuda import backward_workspace_bytes
from upipe.memory.simulate import fake_process_group
from upipe.memory.tracker import _DEVICE, MemoryTracker, _plain_tensors
from upipe.mesh import make_mesh
from upipe.model import CausalLM, get_config
from upipe.planner.deltanet import fla_kernels
from upipe.planner.sampled import sampled_loops
from upipe.torch_private import (
    FakeTensor,
    FakeTensorMode,
    FSDPParam,
    ShardedState,
    current_graph_task_id,
    flatten_mesh,
    unset_fake_temporarily,
)
from upipe.train.config import DTYPES, validate
from upipe.train.loop import Trainer
from upipe.train.parallelize import make_offloader

HOST_DEVICE = "meta"  # where simulated offload copies live (counted as host memory)
_ITEM = torch.ops.aten._local_scalar_dense.default
_LIFT = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


class _FusedRMSNorm(torch.autograd.Function):
    """The memory of CUDA's fused RMSNorm (`aten._fused_rms_norm`, which `F.rms_norm` runs on
    CUDA): forward saves x and the fp32 rstd (one per normalized row); backward makes dx
    and dweight. (The CPU build runs the composite, which makes and saves fp32 copies of
    x.) Values are not computed."""

    @staticmethod
    def forward(ctx, x, weight, n_dims):
        rstd = x.new_empty((*x.shape[: x.dim() - n_dims], *[1] * n_dims), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None


def _cuda_rms_norm(input, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(input, weight, len(normalized_shape))


def _cuda_addmm_acc_(acc, a, b, *, tensor_cores):
    """The memory of `upipe.gemm.addmm_acc_` on CUDA: the out_dtype GEMM adds a @ b into the
    fp32 accumulator in place, with no fp32 copy of the operands (which the CPU path
    makes). Values are not computed."""
    return acc


def _kernels(kind: str):
    """With kind "cuda", within the block: `F.rms_norm` -- the model's norms and the fused
    UPipe op's QK-norm -- has the memory of CUDA's fused kernel (`_FusedRMSNorm`), and the
    fused UPipe op's fp32 accumulations that of CUDA's out_dtype GEMM (`_cuda_addmm_acc_`),
    FSDP2's offloaded shards are copied to the device before their all-gather
    (`_h2d_all_gather_inputs`), and the Gated DeltaNet layers scan with fla's kernel
    (`upipe.planner.deltanet.fla_kernels`)."""
    stack = contextlib.ExitStack()
    if kind == "cuda":
        stack.enter_context(fla_kernels())
        stack.enter_context(mock.patch.object(torch.nn.functional, "rms_norm", _cuda_rms_norm))
        stack.enter_context(mock.patch("upipe.attention.staged_layer.addmm_acc_", _cuda_addmm_acc_))
        inputs = property(_h2d_all_gather_inputs)
        stack.enter_context(mock.patch.object(FSDPParam, "all_gather_inputs", inputs))
    return stack


_ALL_GATHER_INPUTS = FSDPParam.all_gather_inputs.fget


def _h2d_all_gather_inputs(fsdp_param) -> list[torch.Tensor]:
    """`FSDPParam.all_gather_inputs` with the memory it has on CUDA under CPUOffloadPolicy:
    the host shard is first copied to the device (`.to(device, non_blocking=True)`, which
    returns the shard itself on the CPU), then cast to the compute dtype if that differs;
    the copy lives until the all-gather has read it."""
    if not fsdp_param.offload_to_cpu or fsdp_param.sharded_state != ShardedState.SHARDED:
        return _ALL_GATHER_INPUTS(fsdp_param)
    host = fsdp_param._sharded_param_data
    fsdp_param._sharded_param_data = host.clone()  # the device copy
    try:
        return _ALL_GATHER_INPUTS(fsdp_param)
    finally:
        fsdp_param._sharded_param_data = host


def _offload_fsdp_state(master, mem: StepTracker) -> None:
    """Count FSDP2's offloaded state of `master` (the module the optimizer updates) as host
    memory as it is on CUDA (module doc): the sharded parameters from now on, each gradient
    shard from its copy to the host on, and whatever the optimizer phase allocates (AdamW's
    states, clipping's norms)."""
    params = list(master.parameters())
    mem.to_host([p.to_local() for p in params])
    for p in params:
        p.register_post_accumulate_grad_hook(functools.partial(_grad_to_host, mem))
    mem.optimizer_on_host = True


def _grad_to_host(mem: StepTracker, p: torch.Tensor) -> None:
    """FSDP2's device-to-host copy of `p`'s new gradient shard (on CUDA a copy of a view of
    the reduce-scatter output, which is freed once each of its unit's shards is copied; on
    the CPU the view itself): a host copy replaces it. A gradient accumulated into (a later
    micro-batch) is on the host already."""
    from torch.distributed.tensor import DTensor

    grad = p.grad
    if mem.is_host(grad.to_local()):
        return
    with mem.on_host():
        local = grad.to_local().clone()
    p.grad = DTensor.from_local(
        local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
    )


def _no_init():
    """Within the block `CausalLM.init_weights` does nothing: fake parameters hold no values,
    and its host buffers (one full fp32 matrix at a time) are gone before the step. (It would
    also need the FSDP mesh's coordinate, which torch caches from the first of several
    process groups created in one process, as the tests do when simulating several ranks.)"""
    return mock.patch.object(CausalLM, "init_weights", lambda self, seed: None)


class StepTracker(MemoryTracker):
    """`MemoryTracker` that keeps host bytes (storages on `HOST_DEVICE`) apart from device
    bytes, records the device peak per phase ("forward"; "backward", from the first
    allocation inside the autograd engine on, recomputation and the gradient all-reduce after
    it included; "optimizer", set by the caller), and with `explain` keeps the largest live
    storages at the device peak.

    `cuda_workspaces`: also count, while the attention backward kernel runs, the buffers that
    the CUDA kernel `attention_kernel` allocates inside it (on top of dq, dk, dv;
    `upipe.kernels_cuda.backward_workspace_bytes`) -- for flash-attn 2 (flash, and auto) the
    fp32 dq accumulator, q-shaped `[B, Sq, h, d]` (4 bytes per element), and for GQA dk and
    dv expanded to the query heads before they are summed (2 x `[B, Sk, h, d]` in k's
    dtype). The CPU kernel that runs here has none of them, but on a GPU they are real
    memory at long context.

    Host memory: storages on `HOST_DEVICE`, those passed to `to_host`, and those allocated
    inside `on_host()` (with `optimizer_on_host`, `_measure` runs the optimizer phase there).

    `fake`: the step runs under `FakeTensorMode`; the tracker then also answers the
    data-dependent operators (see the module doc) and runs operators on real tensors only
    (the device mesh's rank tables) for real, uncounted. (One dispatch mode doing both costs
    less than two: the per-operator Python overhead is what a simulated step spends.)
    """

    _ATTN_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def __init__(
        self,
        *,
        explain: bool = False,
        cuda_workspaces: bool = False,
        fake: bool = False,
        attention_kernel: str = "auto",
    ):
        super().__init__()
        self.cuda_workspaces, self.fake = cuda_workspaces, fake
        self.attention_kernel = attention_kernel
        self.phase = "forward"
        self.phase_peak_bytes: dict[str, int] = {}
        self.host_bytes = self.host_peak_bytes = 0
        self._host: dict[int, int] = {}
        self._on_host = False
        self.optimizer_on_host = False
        self._op = None
        # with explain: what made each storage (op, shape, dtype), and the storages live at
        # the device peak with what made them, formatted and sorted only when asked
        # (`at_peak`: the peak is raised many times in a step)
        self._what: dict[int, tuple] | None = {} if explain else None
        self._peak_live: list[tuple[int, tuple | str | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE or (func.is_view and (not self.fake or isinstance(args[0], FakeTensor))):
            return func(*args, **kwargs)  # allocates nothing (views of real tensors: below)
        inputs = _plain_tensors((args, kwargs))
        if self.fake:  # under FakeTensorMode
            fake = any(isinstance(t, FakeTensor) for t in inputs)
            if fake and func is _ITEM:  # data-dependent scalars (see the module doc)
                return True if args[0].dtype == torch.bool else 1
            if inputs and not fake and func not in _LIFT:  # real: the mesh's rank tables
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
        self._op = func
        out = self._run(func, args, kwargs, inputs)
        if self.cuda_workspaces and func is self._ATTN_BWD:
            _, q, k = args[:3]  # [B, h, Sq, d] / [B, hk, Sk, d]
            (B, h, Sq, d), (hk, Sk) = q.shape, k.shape[1:3]
            shape = (B, Sq, Sk, h, hk, d, k.element_size())
            self._transient(backward_workspace_bytes(self.attention_kernel, *shape))
        return out

    def _transient(self, nbytes: int) -> None:
        """A buffer of `nbytes` that lives only inside the op just run (a kernel workspace)."""
        self.current_bytes += nbytes
        kernel = {"cudnn": "cuDNN", "fa3": "FA3", "fa4": "FA4"}.get(self.attention_kernel)
        self._grew((nbytes, f"{kernel or 'flash-attn'} backward workspace"))
        self.current_bytes -= nbytes

    def _grew(self, transient: tuple[int, str] | None = None) -> None:
        """The device peak, per phase, and with `explain` what is live at the overall peak
        (`transient`: a workspace counted in `current_bytes` but not among the storages)."""
        phase = self.phase
        if phase == "forward" and current_graph_task_id() != -1:
            phase = self.phase = "backward"  # and after it: gradient all-reduce
        if self.current_bytes > self.phase_peak_bytes.get(phase, -1):
            self.phase_peak_bytes[phase] = self.current_bytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            if self._what is not None:
                what = self._what
                self._peak_live = [(n, what.get(k)) for k, n in self._live.items()]
                if transient:
                    self._peak_live.append(transient)

    @property
    def at_peak(self) -> list[tuple[int, str]]:
        """With explain: the storages live at the device peak, largest first, as (bytes,
        "op [shape] dtype" of the op that made it, or "(kept from before the step)")."""
        return sorted(((n, _describe(what)) for n, what in self._peak_live), reverse=True)

    def _free_host(self, key: int) -> None:
        self.host_bytes -= self._host.pop(key, 0)

    def _add_host(self, storage) -> None:
        key = storage._cdata
        self._host[key] = storage.nbytes()
        weakref.finalize(storage, self._free_host, key)
        self.host_bytes += self._host[key]
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def to_host(self, tensors) -> None:
        """Count the storages of `tensors` (counted as device memory so far) as host memory
        from now on."""
        for t in tensors:
            storage = t.untyped_storage()
            self.current_bytes -= self._live.pop(storage._cdata, 0)
            self._add_host(storage)

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._host

    @contextlib.contextmanager
    def on_host(self, on: bool = True):
        """Within the block (if `on`), what is allocated is host memory."""
        before, self._on_host = self._on_host, on or self._on_host
        try:
            yield
        finally:
            self._on_host = before

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live or key in self._host:
            return
        if self._on_host or t.device.type == HOST_DEVICE:
            self._add_host(storage)
            return
        if self._what is not None:
            self._what[key] = (self._op, t.shape, t.dtype)
        self._count(t)  # (the device is known: no second `t.device`, a dispatch here)


def _describe(what: tuple | str | None) -> str:
    """A storage of `StepTracker.at_peak`: "op [shape] dtype" from (op, shape, dtype), a
    workspace's own text, or None: allocated before the step."""
    if what is None:
        return "(kept from before the step)"
    if isinstance(what, str):
        return what
    op, shape, dtype = what
    return f"{op} {list(shape)} {str(dtype)[6:]}"


@dataclasses.dataclass(kw_only=True)
class StepMemory:
    """Memory of one training step on one rank (bytes)."""

    seq_len: int
    """Tokens per sequence (all ranks together)."""
    peak_bytes: int
    """Device peak of all live storages over the step (persistent ones included)."""
    persistent_bytes: int
    """Live before the step: parameters, optimizer states (this rank's shards under FSDP)
    and any buffer kept between steps."""
    host_peak_bytes: int
    """Peak of host memory: the offloaded block inputs, and with fsdp_offload the sharded
    parameters, gradients and optimizer states (and the optimizer's temporaries)."""
    phase_bytes: dict[str, int]
    """The device peak reached in each phase (forward, backward, optimizer)."""
    at_peak: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    """With explain: the storages live at the device peak, largest first (bytes, the op
    that made it, shape, dtype), if it was allocated during the step."""


class SimulatedJob:
    """One rank's training job as a simulated step runs it (`measure_step`): what the own
    trainer's path (`TrainerJob`) and the Hugging Face path (`upipe.planner.hf.HFJob`) both
    provide, so that one simulator -- fake process group, fake tensors, loops cut short,
    depth extrapolated -- steps either.

    `tracker`: the `StepTracker` that has counted everything the job allocated since it was
    built (parameters, optimizer states, buffers kept between steps)."""

    tracker: StepTracker

    def set_length(self, seq_len: int) -> None:
        """Make the next step one of `seq_len` tokens per sequence (all ranks together)."""
        raise NotImplementedError

    def forward_backward(self) -> None:
        """Forward and backward of one batch: the gradients are in the parameters' .grad."""
        raise NotImplementedError

    def optimizer_step(self) -> None:
        """Clip the gradients, step the optimizer, free the gradients."""
        raise NotImplementedError


class TrainerJob(SimulatedJob):
    """`upipe train`'s `Trainer` as a `SimulatedJob`: synthetic batches
    (`_synthetic_batch`), its own forward_backward and optimizer_step."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.tracker = trainer, trainer.tracker

    def set_length(self, seq_len: int) -> None:
        trainer = self.trainer
        trainer.cfg = dataclasses.replace(trainer.cfg, seq_len=seq_len)
        if trainer.model.offload is not None:
            # a fresh arena: the previous length's must not count as host memory held before
            # the step (a real run frees the old arena before allocating the new one)
            n_layers = len(trainer.model.model.layers)
            trainer.model.offload = make_offloader(n_layers, trainer.cfg.features(), HOST_DEVICE)

    def forward_backward(self) -> None:
        self.trainer.forward_backward(0)

    def optimizer_step(self) -> None:
        self.trainer.optimizer_step()


class JobSimulator:
    """Rank `rank` (default 0) of `world` ranks running a job of a model of `n_layers`
    blocks, built once per simulated depth (`_build`, by the subclass) and stepped at any
    sequence length. Use as a context manager: it holds the process's default (fake) process
    group while open. `StepSimulator` (the own trainer) and `upipe.planner.hf.HFStepSimulator`
    (a Hugging Face model) are its two kinds; `kernels`, `attention_kernel`, `depths`,
    `sample_loops` as in `StepSimulator`."""

    def __init__(
        self,
        world: int,
        n_layers: int,
        *,
        kernels: str = "cuda",
        attention_kernel: str = "auto",
        depths=None,
        sample_loops: bool = True,
        rank: int = 0,
    ):
        if kernels not in ("cuda", "cpu"):
            raise ValueError(f"kernels must be 'cuda' or 'cpu', got {kernels!r}")
        self.world, self.kernels, self.attn = world, kernels, attention_kernel
        self.sample_loops, self.rank, self.n_layers = sample_loops, rank, n_layers
        self.depths = (
            tuple(sorted(set(depths))) if depths and max(depths) < n_layers else (n_layers,)
        )
        if len(self.depths) not in (1, 2) or min(self.depths) < 1:
            raise ValueError(f"depths must be two layer counts >= 1, got {depths}")
        self._stack = contextlib.ExitStack()
        self.jobs: dict[int, SimulatedJob] = {}

    # what a subclass provides
    def _mesh(self):
        """The job's device mesh (built outside fake mode: its rank tables are real)."""
        raise NotImplementedError

    def _build(self, mesh, n_layers: int) -> SimulatedJob:
        """The job with `n_layers` blocks, its tracker counting from the start, warmed up."""
        raise NotImplementedError

    def _problem(self, seq_len: int) -> str | None:
        """Why the job cannot run `seq_len` tokens per sequence, or None."""
        raise NotImplementedError

    def __enter__(self):
        stack = self._stack
        try:
            stack.enter_context(fake_process_group(self.world, rank=self.rank))
            mesh = self._mesh()
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            for n in self.depths:
                self.jobs[n] = self._build(mesh, n)
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc):
        self.jobs = {}
        self._stack.close()

    def _shortest(self) -> int:
        """The shortest valid sequence length (the Hugging Face path's warm-up step's)."""
        for seq_len in range(2 * self.world, 10**6, 2 * self.world):
            if self._problem(seq_len) is None:
                return seq_len
        raise ValueError(f"no valid sequence length on {self.world} ranks")

    def step(
        self, seq_len: int, *, explain: bool = False, depth: int | None = None, sample_loops=None
    ) -> StepMemory:
        """Memory of one training step at `seq_len` tokens per sequence. `depth`: step only
        the job of that many blocks (one of `depths`) and return its own memory, not
        extrapolated; `sample_loops`: this step's choice instead of the simulator's (the
        counts of `upipe.planner.timing` need the full loops)."""
        problem = self._problem(seq_len)
        if problem:
            raise ValueError(problem)
        if depth is not None and depth not in self.jobs:
            raise ValueError(f"depth {depth} is not simulated here: one of {self.depths}")
        sample = self.sample_loops if sample_loops is None else sample_loops
        with sampled_loops() if sample else contextlib.nullcontext(), _kernels(self.kernels):
            depths = self.depths if depth is None else (depth,)
            runs = [measure_step(self.jobs[n], seq_len, explain) for n in depths]
        if len(runs) == 1:
            return runs[0]
        (n0, n1), N = self.depths, self.n_layers

        def at_depth(a: int, b: int) -> int:
            return b + (b - a) * (N - n1) // (n1 - n0)

        phases = {
            k: at_depth(runs[0].phase_bytes.get(k, 0), v) for k, v in runs[1].phase_bytes.items()
        }
        return StepMemory(
            seq_len=seq_len,
            peak_bytes=max(phases.values()),
            persistent_bytes=at_depth(runs[0].persistent_bytes, runs[1].persistent_bytes),
            host_peak_bytes=at_depth(runs[0].host_peak_bytes, runs[1].host_peak_bytes),
            phase_bytes=phases,
            at_peak=runs[1].at_peak,
        )


class StepSimulator(JobSimulator):
    """Rank `rank` (default 0) of `world` ranks running `cfg` (a `TrainConfig`; its seq_len
    is replaced by `step`'s), built once and stepped at any sequence length. Use as a
    context manager: it holds the process's default (fake) process group while open.

    Ranks differ in the ring attention's off-diagonal blocks (which halves of the queries
    and keys meet, `upipe.attention.ring`) and, when parameters do not divide evenly, in
    FSDP's shards (the first ranks' the larger). With `sample_loops` (the default) the
    simulated rank runs every rank's off-diagonal blocks, so rank 0's peak is the worst
    rank's (`tests/runs/test_plan.py` compares it with every rank's full step).

    `depths`: simulate models of these numbers of layers and extrapolate linearly to the
    model's depth, phase by phase (default: the full depth, no extrapolation). All blocks are
    identical, so in each phase every term of the live memory -- saved activations,
    parameter, gradient and optimizer-state shards, offloaded inputs -- is a per-block amount
    times the number of blocks plus a constant, and two depths fix both; the overall peak
    is the largest phase. `tests/runs/test_plan.py` checks it against full-depth runs.
    """

    def __init__(
        self,
        cfg,
        world: int,
        model=None,
        *,
        kernels: str = "cuda",
        attention_kernel: str = "auto",
        depths=None,
        sample_loops: bool = True,
        rank: int = 0,
    ):
        """`model`: a `ModelConfig` to build instead of the preset `cfg.model`. `kernels`:
        "cuda" gives kernels whose CPU version allocates differently their CUDA footprint
        (RMSNorm, flash-attn's backward, the out_dtype GEMM) and offloads the block inputs
        to the host (with the offload feature); "cpu" runs the CPU build's kernels and keeps
        the block inputs where they are, as `upipe train` does on CPU.
        `sample_loops`: take the shortcut of `upipe.planner.sampled` through the loops whose
        iterations repeat the same memory (two tiles per tile loop; the ring's diagonal
        block, then every rank's off-diagonal blocks twice): the worst rank's peak, at a
        cost independent of the sequence length and the ring size. False runs this rank's
        loops in full. `attention_kernel`: the CUDA attention kernel whose backward workspace
        is charged with kernels "cuda" (`StepTracker`); the step itself runs the CPU kernel."""
        self.cfg = cfg
        self.model_config = model or get_config(cfg.model)
        super().__init__(
            world,
            self.model_config.n_layers,
            kernels=kernels,
            attention_kernel=attention_kernel,
            depths=depths,
            sample_loops=sample_loops,
            rank=rank,
        )
        problem = validate(cfg, world, self.model_config)
        if problem:
            raise ValueError(problem)
        self.dtype = DTYPES[cfg.dtype]
        self.trainers: dict[int, Trainer] = {}

    def _mesh(self):
        dp, ring, uly = self.cfg.degrees(self.world)
        mesh = make_mesh(ulysses=uly, ring=ring, dp=dp)
        if self.cfg.fsdp and mesh.ndim > 1:
            flatten_mesh(
                mesh, "fsdp"
            )  # (apply_fsdp's flattened mesh, made here for the same reason)
        return mesh

    def _build(self, mesh, n_layers: int) -> SimulatedJob:
        """A Trainer of `n_layers` blocks with its own tracker, warmed up (`_warm_up`)."""
        cfg = dataclasses.replace(self.cfg, data=__file__)  # never read: synthetic batches
        model_config = dataclasses.replace(self.model_config, n_layers=n_layers)
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # fake parameters cannot be cast: make them so
        # counts everything this trainer ever allocates
        workspaces = dict(cuda_workspaces=self.kernels == "cuda", attention_kernel=self.attn)
        mem = StepTracker(fake=True, **workspaces)
        try:
            with mem, _no_init():
                trainer = Trainer(cfg, torch.device("cpu"), mesh=mesh, model_config=model_config)
        finally:
            torch.set_default_dtype(default)
        trainer.tracker = mem
        if cfg.fsdp_offload and self.kernels == "cuda":  # (on the CPU all of it is the host)
            _offload_fsdp_state(trainer.master, mem)
        if cfg.offload and self.kernels == "cuda":  # upipe train offloads only from CUDA
            trainer.model.offload = make_offloader(n_layers, cfg.features(), HOST_DEVICE)
        trainer.batch = types.MethodType(_synthetic_batch, trainer)
        self.trainers[n_layers] = trainer
        job = TrainerJob(trainer)
        with _kernels(self.kernels):
            _warm_up(trainer)
        return job

    def _problem(self, seq_len: int) -> str | None:
        return validate(
            dataclasses.replace(self.cfg, seq_len=seq_len), self.world, self.model_config
        )

    def __exit__(self, *exc):
        self.trainers = {}
        super().__exit__(*exc)


def _warm_up(trainer) -> None:
    """Bring a freshly built `trainer` (with its `tracker`) to the state a measured step
    starts from after earlier steps, without a step: what a step leaves behind is AdamW's
    states (made by its first update) and FSDP2's unsharded parameter storages (allocated at
    a unit's first all-gather, then kept at size 0 between all-gathers); everything else a
    step allocates is freed by its end. So: each FSDP2 unit unshards and reshards (its
    storages made, then emptied, as after a step), every master parameter gets a zero
    gradient and the optimizer steps (its states made, on the host with --fsdp-offload,
    as `measure_step`'s optimizer phase), and the update drops the gradients as it does
    after every step. Values do not matter (nothing is computed). A whole unmeasured step
    at the shortest length did the same at the cost of a step per simulated depth;
    `tests/runs/test_plan_speed.py` checks that a measured step after this equals one after
    such a step, every field of `StepMemory`, for every strategy and memory feature set."""
    from torch.distributed.fsdp import FSDPModule

    mem = trainer.tracker
    with mem:
        for unit in trainer.model.modules():
            if isinstance(unit, FSDPModule):
                unit.unshard()
                unit.reshard()
        for p in trainer.master.parameters():
            p.grad = torch.zeros_like(p)
        with mem.on_host(mem.optimizer_on_host):
            trainer.optimizer_step()


def _synthetic_batch(trainer, index: int, *, held_out: bool = False) -> list[tuple]:
    """`Trainer.batch` as one model call: (input_ids, labels, position_ids) `[B, L]` of
    `trainer.cfg.seq_len` (padded as the trainer pads it), as on a device, and no document
    boundaries: the plan is that of sequences of one document each. (With documents the
    trainer runs the B rows one at a time, which holds less; on CUDA the documents of a
    stage are one varlen kernel call, no larger than the dense one.)"""
    B, S = trainer.cfg.batch_size, trainer.cfg.seq_len
    pos_L = trainer.cp.positions(trainer.padded(S))
    ids = torch.zeros(B, pos_L.numel(), dtype=torch.int64)
    return [(ids, torch.zeros_like(ids), pos_L.expand(B, -1).contiguous(), None)]


def _measure(trainer, seq_len: int, explain: bool = False) -> StepMemory:
    """`measure_step` of a `Trainer` (with a `tracker`)."""
    return measure_step(TrainerJob(trainer), seq_len, explain)


def measure_step(job: SimulatedJob, seq_len: int, explain: bool = False) -> StepMemory:
    """One step of `job` at `seq_len`: the peak of every live storage it allocated
    (parameters, optimizer states, any buffer kept between steps, and the step's own)."""
    job.set_length(seq_len)
    mem = job.tracker
    persistent = mem.current_bytes
    mem.peak_bytes, mem.phase_peak_bytes, mem.host_peak_bytes = persistent, {}, mem.host_bytes
    mem.phase, mem._what, mem._peak_live = "forward", ({} if explain else None), []
    with mem:
        job.forward_backward()
        mem.phase = "optimizer"
        mem.phase_peak_bytes["optimizer"] = mem.current_bytes  # (if it allocates nothing)
        with mem.on_host(mem.optimizer_on_host):
            job.optimizer_step()
    mem._what = None
    return StepMemory(
        seq_len=seq_len,
        peak_bytes=mem.peak_bytes,
        persistent_bytes=persistent,
        host_peak_bytes=mem.host_peak_bytes,
        phase_bytes=dict(mem.phase_peak_bytes),
        at_peak=mem.at_peak,
    )
