"""The plan of a Hugging Face model: `upipe plan --hf-config config.json` simulates the
Hugging Face path itself -- the transformers model class built from its config, converted by
`upipe.integrations.hf.apply_context_parallel` with the memory options, FSDP2 and AdamW --
under fake tensors, as `upipe.planner.step` simulates `upipe train`.

`HFStepSimulator(cfg, world, hf)` builds rank 0 of a `world`-rank job of the config `hf` (a
`config.json` dict, `load_hf_config`) inside `FakeTensorMode` on the fake process group
(`step.JobSimulator`, which also cuts the repeating loops short and extrapolates the depth),
and steps it as transformers' `Trainer` under `upipe.integrations.trainer` steps it:
- the model: `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` /
  `Qwen3ForCausalLM` / `Qwen3NextForCausalLM` of the config (on the meta device: no
  weights, no download) in the compute dtype throughout -- weights, gradients and AdamW
  states in bf16, as the docs/hf.md recipe loads it (`dtype=torch.bfloat16`, `bf16=False`:
  upipe refuses autocast);
- `apply_context_parallel(model, group= or mesh=, strategy=, heads_per_stage=, backend=,
  tiled_mlp=, mlp_tile=, chunked_loss=, loss_chunk=, activation_checkpoint=,
  blocks_per_checkpoint=, offload=, keep_on_gpu=, attention_outputs=)` from the candidate's
  `TrainConfig` fields (`context_parallel_options`; the same names);
- FSDP2: `fully_shard` on each decoder layer and on the root, as `upipe train` shards
  its model (with `fsdp_offload`: `CPUOffloadPolicy`, accelerate's `fsdp_offload_params`);
- one step: `model(input_ids=, position_ids=, labels=, shift_labels=, num_items_in_batch=)`
  on this rank's block of a synthetic sequence (what `ContextParallelCollator` hands it),
  `loss.backward()`, `clip_grad_norm_(1.0)`, `AdamW.step()`, `zero_grad(set_to_none=True)`.
The substitutions are those of `upipe.planner.step` (fake CPU tensors, flash-attn's backward
workspace, CUDA's fused RMSNorm for `F.rms_norm` -- which the fused UPipe op's QK-norm calls;
transformers' own `LlamaRMSNorm` etc. are Python code and run as on a GPU --, offloaded
inputs on the meta device counted as host memory, `.item()` answering 1).

Hybrid models (Qwen3-Next, `is_hybrid`): the Gated DeltaNet layers run as
`apply_context_parallel` converts them (split by heads, UPipe's stages with the candidate's
heads per stage; ring and USP refused, `hybrid_problem`), their scan with fla's kernel's
memory on CUDA (`upipe.planner.deltanet`) or upipe's own scan, loops cut short, on the CPU
(`upipe.planner.sampled`); the MoE experts are transformers' own (3-D parameters, one
grouped GEMM per projection, experts_implementation "grouped_mm", its default), sharded by
FSDP2 over every rank with the rest of their layer (no expert parallelism: each layer's
experts are all-gathered for its forward and backward); the depth is extrapolated by whole
layer patterns (`layer_period`, `upipe.planner.plan.extrapolation_depths`). The grouped
GEMM has no fp32 kernel under fake tensors: hybrids with experts plan in bf16.

Legend: B batch, S sequence, L = S / C tokens per rank, C context-parallel size.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from upipe.model import ModelConfig
from upipe.model.hf_checkpoint import hf_shapes
from upipe.planner.step import (
    HOST_DEVICE,
    JobSimulator,
    SimulatedJob,
    StepTracker,
    _offload_fsdp_state,
    measure_step,
)
from upipe.train.config import DTYPES, validate

CONFIGS = Path(__file__).parent / "configs"
# the shipped configs: name -> file under CONFIGS (README.md there says where each came from)
SHIPPED = {
    "llama-3.1-8b": "llama-3.1-8b.json",
    "qwen3-8b": "qwen3-8b.json",
    "qwen2.5-7b": "qwen2.5-7b.json",
    "mistral-7b-v0.3": "mistral-7b-v0.3.json",
    "qwen3-next-80b-a3b": "qwen3-next-80b-a3b.json",
}
# what a config must give (architecture fields; the rest have transformers' defaults)
REQUIRED = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
# upipe strategy -> apply_context_parallel's (USP is its "ulysses" on a ring x ulysses mesh)
HF_STRATEGIES = {"ulysses": "ulysses", "ring": "ring", "usp": "ulysses", "upipe": "upipe"}
MAX_GRAD_NORM = 1.0  # TrainingArguments' default max_grad_norm


def load_hf_config(path_or_name: str) -> dict:
    """The config.json dict of a path, or of a shipped config by name (`SHIPPED`), checked:
    a supported architecture and every `REQUIRED` field (ValueError naming what is wrong)."""
    from upipe.integrations.hf_archs import PLANNED_ARCHITECTURES as SUPPORTED_ARCHITECTURES

    if path_or_name in SHIPPED:
        path = CONFIGS / SHIPPED[path_or_name]
    else:
        path = Path(path_or_name).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"--hf-config {path_or_name!r}: no such file, and not a shipped config "
                f"({', '.join(SHIPPED)})"
            )
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-config {path}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"--hf-config {path}: a config.json holds an object, got {type(hf)}")
    missing = [k for k in REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"--hf-config {path}: missing {', '.join(missing)}")
    archs = hf["architectures"]
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in SUPPORTED_ARCHITECTURES):
        raise ValueError(
            f"--hf-config {path}: architectures {archs} is not supported by "
            f"apply_context_parallel; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return hf


def is_hybrid(hf: dict) -> bool:
    """Whether the config's model has Gated DeltaNet layers (Qwen3-Next, Qwen3.5)."""
    from upipe.integrations.hf_archs import ARCHITECTURES

    arch = ARCHITECTURES.get(hf["architectures"][0])
    return arch is not None and arch.hybrid


def layer_period(hf: dict) -> int | None:
    """The period of the config's layer pattern: 1 for a dense decoder (every layer alike);
    for a hybrid, the full-attention interval p (transformers' `full_attention_interval`:
    layers i with (i + 1) mod p == 0 are full attention, the others Gated DeltaNet) times the
    MoE step, so that a model of any multiple of it has the layers of the model's first
    ones. None where the layers have no period (a `layer_types` or `mlp_only_layers` that
    breaks it): the depth is then simulated in full."""
    if not is_hybrid(hf):
        return 1
    n, p = hf["num_hidden_layers"], hf.get("full_attention_interval", 4)
    step = hf.get("decoder_sparse_step", 1) if hf.get("num_experts", 0) else 1
    pattern = ["full_attention" if (i + 1) % p == 0 else "linear_attention" for i in range(n)]
    if hf.get("layer_types", pattern) != pattern or hf.get("mlp_only_layers"):
        return None
    return math.lcm(p, step)


def shapes(hf: dict) -> ModelConfig:
    """The `ModelConfig` of the config's shapes (for the checks of `upipe.train.config.
    validate`, the candidates' heads per stage, the depth extrapolation and the time model;
    the simulated model is transformers')."""
    return hf_shapes(hf)


def build_config(hf: dict, n_layers: int | None = None):
    """transformers' config object of `hf` (with `n_layers` decoder layers if given)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    if n_layers is not None:
        fields["num_hidden_layers"] = n_layers
        fields.pop("layer_types", None)  # (one per layer: transformers fills it in again)
        if "max_window_layers" in fields:
            fields["max_window_layers"] = min(fields["max_window_layers"], n_layers)
    config = AutoConfig.for_model(hf["model_type"], **fields)
    config.architectures = list(hf["architectures"])
    return config


def hf_problem(cfg, hf: dict | None = None, world: int | None = None) -> str | None:
    """Why the Hugging Face path cannot run the candidate `cfg` (a `TrainConfig`) of the
    model of config `hf` on `world` ranks, or None (without `hf`: the model-independent
    reasons only)."""
    if cfg.strategy not in HF_STRATEGIES:
        return (
            f"strategy {cfg.strategy!r}: the Hugging Face path (apply_context_parallel) runs "
            f"{', '.join(HF_STRATEGIES)}"
        )
    if hf is not None and is_hybrid(hf):
        problem = hybrid_problem(cfg, hf, world)
        if problem:
            return problem
    if not cfg.fsdp:
        return (
            "--no-fsdp: the Hugging Face path is planned with FSDP2 (the docs/hf.md recipe; "
            "DDP's gradient buckets are not simulated); leave --fsdp on"
        )
    if cfg.master_dtype != cfg.dtype:
        return (
            f"--master-dtype {cfg.master_dtype} with --dtype {cfg.dtype}: the Hugging Face path "
            "trains in one dtype (the model loaded in it; upipe refuses autocast)"
        )
    if cfg.dp not in (None, 1):
        return f"--dp {cfg.dp}: the Hugging Face path is planned with all GPUs on one sequence"
    if cfg.grad_accum != 1:
        return f"--grad-accum {cfg.grad_accum}: the Hugging Face plan is one micro-batch"
    return None


def hybrid_problem(cfg, hf: dict, world: int) -> str | None:
    """Why a hybrid model (`is_hybrid`) cannot run candidate `cfg` on `world` ranks, as
    `apply_context_parallel` would refuse it: its Gated DeltaNet layers are split by heads
    only (no ring), over their value and key heads with the candidate's heads per stage."""
    from upipe.attention.deltanet import all_heads, check_stages
    from upipe.integrations.hf import hybrid_split_problem

    _, ring, uly = cfg.degrees(world)
    # (USP runs as apply_context_parallel's ulysses on a mesh with a ring dim)
    problem = hybrid_split_problem(HF_STRATEGIES[cfg.strategy], ring)
    if problem:
        return f"--strategies {cfg.strategy}: {problem}"
    if hf.get("num_experts") and cfg.dtype != "bfloat16":
        return (
            f"--dtype {cfg.dtype}: the experts' grouped GEMM (torch._grouped_mm) has no "
            f"{cfg.dtype} kernel under fake tensors; plan a hybrid MoE model in bfloat16"
        )
    H, G = hf["linear_num_value_heads"], hf["linear_num_key_heads"]
    U = all_heads(H, uly) if cfg.strategy == "ulysses" else cfg.heads_per_stage
    try:
        check_stages(H, G, uly, U)
    except ValueError as e:
        return str(e)
    return None


def context_parallel_options(cfg) -> dict:
    """`apply_context_parallel`'s keywords (all but group / mesh) of a candidate `cfg` (a
    `TrainConfig`): what the Trainer mixin's `context_parallel=dict(...)` holds."""
    kw = {"strategy": HF_STRATEGIES[cfg.strategy]}
    if cfg.strategy == "upipe":
        kw["heads_per_stage"] = cfg.heads_per_stage
    if cfg.attention_kernel != "auto":
        kw["backend"] = cfg.attention_kernel
    if cfg.tiled_mlp:
        kw.update(tiled_mlp=True, mlp_tile=cfg.mlp_tile)
    if cfg.chunked_loss:
        kw.update(chunked_loss=True, loss_chunk=cfg.loss_chunk)
    if cfg.activation_checkpoint:
        kw["activation_checkpoint"] = True
        if cfg.blocks_per_checkpoint != 1:
            kw["blocks_per_checkpoint"] = cfg.blocks_per_checkpoint
        if cfg.attention_outputs != "recompute":
            kw["attention_outputs"] = cfg.attention_outputs
    if cfg.offload:
        kw["offload"] = True
        if cfg.keep_on_gpu:
            kw["keep_on_gpu"] = cfg.keep_on_gpu
    return kw


class HFJob(SimulatedJob):
    """A converted Hugging Face model, its AdamW and its tracker, stepped as the Trainer
    steps it (module doc). `offload`: the offloaded inputs' arena is simulated (CUDA), a
    fresh one per length."""

    def __init__(self, model, optimizer, tracker: StepTracker, *, C: int, batch: int, offload):
        self.model, self.optimizer, self.tracker = model, optimizer, tracker
        self.C, self.B, self.offload = C, batch, offload
        self.L, self.block = 0, 0  # tokens per rank; this rank's block of the sequence

    def set_length(self, seq_len: int) -> None:
        from upipe.model.offload import Offloader

        self.L = seq_len // self.C
        memory = self.model.upipe_memory
        if self.offload:  # (on the CPU the inputs are in host memory already: no arena)
            scratch = memory.options.blocks_per_checkpoint - 1
            memory.offload = Offloader(memory.n_inputs, HOST_DEVICE, scratch=scratch)

    def forward_backward(self) -> None:
        # this rank's block of one document per row (what the collator hands the model)
        ids_BL = torch.zeros(self.B, self.L, dtype=torch.int64)
        pos_BL = torch.arange(self.block * self.L, (self.block + 1) * self.L).expand(self.B, -1)
        count = torch.full((), self.B * self.L * self.C, dtype=torch.int64)
        out = self.model(
            input_ids=ids_BL,
            position_ids=pos_BL,
            labels=ids_BL,
            shift_labels=ids_BL,
            num_items_in_batch=count,
        )
        out.loss.backward()

    def optimizer_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class HFStepSimulator(JobSimulator):
    """Rank `rank` of `world` ranks training the Hugging Face model of `hf` (a config.json
    dict, `load_hf_config`) with the candidate `cfg` (a `TrainConfig`: strategy, heads per
    stage, memory features, dtype; `hf_problem` says what the path refuses), built once per
    simulated depth and stepped at any sequence length. Keywords as `StepSimulator`'s."""

    def __init__(
        self,
        cfg,
        world: int,
        hf: dict,
        *,
        kernels: str = "cuda",
        attention_kernel: str = "auto",
        depths=None,
        sample_loops: bool = True,
        rank: int = 0,
    ):
        self.cfg, self.hf, self.shape = cfg, hf, shapes(hf)
        super().__init__(
            world,
            self.shape.n_layers,
            kernels=kernels,
            attention_kernel=attention_kernel,
            depths=depths,
            sample_loops=sample_loops,
            rank=rank,
        )
        problem = hf_problem(cfg, hf, world) or validate(cfg, world, self.shape)
        if problem:
            raise ValueError(problem)
        self.dtype = DTYPES[cfg.dtype]
        self.trainers = self.jobs  # (what `upipe.planner.timing` reads the trackers from)

    def _mesh(self):
        from upipe.mesh import make_mesh
        from upipe.torch_private import flatten_mesh

        _, ring, uly = self.cfg.degrees(self.world)
        mesh = make_mesh(ulysses=uly, ring=ring, dp=1)  # (dp, ring, ulysses)
        self._fsdp_mesh = flatten_mesh(mesh, "fsdp")  # FSDP2's mesh: every rank
        if ring > 1 and uly > 1:
            flatten_mesh(mesh["ring", "ulysses"])  # (apply_context_parallel's sequence group)
        return mesh

    def _problem(self, seq_len: int) -> str | None:
        return validate(dataclasses.replace(self.cfg, seq_len=seq_len), self.world, self.shape)

    def _build(self, mesh, n_layers: int) -> SimulatedJob:
        from upipe.planner.step import _kernels

        cfg = self.cfg
        workspaces = dict(cuda_workspaces=self.kernels == "cuda", attention_kernel=self.attn)
        mem = StepTracker(fake=True, **workspaces)
        with mem:
            model, optimizer = build_model(cfg, self.hf, n_layers, mesh, self._fsdp_mesh)
        if cfg.fsdp_offload and self.kernels == "cuda":  # (on the CPU all of it is the host)
            _offload_fsdp_state(model, mem)
        offload = cfg.offload and self.kernels == "cuda"
        job = HFJob(model, optimizer, mem, C=self.world, batch=cfg.batch_size, offload=offload)
        job.block = block_index(mesh)
        # an unmeasured step at the shortest valid length: optimizer states, lazy buffers
        with _kernels(self.kernels):
            measure_step(job, self._shortest())
        return job


def build_model(cfg, hf: dict, n_layers: int, mesh, fsdp_mesh):
    """The Hugging Face model of config `hf` with `n_layers` decoder layers, converted for
    candidate `cfg` (a `TrainConfig`) and sharded by FSDP2 over `fsdp_mesh`, its parameters
    allocated on the CPU (uninitialised) in the candidate's dtype, and its AdamW: (model,
    optimizer). `mesh`: the (dp, ring, ulysses) mesh; one sequence spans all of it (the
    world as a group, or the ring x ulysses mesh). Fake under `FakeTensorMode`, real else
    (the tests' real runs)."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from upipe.integrations.hf import apply_context_parallel

    config = build_config(hf, n_layers)
    config.use_cache = False
    ring, uly = mesh["ring"].size(), mesh["ulysses"].size()
    where = dict(mesh=mesh) if ring > 1 and uly > 1 else dict(group=dist.group.WORLD)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[cfg.dtype])  # (fake parameters cannot be cast: make them so)
    try:
        with torch.device("meta"):
            model = getattr(transformers, hf["architectures"][0])(config)
    finally:
        torch.set_default_dtype(default)
    model.train()
    apply_context_parallel(model, **where, **context_parallel_options(cfg))
    policy = CPUOffloadPolicy(pin_memory=False) if cfg.fsdp_offload else OffloadPolicy()
    for unit in [*model.model.layers, model]:
        fully_shard(unit, mesh=fsdp_mesh, offload_policy=policy)
    model.to_empty(device="cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def block_index(mesh) -> int:
    """This rank's block of the contiguous sequence on the (dp = 1, ring, ulysses) mesh."""
    return mesh["ring"].get_local_rank() * mesh["ulysses"].size() + mesh["ulysses"].get_local_rank()


def hf_settings(kw: dict, gpus: int, seq_len: int) -> dict:
    """The Trainer / accelerate settings of candidate `kw` (TrainConfig fields) on `gpus`
    GPUs of one node at `seq_len` tokens per sequence, as docs/hf.md's recipe writes them:
    "training_arguments" (the TrainingArguments fields that matter), "context_parallel"
    (`ContextParallelMixin`'s `context_parallel=` dict), "accelerate" (the FSDP2 config of
    `accelerate launch`, as one line), "torchrun" and "lines" (all of it, printable)."""
    from upipe.train import TrainConfig

    cfg = TrainConfig(**{**kw, "seq_len": seq_len})
    cp = context_parallel_options(cfg)
    fsdp_config = {"version": 2, "reshard_after_forward": True}
    if cfg.fsdp_offload:
        fsdp_config["cpu_offload"] = True
    args = {
        "per_device_train_batch_size": cfg.batch_size,
        "bf16": False,
        "fsdp": True,
        "fsdp_config": fsdp_config,
        "max_grad_norm": MAX_GRAD_NORM,
        "dataloader_num_workers": 0,
    }
    _, ring, uly = cfg.degrees(gpus)
    where = (
        f"context_parallel_mesh=upipe.make_mesh(ring={ring}, ulysses={uly})"
        if ring > 1 and uly > 1
        else "context_parallel_group=dist.group.WORLD"
    )
    accelerate = (
        "distributed_type: FSDP, mixed_precision: 'no', num_processes: "
        f"{gpus}, fsdp_config: {{fsdp_version: 2, fsdp_auto_wrap_policy: "
        "TRANSFORMER_BASED_WRAP, fsdp_reshard_after_forward: true, fsdp_offload_params: "
        f"{str(cfg.fsdp_offload).lower()}, fsdp_activation_checkpointing: false}}"
    )
    torchrun = f"torchrun --standalone --nproc-per-node {gpus} train.py"
    dtype = f"torch.{cfg.dtype}"
    lines = [
        f"model = AutoModelForCausalLM.from_pretrained(..., dtype={dtype}, "
        'attn_implementation="sdpa")',
        "TrainingArguments("
        + ", ".join(f"{k}={v!r}" for k, v in args.items())
        + ")  # bf16=False: the model is in bf16, upipe refuses autocast",
        f"CPTrainer(..., {where},",
        f"          context_parallel={cp!r})  # rows of {seq_len:,} tokens",
        f"accelerate (instead of fsdp= in TrainingArguments): {accelerate}",
        torchrun,
    ]
    return {
        "training_arguments": args,
        "context_parallel": cp,
        "context_parallel_where": where,
        "accelerate": accelerate,
        "torchrun": torchrun,
        "lines": lines,
    }
