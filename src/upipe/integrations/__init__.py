"""Integrations with other libraries. Each submodule imports its library only when imported
itself (`upipe.integrations.hf` needs the `hf` extra only to build models, not to import)."""
