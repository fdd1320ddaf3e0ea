"""Llama-3 / Qwen3-style decoder models (`CausalLM`) and their presets."""

from upipe.model.config import PRESETS, ModelConfig, get_config
from upipe.model.llama import CausalLM

__all__ = ["PRESETS", "CausalLM", "ModelConfig", "get_config"]
