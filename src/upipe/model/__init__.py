"""Llama-3 / Qwen3-style decoder models (`CausalLM`), their presets, and Hugging Face
checkpoints in and out of them."""

from upipe.model.config import PRESETS, ModelConfig, get_config
from upipe.model.hf_checkpoint import (
    config_from_hf,
    load_hf_checkpoint,
    load_hf_weights,
    save_hf_checkpoint,
)
from upipe.model.llama import CausalLM

__all__ = [
    "PRESETS",
    "CausalLM",
    "ModelConfig",
    "config_from_hf",
    "get_config",
    "load_hf_checkpoint",
    "load_hf_weights",
    "save_hf_checkpoint",
]
