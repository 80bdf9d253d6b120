"""Optional integrations with training frameworks. Nothing here is imported by the core package.

- ``deep_optimizer_states.integrations.hf``: the Hugging Face ``transformers.Trainer`` (needs transformers).
"""
