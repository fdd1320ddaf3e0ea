"""upipe.model.hf_checkpoint: Hugging Face Llama / Qwen3 checkpoints into and out of CausalLM,
against `transformers` itself (small random models built from configs; nothing downloaded)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tolerances import TOL, rel_err

from upipe.model import (
    CausalLM,
    ModelConfig,
    config_from_hf,
    load_hf_checkpoint,
    load_hf_weights,
    save_hf_checkpoint,
)

transformers = pytest.importorskip("transformers")

# GQA (8 query heads, 2 kv heads), head_dim 16 != hidden / heads (8), non-default theta/eps
COMMON = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    initializer_range=0.1,
)  # fmt: skip
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "default", "rope_theta": 5e5}
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}


# Llama 3.1's rope scaling, pre-training context shortened to 32 so that the 24 tokens of
# `inputs` span kept, interpolated and divided frequencies (head_dim 16, theta 5e5)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)  # fmt: skip
CONFIGS["llama3.1"] = lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE)


def hf_model(arch, dtype=torch.float32):
    """A random transformers model; norm weights perturbed so that a misplaced one shows."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[arch](), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.to(dtype).eval()


def inputs():
    gen = torch.Generator().manual_seed(1)
    ids_BS = torch.randint(0, COMMON["vocab_size"], (2, 24), generator=gen)
    return ids_BS, torch.arange(24).expand(2, -1)


def hf_logits(model):
    ids_BS, pos_BS = inputs()
    with torch.no_grad():
        return model(input_ids=ids_BS, position_ids=pos_BS).logits


def upipe_logits(model):
    with torch.no_grad():
        return model(*inputs())


@pytest.fixture(params=["llama", "qwen3"])
def arch(request):
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_equal_transformers(arch, dtype, tmp_path):
    ref = hf_model(arch, dtype)
    ref.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path, dtype=dtype)
    cfg = model.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.qk_norm) == (8, 2, 16, arch == "qwen3")
    assert cfg.tie_embeddings == (arch == "qwen3")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_embeddings
    assert cfg.rope_theta == {"llama": 5e5, "qwen3": 1e6}[arch]
    assert all(p.dtype == dtype for p in model.parameters())
    err = rel_err(upipe_logits(model), hf_logits(ref))
    # float64: transformers still computes RMSNorm and the RoPE angles in fp32
    assert err < TOL[torch.float32]["fwd"], err


def test_round_trip_through_transformers(arch, tmp_path):
    ref = hf_model(arch)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(model, tmp_path / "out", base_config=tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert type(back) is type(ref)
    want, got = ref.state_dict(), back.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit-identical weights
    assert torch.equal(hf_logits(back.eval()), hf_logits(ref))
    # and into upipe again: the same parameters, bit for bit
    again = load_hf_checkpoint(tmp_path / "out")
    assert again.config == model.config
    for (n, p), (m, q) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["max_position_embeddings"] == ref.config.max_position_embeddings  # from base


def test_sharded_checkpoints_both_ways(arch, tmp_path):
    ref = hf_model(arch)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = load_hf_checkpoint(tmp_path / "hf")
    assert rel_err(upipe_logits(model), hf_logits(ref)) < TOL[torch.float32]["fwd"]
    save_hf_checkpoint(model, tmp_path / "out", max_shard_bytes=40_000)
    shards = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert torch.equal(hf_logits(back.eval()), hf_logits(ref))


def test_save_in_bfloat16(tmp_path):
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=32, ffn_dim=48, qk_norm=True))
    model.init_weights(0)
    save_hf_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back).__name__ == "Qwen3ForCausalLM" and back.dtype == torch.bfloat16
    again = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p.bfloat16(), q)


# Meta-Llama-3-8B's config.json, trimmed (no head_dim; transformers 4's RoPE keys)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "pretraining_tp": 1,
    "torch_dtype": "bfloat16",
}
# Qwen3-32B's config.json, trimmed
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "max_window_layers": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("hf, preset", [(LLAMA3_8B, "llama3-8b"), (QWEN3_32B, "qwen3-32b")])
def test_published_configs_give_the_presets(hf, preset):
    from upipe.model import get_config

    assert config_from_hf(hf) == get_config(preset)
    # and back: transformers reads what hf_config writes as the same shapes
    from upipe.model.hf_checkpoint import hf_config

    cfg = transformers.AutoConfig.for_model(**hf_config(get_config(preset), dtype=torch.bfloat16))
    assert config_from_hf(cfg.to_dict()) == get_config(preset)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
            "rope type 'yarn' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
            "rope type 'llama3' needs low_freq_factor, high_freq_factor, original_max_position",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"num_key_value_heads": 3}, r"n_kv_heads \(3\) must divide n_heads \(8\)"),
    ],
)
def test_unsupported_configs(change, message):
    hf = CONFIGS["llama"]().to_dict()
    if "rope_scaling" in change:
        hf.pop("rope_parameters")
    hf.update(change)
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


def test_load_errors(tmp_path):
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path)
    other = CausalLM(ModelConfig(vocab_size=101, hidden_size=64))
    with pytest.raises(ValueError, match=r"n_kv_heads 2 \(checkpoint\) vs 4 \(model\)"):
        load_hf_weights(other, tmp_path)
    qwen3 = tmp_path / "qwen3"
    hf_model("qwen3").save_pretrained(qwen3)
    with torch.device("meta"):
        untied = CausalLM(config_from_hf(qwen3))
    untied.to_empty(device="cpu")
    with pytest.raises(ValueError, match="tie them first"):
        load_hf_weights(untied, qwen3)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    norm = tensors["model.norm.weight"]
    save_file({**tensors, "model.norm.weight": norm[:-1]}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(63,\), the model \(64,\)"):
        load_hf_checkpoint(tmp_path)
    tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*model\.norm\.weight.*model\.extra\.weight"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_checkpoint(tmp_path / "nowhere")


def load_and_save_sharded(rank, world_size, src, dst):
    """On every rank: a CausalLM built on the meta device, sharded with FSDP2, its shards
    loaded from `src`, then saved to `dst`; returns the full weights as loaded."""
    from upipe.mesh import make_mesh
    from upipe.train.parallelize import apply_fsdp

    with torch.device("meta"):
        model = CausalLM(config_from_hf(src))
    apply_fsdp(model, make_mesh(ulysses=1, dp=world_size))
    model.to_empty(device="cpu")
    load_hf_weights(model, src)
    local = sum(p.to_local().numel() for p in model.parameters())
    save_hf_checkpoint(model, dst)  # gathers on every rank, rank 0 writes
    return local, {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def test_fsdp_sharded_model_loads_and_saves(arch, tmp_path, clusters):
    """Under FSDP2 each rank keeps its shard of every tensor, and the saved checkpoint is the
    one loaded, bit for bit."""
    ref = hf_model(arch)
    ref.save_pretrained(tmp_path / "hf")
    whole = load_hf_checkpoint(tmp_path / "hf")
    results = clusters(2).run(load_and_save_sharded, tmp_path / "hf", tmp_path / "out")
    total = sum(p.numel() for p in whole.parameters())
    for local, weights in results:
        assert local < 0.6 * total
        assert list(weights) == [n for n, _ in whole.named_parameters()]
        assert all(torch.equal(weights[n], p) for n, p in whole.named_parameters())
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_llama3_rope_tables_equal_transformers():
    """upipe.rope's llama3 frequencies and cos/sin tables: bit for bit transformers' (its
    `_compute_llama3_parameters` through LlamaRotaryEmbedding), at short and long positions."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from upipe.rope import inv_frequencies, rope_cos_sin

    config = CONFIGS["llama3.1"]()
    scaling = config_from_hf(config.to_dict()).rope_scaling
    assert scaling is not None and scaling.original_max_position_embeddings == 32
    rotary = LlamaRotaryEmbedding(config)
    ours = inv_frequencies(16, theta=5e5, scaling=scaling)
    assert torch.equal(ours, rotary.inv_freq)
    assert not torch.equal(ours, inv_frequencies(16, theta=5e5))  # the scaling matters here
    positions_BL = torch.tensor([[0, 1, 7, 31, 32, 1000, 131071, 1048575]])
    x = torch.zeros(1, positions_BL.shape[1], 64)
    cos_hf, sin_hf = rotary(x, positions_BL)
    cos, sin = rope_cos_sin(positions_BL, 16, theta=5e5, scaling=scaling)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)


def test_llama31_checkpoint_equals_transformers(tmp_path):
    """A Llama 3.1-style checkpoint (llama3 rope scaling) loads into CausalLM with the same
    logits as transformers, and saves back with its rope parameters."""
    ref = hf_model("llama3.1")
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    assert model.config.rope_scaling.factor == 8.0
    err = rel_err(upipe_logits(model), hf_logits(ref))
    assert err < TOL[torch.float32]["fwd"], err
    # without the scaling the logits differ: the test can tell
    plain = CausalLM(dataclasses.replace(model.config, rope_scaling=None))
    plain.load_state_dict(model.state_dict())
    assert rel_err(upipe_logits(plain), hf_logits(ref)) > 1e-3
    save_hf_checkpoint(model, tmp_path / "out", base_config=tmp_path / "hf")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 5e5}
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert torch.equal(hf_logits(back.eval()), hf_logits(ref))
    assert load_hf_checkpoint(tmp_path / "out").config == model.config
