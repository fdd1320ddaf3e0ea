"""`upipe train`'s configuration: `TrainConfig` (one field per command-line option) and its
validation on a number of processes, with the sequence padding that follows from it."""

from __future__ import annotations

import dataclasses

import torch

from upipe.attention.registry import STRATEGIES, check_heads, get_strategy
from upipe.heads import check_heads_per_stage
from upipe.kernels import KERNELS
from upipe.kernels_select import kernel_problem
from upipe.model import PRESETS, ModelConfig, config_from_hf, get_config
from upipe.model.features import ATTENTION_OUTPUTS
from upipe.train.parallelize import MemoryFeatures, check_memory_features
from upipe.train.tokenizers import VOCAB_SIZE, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_fsdp(device: str) -> bool:
    """--fsdp when not given, for `upipe train` and `upipe plan` alike: on for CUDA jobs
    (a model at scale does not fit replicated: Llama3-8B's fp32 weights, gradients and AdamW
    states are 128 GB per GPU), off on CPU (the spawned demo ranks, as they always ran)."""
    return device == "cuda"


def default_dtype(device: str) -> str:
    """--dtype when not given, for `upipe train` and `upipe plan` alike: bfloat16 on CUDA
    (mixed precision with the float32 masters: what the flash and cuDNN kernels take and what
    long-context runs train in), float32 on CPU (the spawned demo ranks, as they always ran)."""
    return "bfloat16" if device == "cuda" else "float32"


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    model: str = dataclasses.field(default="tiny", metadata={"choices": sorted(PRESETS)})
    """Model preset (the tiny one uses the byte vocabulary; others keep their shapes)."""
    strategy: str = dataclasses.field(default="upipe", metadata={"choices": tuple(STRATEGIES)})
    """Context-parallel strategy of the attention layers."""
    nproc: int = 4
    """Processes to spawn on this machine (gloo, CPU); ignored under torchrun."""
    dp: int | None = None
    """Data-parallel degree (default: 1, or every process for strategy none)."""
    ring: int | None = None
    """Ring degree inside the context-parallel group (default: all of it for ring, 2 for
    usp, else 1; ring > 1 with upipe runs each stage as ring attention)."""
    seq_len: int = 8192
    """Tokens per sequence, split over the context-parallel ranks."""
    batch_size: int = 1
    """Sequences per step per data-parallel rank."""
    steps: int = 20
    """Optimizer steps (the total, counting steps done before a resume)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (reached after --warmup-steps, then decayed along a cosine)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from lr / (warmup + 1) to --lr."""
    min_lr_ratio: float = 0.1
    """The cosine decays the learning rate to this fraction of --lr at the last step (1:
    constant after warmup)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (each of --batch-size sequences per data-parallel
    rank); the loss is the mean over every token of all of them, as for one big batch."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay: each update first scales every weight of two or more
    dimensions (embeddings, projections, experts, convolutions) by 1 - lr x weight_decay;
    norms, biases and other vectors are not decayed."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: the weight of the router's load-balancing loss in the
    objective (loss + coef x balance loss, the balance over whole sequences; logged as
    router_aux_loss); default: the model's (tiny-moe 0.01, qwen3-30b-a3b 0.001)."""
    skip_nonfinite_steps: bool = False
    """Skip the update of a step whose loss or gradient norm is NaN or infinite (counted
    and reported) instead of stopping the run there with a message naming the step."""
    heads_per_stage: int | None = None
    """UPipe heads per stage U (default: the ulysses size)."""
    seed: int = 0
    """Seed of the weights and of the document order."""
    data: str | None = None
    """Text/JSON-lines files, saved Hugging Face datasets or directories, comma-separated
    (default: the Python standard library's sources); all checked before the first step."""
    skip_bad_records: bool = False
    """Leave out the records of --data that are not documents (empty, binary or non-UTF-8
    files, malformed JSON lines), counted and reported, instead of stopping at the first."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer (tokenizer.json or its directory; default: bytes,
    vocabulary 257). A preset model takes its vocabulary size."""
    document_mask: bool = True
    """Each token attends only within its own document of the packed sequence, positions
    restart per document and a document's last token is not trained to predict the next
    document (--no-document-mask: attend across documents, positions 0..S-1)."""
    init_from_hf: str | None = None
    """Start from this local Hugging Face Llama/Qwen3 model directory (config.json +
    safetensors): its shapes replace --model's, its weights the seeded ones."""
    save_hf: str | None = None
    """At the end, save the trained weights here as a Hugging Face model directory
    (config.json + model.safetensors, loadable by transformers), with --tokenizer's files
    (AutoTokenizer loads them; the byte tokenizer has none)."""
    dtype: str | None = dataclasses.field(default=None, metadata={"choices": tuple(DTYPES)})
    """Compute dtype: the weights forward and backward use, and the activations. Default:
    bfloat16 with --device cuda, float32 on CPU (`upipe plan` takes the same rule)."""
    master_dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(DTYPES)})
    """Dtype of the weights the optimizer updates (the masters), of their gradients (as
    accumulated and reduced) and of the AdamW states. float32 with --dtype bfloat16 is mixed
    precision (bf16 compute copy); bfloat16 keeps everything in bf16."""
    tiled_mlp: bool = False
    """Run the MLP in sequence tiles, recomputed in backward."""
    mlp_tile: int = 1024
    """Tokens per MLP tile."""
    chunked_loss: bool = False
    """Compute the cross-entropy in chunks (the full logits never exist)."""
    loss_chunk: int = 1024
    """Tokens per cross-entropy chunk."""
    activation_checkpoint: bool = False
    """Activation checkpointing per block (keep only block inputs, recompute the rest)."""
    blocks_per_checkpoint: int = 1
    """With --activation-checkpoint: checkpoint this many consecutive blocks as one (keep
    one input per m blocks; in backward the other m - 1 are recomputed once more and held,
    on the host with --offload)."""
    offload: bool = False
    """Keep the checkpointed block inputs in host memory (CUDA only; needs
    --activation-checkpoint)."""
    keep_on_gpu: int = 0
    """With --offload: keep the inputs of the last K checkpoints on the GPU (less host
    memory, more GPU memory)."""
    attention_outputs: str = dataclasses.field(
        default="recompute", metadata={"choices": ATTENTION_OUTPUTS}
    )
    """With --activation-checkpoint: recompute calls each attention kernel again when a
    block is recomputed in backward; keep reuses the forward's attention outputs and lse
    instead (one attention forward less per layer and step, bit-identical results), held on
    the device from each layer's forward to its backward: one [B, L, H*d] tensor plus
    B * L * H fp32 per layer; offload holds them in host memory beside the block inputs
    (needs --offload). Not for --strategy none (torch's own attention)."""
    fsdp: bool | None = None
    """Shard parameters, gradients and optimizer states over all ranks (FSDP2). Default:
    on with --device cuda, off on CPU (`upipe plan` takes the same rule)."""
    fsdp_offload: bool = False
    """With --fsdp: keep the sharded parameters, gradients and optimizer states in host
    memory (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU); the device holds only
    the units running."""
    device: str = dataclasses.field(default="cpu", metadata={"choices": ("cpu", "cuda")})
    """Device of each rank (cuda: one GPU per process, NCCL; launch with torchrun)."""
    attention_kernel: str = dataclasses.field(default="auto", metadata={"choices": KERNELS})
    """Local attention kernel on CUDA (`upipe.kernels`): auto picks by GPU, dtype and head
    dim (FA3 on H100/H200 where installed, else cuDNN; FA4 on B200 where installed, else
    cuDNN; FA2 on A100; the memory-efficient kernel in fp32); the others force one, checked
    at start (a missing package or an unsupported head dim is refused). fa3/fa4 switch
    torch's flash ops to that impl for the whole process."""
    timeout: float = 600.0
    """Seconds a rank waits for its peers in a collective (the process group's timeout,
    gloo and NCCL alike); a rank that stops answering stops the run after this long, named."""
    metrics_file: str | None = None
    """Append one JSON line per step (step, loss, lr, tokens_per_s, peak_memory_bytes, ...,
    eval_loss when evaluated)."""
    tensorboard: str | None = None
    """Also write the metrics as TensorBoard scalars to this directory (needs the
    tensorboard package: pip install 'upipe[train]')."""
    eval_every: int = 0
    """Evaluate the loss on held-out batches every this many steps and at the end (0: off)."""
    eval_batches: int = 4
    """Batches per evaluation (each of --batch-size sequences per data-parallel rank), from
    the held-out documents."""
    eval_fraction: float = 0.01
    """Share of the documents held out for evaluation, chosen by a hash of their text (with
    --eval-every only: training then never reads them)."""
    checkpoint_dir: str | None = None
    """Save model + optimizer here (torch distributed checkpoint) at the end and every
    --checkpoint-every steps."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    resume: bool = False
    """Continue from the newest intact checkpoint in --checkpoint-dir (an error if it holds
    none) along the checkpoint's learning-rate schedule, also with another --steps (the
    rate stays at its floor past the saved last step; --reschedule for a new schedule)."""
    resume_if_present: bool = False
    """As --resume where --checkpoint-dir holds a checkpoint, else start from step 0 (for
    scripts that rerun the same command)."""
    reschedule: bool = False
    """With --resume: replace the checkpoint's learning-rate schedule (--steps,
    --warmup-steps, --min-lr-ratio, --lr) by this run's from the step reached on."""
    check_memory: bool = False
    """Before any rank starts, simulate one training step with the planner (`upipe plan`'s
    fake-tensor step: seconds) and refuse the job if its peak does not fit (the quick lower
    bound of upipe.train.fits is always checked)."""
    plot: str | None = "train_loss.png"
    """Write the loss curve here (PNG; needs matplotlib, else skipped with a warning); ''
    for none."""

    def __post_init__(self):
        if self.fsdp is None:
            self.fsdp = default_fsdp(self.device)
        if self.dtype is None:
            self.dtype = default_dtype(self.device)

    def degrees(self, world: int, spec=None) -> tuple[int, int, int]:
        """(dp, ring, ulysses) for `world` processes (`spec`: the strategy's registry entry,
        if the caller resolved it)."""
        spec = spec or get_strategy(self.strategy)
        dp = self.dp or (1 if spec.context_parallel else world)
        cp = max(1, world // dp)
        ring = self.ring or spec.default_ring(cp)
        return dp, ring, max(1, cp // ring)

    def features(self) -> MemoryFeatures:
        return MemoryFeatures(
            tiled_mlp=self.mlp_tile if self.tiled_mlp else None,
            loss_chunk=self.loss_chunk if self.chunked_loss else None,
            activation_checkpoint=self.activation_checkpoint,
            blocks_per_checkpoint=self.blocks_per_checkpoint,
            offload=self.offload,
            keep_on_gpu=self.keep_on_gpu,
            attention_outputs=self.attention_outputs,
        )


def model_config(cfg: TrainConfig, vocab_size: int | None = None) -> ModelConfig:
    """The shapes of the model `cfg` trains: those of --init-from-hf's config.json, else the
    preset --model's, with the vocabulary of --tokenizer (`vocab_size`, if the caller has
    the tokenizer loaded) when one is given."""
    if cfg.init_from_hf:
        return config_from_hf(cfg.init_from_hf)
    coef = (
        {}
        if cfg.router_aux_loss_coef is None
        else {"router_aux_loss_coef": cfg.router_aux_loss_coef}
    )
    if cfg.tokenizer is None:
        return get_config(cfg.model, **coef)
    if vocab_size is None:
        vocab_size = load_tokenizer(cfg.tokenizer).vocab_size
    return get_config(cfg.model, vocab_size=vocab_size, **coef)


def validate(cfg: TrainConfig, world: int, model: ModelConfig | None = None) -> str | None:
    """The first problem with `cfg` on `world` processes, as a message naming the fix
    (`model`: the model's shapes, if not those of `model_config(cfg)`)."""
    try:  # the tokenizer is read once, for its vocabulary
        vocab = VOCAB_SIZE if cfg.tokenizer is None else load_tokenizer(cfg.tokenizer).vocab_size
        m = model or model_config(cfg, vocab)
    except (ValueError, OSError) as e:
        return str(e)
    problem = _moe_problem(cfg, m)
    if problem:
        return problem
    positive = ("nproc", "seq_len", "batch_size", "steps", "mlp_tile", "loss_chunk")
    for name in (*positive, "grad_accum", "eval_batches"):
        if getattr(cfg, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}"
    if min(cfg.checkpoint_every, cfg.warmup_steps, cfg.eval_every, cfg.grad_clip) < 0:
        return "--checkpoint-every, --warmup-steps, --eval-every and --grad-clip must be >= 0"
    if not 0 < cfg.timeout < float("inf"):
        return f"--timeout must be > 0 seconds, got {cfg.timeout}"
    if cfg.eval_every and not 0 < cfg.eval_fraction < 1:
        return f"--eval-every needs --eval-fraction in (0, 1), got {cfg.eval_fraction}"
    if not cfg.weight_decay >= 0:  # (NaN too)
        return f"--weight-decay must be >= 0, got {cfg.weight_decay}"
    if cfg.lr <= 0 or not 0 <= cfg.min_lr_ratio <= 1:
        return f"--lr must be > 0 and --min-lr-ratio in [0, 1], got {cfg.lr}, {cfg.min_lr_ratio}"
    if DTYPES[cfg.master_dtype].itemsize < DTYPES[cfg.dtype].itemsize:
        return (
            f"--master-dtype {cfg.master_dtype} is less precise than the compute --dtype "
            f"{cfg.dtype}: use --master-dtype {cfg.dtype}"
        )
    problem = _kernel_problem(cfg, m)
    if problem:
        return problem
    spec = get_strategy(cfg.strategy)
    dp, ring, uly = cfg.degrees(world, spec)
    if world % dp:
        return f"--dp {dp} must divide the number of processes ({world})"
    cp = world // dp
    if not spec.context_parallel and cp != 1:
        return (
            f"strategy {cfg.strategy} has no context parallelism: use --dp {world} "
            "(or leave it out)"
        )
    if ring * uly != cp:
        return f"--ring {ring} must divide the context-parallel size {cp} (= {world} / dp {dp})"
    if spec.needs_ring_and_ulysses and not 1 < ring < cp:
        return (
            f"{cfg.strategy} needs 1 < --ring < {cp} (the context-parallel size); "
            f"use ulysses or ring"
        )
    if spec.on_mesh_called and ring > 1:
        name = spec.on_mesh_called
        return f"{cfg.strategy} with --ring > 1 is {name}: use --strategy {name}"
    problem = check_heads(
        spec,
        m.n_heads,
        m.n_kv_heads,
        uly,
        size="ulysses size",
        whole="--strategy ring",
        model=cfg.model,
    )
    if problem:
        return problem
    if spec.heads_per_stage:
        try:
            check_heads_per_stage(m.n_heads, m.n_kv_heads, uly, cfg.heads_per_stage)
        except ValueError as e:
            return f"--heads-per-stage: {e}"
    elif cfg.heads_per_stage is not None:
        return "--heads-per-stage applies to --strategy upipe only"
    problem = check_memory_features(cfg.features(), flag=lambda n: "--" + n.replace("_", "-"))
    if problem:
        return problem
    if cfg.attention_outputs != "recompute" and spec.module is None:
        return (
            f"--attention-outputs {cfg.attention_outputs} reuses what upipe's attention ops "
            f"keep; --strategy {cfg.strategy} runs the model's own attention (torch's SDPA): "
            "use --attention-outputs recompute"
        )
    per, keep = cfg.blocks_per_checkpoint, cfg.keep_on_gpu
    checkpoints = -(-m.n_layers // max(per, 1))  # ceil(n_layers / blocks per checkpoint)
    if per < 1 or keep < 0:
        return f"--blocks-per-checkpoint must be >= 1 and --keep-on-gpu >= 0, got {per}, {keep}"
    if per > 1 and not cfg.activation_checkpoint:
        return f"--blocks-per-checkpoint {per} needs --activation-checkpoint"
    if keep and not cfg.offload:
        return f"--keep-on-gpu {keep} keeps some offloaded inputs on the GPU: it needs --offload"
    if keep >= checkpoints:
        return (
            f"--keep-on-gpu {keep} keeps all {checkpoints} checkpoints ({m.n_layers} blocks / "
            f"{per} per checkpoint) on the GPU: use at most {checkpoints - 1}, or drop --offload"
        )
    if cfg.fsdp_offload and not cfg.fsdp:
        return (
            "--fsdp-offload keeps FSDP2's sharded parameters, gradients and optimizer states "
            "on the host; add --fsdp"
        )
    if (cfg.resume or cfg.resume_if_present) and not cfg.checkpoint_dir:
        return f"--{'resume' if cfg.resume else 'resume-if-present'} needs --checkpoint-dir"
    if cfg.resume and cfg.resume_if_present:
        return "--resume and --resume-if-present exclude each other: pass one"
    if cfg.reschedule and not (cfg.resume or cfg.resume_if_present):
        return "--reschedule changes a resumed run's schedule: add --resume"
    if m.vocab_size >= vocab:
        return None
    tokens = "byte tokens" if cfg.tokenizer is None else f"token ids of {cfg.tokenizer}"
    return (
        f"the model's vocabulary ({m.vocab_size}) is smaller than the {vocab} {tokens}: use "
        "another --tokenizer or a model whose vocabulary holds its ids"
    )


def _moe_problem(cfg: TrainConfig, m: ModelConfig) -> str | None:
    """Options that a mixture-of-experts model (or a dense one) cannot take."""
    if cfg.router_aux_loss_coef is not None and not m.n_experts:
        what = cfg.init_from_hf or f"--model {cfg.model}"
        return (
            f"--router-aux-loss-coef weighs the router's balance loss, but {what} is dense "
            "(no experts): leave it out, or train a mixture-of-experts preset (tiny-moe)"
        )
    if cfg.save_hf and m.n_experts:
        return (
            f"--save-hf: {cfg.model} is a mixture-of-experts model, which upipe does not "
            "convert to Hugging Face checkpoints yet; save with --checkpoint-dir instead"
        )
    return None


def _kernel_problem(cfg: TrainConfig, m: ModelConfig) -> str | None:
    """Whether --attention-kernel can run the model's attention here (CUDA: on this
    process's GPU, with the packages installed here; torchrun checks every rank)."""
    kernel = cfg.attention_kernel
    if kernel == "auto":
        return None
    if cfg.device != "cuda":
        return (
            f"--attention-kernel {kernel} runs on CUDA (--device cuda); on CPU leave it at auto "
            "(the CPU kernel)"
        )
    if not torch.cuda.is_available():
        return None  # the launch itself fails with its own message
    problem = kernel_problem(kernel, torch.device("cuda"), DTYPES[cfg.dtype], m.head_dim)
    return problem and f"--attention-kernel {kernel}: {problem}"


def padded_length(cfg: TrainConfig, world: int, spec=None) -> int:
    """The length a sequence of `cfg.seq_len` tokens is padded to: the next multiple of
    what the layout splits evenly (C chunks, 2C for a zigzag layout or a ring in UPipe).

    Padding goes at the end, with label `IGNORE_INDEX`: no padded position is counted by
    the loss, and as attention is causal no real token attends to one, so the real tokens'
    losses and gradients are those of the unpadded sequence (tested against one process).
    `spec`: the strategy's registry entry, if the caller resolved it."""
    spec = spec or get_strategy(cfg.strategy)
    dp, ring, uly = cfg.degrees(world, spec)
    layout = spec.layout
    multiple = ring * uly * (2 if layout == "zigzag" or ring > 1 else 1)
    return cfg.seq_len + (-cfg.seq_len) % multiple
