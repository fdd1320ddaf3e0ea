"""Hugging Face checkpoints (Llama, Qwen3) in and out of `upipe.model.CausalLM`.

A checkpoint directory holds `config.json` and safetensors weights: `model.safetensors`, or
shards listed by `model.safetensors.index.json`. `CausalLM`'s parameter names are Hugging
Face's (`model.layers.N.self_attn.q_proj.weight`, ...), and its RoPE is Hugging Face's
"rotate half" convention (`upipe.rope`), the layout `transformers` stores q_proj/k_proj in
(its Llama conversion script permutes Meta's interleaved weights once, at conversion). So
every tensor maps by name with no permutation; only these keys are special:
- `lm_head.weight` when the embeddings are tied: not stored on save (as `transformers`
  does), skipped on load (tied to `model.embed_tokens.weight`, as `transformers` does);
- `*.rotary_emb.inv_freq` (old checkpoints): skipped, RoPE is computed from `rope_theta`.

What `CausalLM` computes: RMSNorm, RoPE (plain, or with Llama 3.1's "llama3" frequency
scaling: `upipe.rope.Llama3RopeScaling`), SwiGLU MLP, GQA with attention scale head_dim^-1/2,
no biases, QK-norm for Qwen3. A config asking for anything else (other rope scalings such as
"yarn" or "linear", biases, sliding windows, another activation) is
refused with a ValueError instead of loading weights into a model that computes something
else; such models run context-parallel through `upipe.integrations.hf` instead.

Needs the `safetensors` package (installed with `transformers`); `transformers` itself is
not imported.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from upipe.model.config import ModelConfig
from upipe.model.llama import CausalLM
from upipe.rope import Llama3RopeScaling

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# model_type -> the architecture name transformers' AutoModelForCausalLM builds for it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "Hugging Face checkpoints need the `safetensors` package: pip install safetensors "
            "(or pip install -e '.[hf]')"
        ) from None
    return safetensors


def read_hf_config(path: str | Path) -> dict:
    """The `config.json` of a checkpoint directory, as a dict."""
    file = Path(path).expanduser() / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"{path}: no {CONFIG_NAME}; expected a Hugging Face checkpoint directory")
    return json.loads(file.read_text())


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(hf: dict) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from transformers 5's `rope_parameters` or 4's
    `rope_theta`/`rope_scaling`; ValueError for any RoPE but the plain one and "llama3"."""
    params = hf.get("rope_parameters")
    if params is not None and "rope_type" not in params and "rope_theta" not in params:
        raise ValueError(f"per-layer-type rope_parameters ({sorted(params)}) are not supported")
    if params is None:
        params = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(
            f"rope type {rope_type!r} is not supported by upipe.model.CausalLM (plain RoPE and "
            "'llama3' only, upipe.rope); run this model with transformers and "
            "upipe.integrations.hf.apply_context_parallel instead"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not 1.0")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise ValueError(f"rope type 'llama3' needs {', '.join(missing)} in rope_parameters")
    return theta, Llama3RopeScaling(**{k: params[k] for k in LLAMA3_KEYS})


def config_from_hf(hf: dict | str | Path) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face Llama or Qwen3 `config.json` (a dict, or the
    checkpoint directory); ValueError naming what `CausalLM` cannot compute."""
    if not isinstance(hf, dict):
        hf = read_hf_config(hf)
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)} "
            "(others, e.g. Mistral and Qwen2, run through upipe.integrations.hf)"
        )
    archs = hf.get("architectures") or [ARCHITECTURES[model_type]]
    if archs != [ARCHITECTURES[model_type]]:
        raise ValueError(f"architectures {archs} != [{ARCHITECTURES[model_type]!r}]")
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu") not in ("silu", "swish"), "silu"),
        "attention_bias": (bool(hf.get("attention_bias", False)), False),
        "mlp_bias": (bool(hf.get("mlp_bias", False)), False),
        "attention_dropout": (bool(hf.get("attention_dropout", 0.0)), 0.0),
        "use_sliding_window": (bool(hf.get("use_sliding_window", False)), False),
        "layer_types": ("sliding_attention" in (hf.get("layer_types") or ()), "full_attention"),
        "quantization_config": ("quantization_config" in hf, None),
    }
    for key, (bad, wanted) in unsupported.items():
        if bad:
            raise ValueError(
                f"{key}={hf[key]!r} is not supported by upipe.model.CausalLM (it needs {wanted!r})"
            )
    theta, scaling = _rope(hf)
    return dataclasses.replace(
        hf_shapes(hf),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
    )


def hf_shapes(hf: dict) -> ModelConfig:
    """The shapes of a Hugging Face decoder's `config.json` as a `ModelConfig` (widths, heads,
    depth, vocabulary, QK-norm, tied embeddings; RoPE and the norm's eps left at their
    defaults): what `config_from_hf` builds on, and what the planner of the Hugging Face path
    (`upipe.planner.hf`) needs of any supported architecture."""
    n_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        ffn_dim=hf["intermediate_size"],
        qk_norm=hf.get("model_type") == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def hf_config(cfg: ModelConfig, *, dtype: torch.dtype, base: dict | None = None) -> dict:
    """The `config.json` dict of a `CausalLM` with `cfg`: Qwen3 if it has QK-norm, else Llama.
    `base` (e.g. the config the weights were loaded from) contributes the fields upipe does
    not model (token ids, max_position_embeddings, ...); the shapes always come from `cfg`.
    RoPE is written both ways (`rope_theta`/`rope_scaling` for transformers 4,
    `rope_parameters` for 5)."""
    if cfg.n_experts:
        raise ValueError(
            f"a mixture-of-experts model ({cfg.n_experts} experts) has no Hugging Face "
            "conversion in upipe yet: save it with torch.save or upipe's checkpoints"
        )
    model_type = "qwen3" if cfg.qk_norm else "llama"
    if base is not None and base.get("model_type", model_type) != model_type:
        raise ValueError(
            f"base config has model_type {base['model_type']!r}, but this model is {model_type!r} "
            f"(qk_norm={cfg.qk_norm})"
        )
    out = {k: v for k, v in (base or {}).items() if k not in ("torch_dtype", "dtype")}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = dict(rope_type="llama3", **dataclasses.asdict(cfg.rope_scaling))
        rope.update(scaling)
    out.update(
        architectures=[ARCHITECTURES[model_type]],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.ffn_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=scaling,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        attention_dropout=0.0,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if model_type == "llama":
        out["mlp_bias"] = False
    else:
        out.update(use_sliding_window=False, sliding_window=None)
        out.pop("layer_types", None)  # transformers fills in full attention for every layer
    return out


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of its index, or the single file."""
    if (path / INDEX_NAME).is_file():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    raise ValueError(
        f"{path}: neither {WEIGHTS_NAME} nor {INDEX_NAME} (only safetensors checkpoints load; "
        "convert a .bin one with transformers: from_pretrained(dir).save_pretrained(dir))"
    )


def _skipped(key: str, cfg: ModelConfig) -> bool:
    return key.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and key == "lm_head.weight")


@torch.no_grad()
def load_hf_weights(model: CausalLM, path: str | Path) -> None:
    """Copy a checkpoint's weights into `model` in place (cast to each parameter's dtype and
    device). Works on a model already parallelized or sharded with FSDP2 (names unchanged):
    every rank reads the files and keeps its shard of each tensor (no communication), one
    tensor at a time. Everything is checked before anything is copied: the config equals
    `model.config`, every parameter has a tensor of its shape and no tensor is left over."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    path = Path(path).expanduser()
    cfg = config_from_hf(path)
    if cfg != model.config:
        diff = ", ".join(
            f"{f} {getattr(cfg, f)} (checkpoint) vs {getattr(model.config, f)} (model)"
            for f in cfg.__dataclass_fields__
            if getattr(cfg, f) != getattr(model.config, f)
        )
        raise ValueError(
            f"{path}: the model was not built from this checkpoint's config: {diff}; build it "
            "with CausalLM(config_from_hf(path))"
        )
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    if cfg.tie_embeddings and "lm_head.weight" in params:
        raise ValueError(
            "the config ties lm_head to the embedding but the model holds two tensors "
            "(Module.to_empty unties them); tie them first: "
            "model.lm_head.weight = model.model.embed_tokens.weight"
        )
    safe_open = _safetensors().safe_open
    where, unexpected = {}, []
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                if _skipped(key, cfg):
                    continue
                if key not in params:
                    unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                want = tuple(params[key].shape)
                if shape != want:
                    raise ValueError(f"{file.name}: {key} has shape {shape}, the model {want}")
                where[key] = file
    missing = sorted(set(params) - set(where))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing[:8]}, unexpected {unexpected[:8]}")
    for file in sorted(set(where.values())):
        with safe_open(file, framework="pt") as f:
            for key in (k for k, v in where.items() if v == file):
                p = params[key]
                full = f.get_tensor(key).to(p.dtype)
                if isinstance(p, DTensor):
                    full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                p.copy_(full)


def load_hf_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """A `CausalLM` built from a checkpoint directory's config.json, holding its weights.
    Built on the meta device in `dtype`, then allocated once on `device` (no random init,
    no fp32 copy of a bf16 model)."""
    cfg = config_from_hf(path)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    load_hf_weights(model, path)
    return model


@torch.no_grad()
def save_hf_checkpoint(
    model: CausalLM,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    base_config: dict | str | Path | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write `model` as a Hugging Face checkpoint (config.json + safetensors) that
    `transformers.AutoModelForCausalLM.from_pretrained(path)` loads.

    `dtype`: the stored dtype (default: the parameters'). `base_config`: a config dict or a
    checkpoint directory whose other fields to keep (see `hf_config`). `max_shard_bytes`:
    split into `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`
    when the tensors exceed it (None: one file). FSDP2-sharded parameters are gathered one
    at a time (a collective: call this on every rank); only global rank 0 writes. The whole
    model is held on the host while writing.
    """
    from torch.distributed.tensor import DTensor

    save_file = _safetensors().torch.save_file
    tensors = {}
    for name, p in model.named_parameters():  # a tied lm_head is not stored
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        tensors[name] = full.to("cpu", dtype or full.dtype).contiguous()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    if isinstance(base_config, str | Path):
        base_config = read_hf_config(base_config)
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    stored = next(iter(tensors.values())).dtype
    config = hf_config(model.config, dtype=stored, base=base_config)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    shards = [{}]
    for name, t in tensors.items():
        size = sum(x.numel() * x.element_size() for x in shards[-1].values())
        if max_shard_bytes and shards[-1] and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
        shards[-1][name] = t
    metadata = {"format": "pt"}  # what transformers checks a safetensors file declares
    if len(shards) == 1:
        (path / INDEX_NAME).unlink(missing_ok=True)
        save_file(shards[0], str(path / WEIGHTS_NAME), metadata=metadata)
        return
    (path / WEIGHTS_NAME).unlink(missing_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
