"""The plan of a Hugging Face model (`upipe plan --hf-config`, `upipe.planner.hf`): its
simulated peak equals a real run's, the memory options move it as their formulas say, the
shipped configs load, bad input is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tiers import matrix

from upipe.cli import main
from upipe.planner.hf import (
    CONFIGS,
    SHIPPED,
    HFStepSimulator,
    build_config,
    hf_settings,
    load_hf_config,
    shapes,
)
from upipe.train import TrainConfig

# a small Llama / Qwen3: 8 query and 4 kv heads of 8, 4 layers; the MLP and the vocabulary
# wider than D, so that their buffers stand out
TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
    intermediate_size=192, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    vocab_size=1024,
)  # fmt: skip
TINY_QWEN3 = {**TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 8}
FEATURES = dict(
    tiled_mlp=True, mlp_tile=128, chunked_loss=True, loss_chunk=128, activation_checkpoint=True
)  # fmt: skip


def candidate(world=2, dtype="bfloat16", **kw) -> TrainConfig:
    base = dict(strategy="upipe", nproc=world, fsdp=True, dtype=dtype, master_dtype=dtype)
    base.update(heads_per_stage=world, seq_len=1024)
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize(
    "hf,kw",
    matrix(
        [(TINY, {}), (TINY_QWEN3, {**FEATURES, "blocks_per_checkpoint": 2})],
        ["plain", "qwen3-features"],
        default={"qwen3-features"},
    ),
)
def test_simulated_peak_equals_real_run(clusters, hf, kw):
    """The model of `hf` converted, sharded and stepped for real on 2 gloo ranks (fp32, the
    planner's own `build_model` and `HFJob`) and simulated under fake tensors with the CPU
    kernels: the simulated peak within 2% of the larger rank's measured one."""
    from plan_hf_workers import real_hf_peak

    seq_lens = [512, 2048]
    cfg = candidate(dtype="float32", **kw)
    kw = {k: getattr(cfg, k) for k in ("strategy", "nproc", "fsdp", "dtype", "master_dtype")}
    kw.update({k: getattr(cfg, k) for k in (*FEATURES, "heads_per_stage", "blocks_per_checkpoint")})
    per_rank = clusters(2).run(real_hf_peak, kw, hf, seq_lens)
    real = [max(p) for p in zip(*per_rank, strict=True)]
    with HFStepSimulator(cfg, 2, hf, kernels="cpu") as sim:
        simulated = [sim.step(S).peak_bytes for S in seq_lens]
    for r, s in zip(real, simulated, strict=True):
        assert abs(s - r) <= 0.02 * r, (real, simulated)


def slopes(S=(16384, 32768), **kw):
    """Device and host bytes per token of a rank (d peak / d L) of `candidate(**kw)` on 2
    ranks, simulated (CUDA kernels) between two lengths; and the last step's memory."""
    with HFStepSimulator(candidate(**kw), 2, {**TINY, "num_hidden_layers": 3}) as sim:
        a, b = (sim.step(n) for n in S)
    L = (S[1] - S[0]) // 2
    return (b.peak_bytes - a.peak_bytes) / L, (b.host_peak_bytes - a.host_peak_bytes) / L, b


@pytest.mark.slow
@pytest.mark.exhaustive  # (the default run: the simulated peak with the options = a real run's)
def test_options_move_the_peak_as_their_formulas_say():
    """Per token of a rank, bf16 (e = 2 bytes), D = 64, F = 192, V = 1024, 3 layers:
    - offload: the host holds the arena of the n = 3 checkpointed inputs (n D e exactly),
      and the device no more than it did (the inputs now come back one at a time);
    - keep_on_gpu=1: one input less on the host (D e exactly), at most D e more on the device;
    - chunked_loss: without it the [L, V] logits exist, with their fp32 copy (6 V), and the
      log-softmax and the gradients in both dtypes on top (at most 2 + 4 + 4 + 4 + 2 = 16 V);
    - tiled_mlp: without it the [L, F] gate, up and activation are saved (3 F e), and at
      most the product and the norm's fp32 copies on top (4 F e + 4 D 4)."""
    D, F, V, e, n = 64, 192, 1024, 2, 3
    on, on_host, _ = slopes(**FEATURES)
    assert on_host == 0
    off, off_host, m = slopes(**FEATURES, offload=True)
    assert off_host == n * D * e and off <= on
    assert m.host_peak_bytes == n * D * e * 32768 // 2  # the arena, no more
    kept, kept_host, _ = slopes(**FEATURES, offload=True, keep_on_gpu=1)
    assert kept_host == (n - 1) * D * e and off <= kept <= off + D * e
    no_loss, _, _ = slopes(**{**FEATURES, "chunked_loss": False})
    assert 6 * V <= no_loss - on <= 16 * V, (no_loss - on) / V
    no_mlp, _, _ = slopes(**{**FEATURES, "tiled_mlp": False})
    assert 3 * F * e <= no_mlp - on <= 4 * F * e + 4 * D * 4, (no_mlp - on) / (F * e)


@pytest.mark.parametrize("name", sorted(n for n in SHIPPED if not n.startswith("qwen3-next")))
def test_shipped_configs_load(name):
    """Each shipped config of a dense model loads, becomes transformers' config and model
    (one layer, on the meta device), whose parameters are those of its shapes (plus Qwen2's
    q/k/v biases). (The hybrid's: tests/distributed/test_plan_hybrid.py.)"""
    import transformers

    hf = load_hf_config(name)
    model_shape = shapes(hf)
    config = build_config(hf, n_layers=1)
    assert config.num_hidden_layers == 1 and type(config).__name__.lower().startswith(
        hf["model_type"].replace(".", "")
    )
    with torch.device("meta"):
        model = getattr(transformers, hf["architectures"][0])(config)
    one = dataclasses.replace(model_shape, n_layers=1)
    H, G, d = one.n_heads, one.n_kv_heads, one.head_dim
    biases = (H + 2 * G) * d if hf["model_type"] == "qwen2" else 0
    assert sum(p.numel() for p in model.parameters()) == one.num_params() + biases


def test_llama_31_has_the_shapes_of_the_own_preset():
    """The own-model plan of llama3-8b and the HF plan of llama-3.1-8b compare like with like:
    the same shapes (the RoPE scaling aside, which changes no tensor's size)."""
    from upipe.model import get_config

    own = get_config("llama3-8b")
    hf = shapes(load_hf_config("llama-3.1-8b"))
    assert dataclasses.replace(hf, rope_theta=own.rope_theta, norm_eps=own.norm_eps) == own


def test_configs_are_package_data():
    """pyproject ships every file under planner/configs (the JSONs and their README)."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["upipe.planner"]
    files = sorted(p.name for p in CONFIGS.iterdir())
    assert files == sorted(p.name for pat in patterns for p in CONFIGS.glob(pat.split("/")[1]))
    assert set(SHIPPED.values()) <= set(files)


def test_hf_settings_carry_the_options():
    kw = dict(
        strategy="upipe", nproc=8, fsdp=True, dtype="bfloat16", master_dtype="bfloat16",
        heads_per_stage=8, **FEATURES, blocks_per_checkpoint=2, offload=True, fsdp_offload=True,
    )  # fmt: skip
    out = hf_settings(kw, 8, 2**20)
    assert out["context_parallel"] == dict(
        strategy="upipe", heads_per_stage=8, **FEATURES, blocks_per_checkpoint=2, offload=True
    )
    assert out["training_arguments"]["fsdp_config"]["cpu_offload"] is True
    assert "fsdp_offload_params: true" in out["accelerate"]
    assert out["torchrun"].startswith("torchrun --standalone --nproc-per-node 8")


def _plan_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args, "--gpus", "2", "--jobs", "1"])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_cli_errors(capsys, tmp_path):
    assert "not a shipped config" in _plan_error(capsys, "--hf-config", "nope-7b")
    partial = {k: v for k, v in TINY.items() if k not in ("vocab_size", "hidden_size")}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    err = _plan_error(capsys, "--hf-config", str(tmp_path / "partial.json"))
    assert "missing hidden_size, vocab_size" in err
    gpt2 = {**TINY, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    err = _plan_error(capsys, "--hf-config", str(tmp_path))  # a directory: its config.json
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err
    err = _plan_error(capsys, "--hf-config", "llama-3.1-8b", "--strategies", "none", "upipe")
    assert "--strategies none" in err
    assert "--no-fsdp" in _plan_error(capsys, "--hf-config", "llama-3.1-8b", "--no-fsdp")


def test_simulator_refuses_what_the_hf_path_does_not_run():
    for kw, words in [
        (dict(strategy="none"), "strategy 'none'"),
        (dict(master_dtype="float32"), "--master-dtype float32"),
        (dict(fsdp=False), "--no-fsdp"),
    ]:
        with pytest.raises(ValueError, match=words):
            HFStepSimulator(candidate(**kw), 2, TINY)
