"""Switchyard under other frameworks' MoE layers. Each submodule imports its framework only when
used: `switchyard.integrations.transformers` (Hugging Face transformers >= 5)."""
