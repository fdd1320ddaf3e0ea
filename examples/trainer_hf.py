"""Train a Hugging Face causal LM with transformers' Trainer or TRL's SFTTrainer, each sequence
split over the torchrun ranks by upipe (context parallelism).

    torchrun --nproc-per-node 4 examples/trainer_hf.py                 # Trainer, UPipe, 4 CPU ranks
    torchrun --nproc-per-node 2 examples/trainer_hf.py --trainer sft --strategy ulysses
    torchrun --nproc-per-node 4 examples/trainer_hf.py --memory-features --activation-checkpointing
    torchrun --nproc-per-node 4 examples/trainer_hf.py --memory-features --steps 8 \
        --resume-from-checkpoint last                                  # continue that run
    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/trainer_hf.py
    python examples/trainer_hf.py --no-context-parallel                # the unmodified model

The data: paragraphs of a local text file as documents of bytes (no tokenizer, no download).
`--trainer trainer` packs each batch's documents into one row (transformers'
`DataCollatorWithFlattening`: position ids restart per document, which upipe masks);
`--trainer sft` pads them into rows (TRL's collator; padding on the right); `--trainer
trainer sft` runs both, one after the other. The model: `--model-dir` (a local Hugging Face
directory, with a tokenizer for sft), or a small Llama with random weights built from a
config. Every step's loss (by step number) and the held-out loss at the end go to `--losses`
as JSON, by trainer; each trainer saves its checkpoints (every `--save-steps`, by default once,
at the end) under `--output-dir`/trainer or /sft.

What changes against a plain Trainer script: the trainer class gets `ContextParallelMixin` in
front (`upipe.integrations.trainer`) and takes `context_parallel_group=` and
`context_parallel=`, the keywords with which it converts the model (`apply_context_parallel`'s):
the strategy, and with `--memory-features` upipe's tiled MLP, chunked loss and activation
checkpointing with offload (offload acts on CUDA only: on the CPU the checkpointed inputs are
in host memory already). `--activation-checkpointing` is transformers' own
(`TrainingArguments(activation_checkpointing=True)`, formerly `gradient_checkpointing=True`),
which upipe takes over where it runs the layers: one recompute per layer. Under `accelerate
launch` on the CPU, accelerate 1.15 runs DDP whatever the config says (it sets up FSDP for
accelerator devices only): see docs/hf.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 258  # 256 bytes, <pad>, <eos>
PAD, EOS = 256, 257


def byte_documents(path: str, n: int, max_len: int) -> list[list[int]]:
    """The first `n` paragraphs of `path` (at least 8 bytes, cut to `max_len`) as bytes."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    paragraphs = [p.encode() for p in text.split("\n\n") if len(p.encode()) >= 8]
    return [list(p[:max_len]) for p in paragraphs[:n]]


def byte_tokenizer():
    """A tokenizer over the 256 bytes plus <pad>/<eos> (SFTTrainer wants one for its ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(256)} | {"<pad>": PAD, "<eos>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def small_model():
    """A 2-layer Llama (8 query / 4 kv heads, head dim 16), the same random weights on every
    rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def context_parallel_options(args) -> dict:
    """The keywords of `apply_context_parallel` the trainer converts the model with."""
    options = dict(strategy=args.strategy)
    if args.memory_features:
        options.update(
            tiled_mlp=True,
            mlp_tile=args.mlp_tile,
            chunked_loss=True,
            loss_chunk=args.loss_chunk,
            activation_checkpoint=True,
            offload=True,
        )
    return options


def build_trainer(args, name: str, distributed: bool):
    """The trainer `name` ("trainer" or "sft") for the model and data of `args`."""
    import datasets
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer

    if args.model_dir:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    else:
        model = small_model()
    cp = {}
    if args.context_parallel and distributed:
        from upipe.integrations.trainer import ContextParallelMixin

        cp = {
            "context_parallel_group": dist.group.WORLD,
            "context_parallel": context_parallel_options(args),
        }

    docs = byte_documents(args.text, args.docs, args.doc_len)
    held_out = len(docs) // 5
    train_set = datasets.Dataset.from_dict({"input_ids": docs[held_out:]})
    eval_set = datasets.Dataset.from_dict({"input_ids": docs[:held_out]})
    settings = dict(
        output_dir=os.path.join(args.output_dir, name),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        per_device_eval_batch_size=args.batch * args.grad_accum,  # a step's documents
        learning_rate=args.lr,
        optim=args.optim,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps or args.steps,
        activation_checkpointing=args.activation_checkpointing,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if distributed:
        settings.update(ddp_backend="gloo", ddp_timeout=args.timeout)
        settings.update(ddp_find_unused_parameters=False)
    if name == "sft":
        from trl import SFTConfig, SFTTrainer

        base = SFTTrainer
        training_args = SFTConfig(**settings, max_length=None, bf16=False)
        kw = dict(processing_class=_tokenizer(args))
    else:
        from transformers import TrainingArguments

        base = Trainer
        training_args = TrainingArguments(**settings)
        kw = dict(data_collator=DataCollatorWithFlattening())
    if cp:
        base = type(f"ContextParallel{base.__name__}", (ContextParallelMixin, base), {})
    return base(
        model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set, **kw, **cp
    )


def train(args, name: str, distributed: bool) -> dict:
    """Train with the trainer `name`: every step's loss by step number (resumed: the
    checkpoint's log history, then the steps run now) and the held-out loss at the end."""
    trainer = build_trainer(args, name, distributed)
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    eval_loss = trainer.evaluate()["eval_loss"]
    losses = {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row}
    return {"losses": losses, "eval_loss": eval_loss}


def _tokenizer(args):
    if args.model_dir and (Path(args.model_dir) / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.model_dir)
    return byte_tokenizer()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trainer", nargs="+", choices=("trainer", "sft"), default=["trainer"],
        help="transformers' Trainer, TRL's SFTTrainer, or both one after the other",
    )  # fmt: skip
    p.add_argument("--strategy", choices=("upipe", "ulysses", "ring"), default="upipe")
    p.add_argument("--no-context-parallel", dest="context_parallel", action="store_false")
    p.add_argument(
        "--memory-features", action="store_true",
        help="upipe's tiled MLP, chunked loss, activation checkpointing and offload",
    )  # fmt: skip
    p.add_argument(
        "--mlp-tile",
        type=int,
        default=32,
        help="tokens per MLP tile (short, for this example's rows; about 1024 for long ones)",
    )
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=32,
        help="tokens per loss chunk (about 1024 for long sequences)",
    )
    p.add_argument(
        "--activation-checkpointing", action="store_true",
        help="transformers' activation (gradient) checkpointing: TrainingArguments'",
    )  # fmt: skip
    p.add_argument("--model-dir", help="a local Hugging Face model directory")
    p.add_argument("--text", default=str(ROOT / "README.md"), help="the documents' source")
    p.add_argument("--docs", type=int, default=40, help="documents (a fifth held out)")
    p.add_argument("--doc-len", type=int, default=256, help="bytes per document at most")
    p.add_argument("--batch", type=int, default=4, help="documents per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, help="checkpoint every n steps (default: at the end)")
    p.add_argument(
        "--resume-from-checkpoint",
        help="a checkpoint directory, or 'last': each trainer's newest under --output-dir",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim")
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "upipe-trainer"))
    p.add_argument("--losses", help="write the losses here (JSON)")
    p.add_argument("--timeout", type=int, default=300, help="process group timeout, seconds")
    return p


def main():
    args = parser().parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:  # before TrainingArguments, which would otherwise make the group
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    result = {name: train(args, name, distributed) for name in args.trainer}
    if distributed:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
        if args.losses:
            Path(args.losses).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
