"""Fine-tune a Hugging Face causal LM on one long sequence with 4 context-parallel CPU ranks.

    python examples/finetune_hf.py                        # small Llama built from a config
    python examples/finetune_hf.py --arch qwen3 --steps 5 --seq 8192 --text README.md
    python examples/finetune_hf.py --model-dir /path/to/local/model   # no download

Each of the 4 spawned gloo ranks holds 1/4 of the sequence; `apply_context_parallel` makes
every attention layer UPipe over the 4 ranks. Without --model-dir the model is built from
a config with random weights and reads raw bytes (vocabulary 256); with one, the text is
tokenised by the checkpoint's tokenizer. Gradients are summed over the ranks (the loss is
the mean over the whole sequence), then every rank takes the same AdamW step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

from upipe.integrations.hf import apply_context_parallel, causal_lm_loss, shard_batch
from upipe.launch import LocalCluster

CONFIGS = {  # small models: 8 query heads, 4 kv heads, byte vocabulary
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def load_model_and_tokens(args):
    import transformers

    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    if args.model_dir:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model_dir, torch_dtype=torch.float32, local_files_only=True
        )
        tok = transformers.AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
        ids = tok(text, return_tensors="pt").input_ids[0]
    else:
        config = getattr(transformers, CONFIGS[args.arch])(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_hidden_layers=2,
            vocab_size=256,
            max_position_embeddings=args.seq,
            sliding_window=None,
        )
        torch.manual_seed(0)  # the same weights on every rank
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.tensor(list(text.encode("utf-8")))
    if ids.numel() < args.seq:  # repeat a short text up to the sequence length
        ids = ids.repeat(-(-args.seq // ids.numel()))
    return model, ids[None, : args.seq]


def train(rank, world_size, args):
    group = dist.group.WORLD
    model, ids_BS = load_model_and_tokens(args)
    apply_context_parallel(model, group=group, strategy="upipe")
    model.train()
    batch = shard_batch(ids_BS, group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = causal_lm_loss(logits, batch["labels"], group=group)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # each rank holds its share of the gradient
            dist.all_reduce(p.grad, group=group)
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - t0:.1f} s)")
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(CONFIGS), default="llama")
    p.add_argument("--model-dir", help="a local Hugging Face model directory")
    p.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    p.add_argument("--seq", type=int, default=4096, help="tokens (a multiple of 4)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    with LocalCluster(4, timeout_s=1800) as cluster:
        losses = cluster.run(train, args)[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")


if __name__ == "__main__":
    main()
