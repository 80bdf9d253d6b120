"""The Llama-style models of our benchmarks (../shared/ANCHORS.md), built with transformers."""

from __future__ import annotations

import torch
from torch import nn

# name: (hidden, layers, vocab). Head dim 128 (64 for tiny), intermediate = 2.75 x hidden rounded to 256.
PRESETS = {
    "tiny": (128, 2, 1000),
    "0.5b": (1536, 14, 32000),
    "1.36b": (2048, 24, 32000),
    "5.2b": (4096, 24, 32000),
    "10b": (5120, 32, 32000),
    "20b": (6144, 42, 32000),  # 19.8B: the paper's largest, for a host with the memory (16 B/param pinned)
}


def llama(preset: str = "tiny", dtype: torch.dtype | None = torch.bfloat16, device: str | torch.device | None = "cpu",
          seed: int = 0) -> nn.Module:
    """A randomly initialised LlamaForCausalLM of the named size, built directly on ``device``.

    ``device=None`` and ``dtype=None`` leave placement and dtype to an enclosing context (DeepSpeed's
    zero.Init partitions the parameters as they are created and must not see them moved afterwards)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown model {preset!r}; choose one of {', '.join(PRESETS)}")
    hidden, layers, vocab = PRESETS[preset]
    head_dim = 64 if hidden < 1024 else 128
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                      num_key_value_heads=hidden // head_dim, intermediate_size=int(hidden * 2.75) // 256 * 256,
                      vocab_size=vocab, max_position_embeddings=2048)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    if device is None:
        model = LlamaForCausalLM(cfg)
    else:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    return model if dtype is None else model.to(dtype)
