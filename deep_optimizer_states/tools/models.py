"""The Llama-style models of our benchmarks (../shared/ANCHORS.md), built with transformers, and a Hugging
Face causal LM made shard by shard from the meta device (drawn, or read from safetensors) for FSDP2."""

from __future__ import annotations

import json
from pathlib import Path

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


def checkpoint_activations(model: nn.Module, reentrant: bool = False) -> None:
    """Turn on a Hugging Face model's activation checkpointing (non-reentrant by default: the one streamed
    gradients allow), by the name transformers has: ``activation_checkpointing_enable`` where it exists
    (``gradient_checkpointing_enable`` is its deprecated alias there, to go in transformers 6), else the old
    one (transformers 4 and earlier 5.x). Reentrant segments also get inputs that require grad, as transformers
    advises: behind a frozen embedding they would otherwise give no gradient (transformers 4.57)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if reentrant:
        model.enable_input_require_grads()


def checkpoints_activations(model: nn.Module) -> bool:
    """Whether a Hugging Face model's activation checkpointing is on (either name of the property)."""
    new = hasattr(type(model), "is_activation_checkpointing")
    return bool(model.is_activation_checkpointing if new else model.is_gradient_checkpointing)


def materialize(model: nn.Module, device: str | torch.device, seed: int = 0,
                weights: str | Path | None = None) -> nn.Module:
    """Give a Hugging Face causal LM built on the meta device (sharded with FSDP2 or not) storage on
    ``device``, each rank only its own shards (no process ever holds the whole model: FSDP2's recipe for
    large models); its rotary embeddings' buffers computed there; params drawn by ``init_shards``, or read
    from the safetensors checkpoint in the directory ``weights`` (``load_shards``). Returns the model."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module a Parameter of its own: tied ones again one
    rebuilt = rebuild_rotary(model, device)
    loaded = load_shards(model, weights) if weights is not None else set()
    if weights is None:
        init_shards(model, model.config.initializer_range, seed)
    unknown = [b for b, _ in model.named_buffers() if b not in rebuilt and b not in loaded]
    if unknown:
        raise ValueError(f"cannot rebuild the buffers {unknown[:4]} of a model made on the meta device (only "
                         "rotary embeddings are rebuilt, and buffers saved in the checkpoint read)")
    return model


def rebuild_rotary(model: nn.Module, device: str | torch.device) -> set[str]:
    """Build every rotary embedding of the model again on ``device`` from its config, in fp32: its buffers
    are computed in __init__ (never on the meta device) and a cast of the model to bf16 rounds them.
    Returns the names of the buffers rebuilt."""
    rebuilt = set()
    for name, module in list(model.named_modules()):
        rotary = getattr(module, "rotary_emb", None)
        if isinstance(rotary, nn.Module):
            with torch.device(device):
                module.rotary_emb = type(rotary)(config=getattr(rotary, "config", None) or model.config)
            rebuilt |= {f"{name}.rotary_emb.{b}".lstrip(".") for b, _ in module.rotary_emb.named_buffers()}
    return rebuilt


def _my_rows(p: torch.Tensor) -> tuple[int, int]:
    """The rows of ``p`` (dim 0) this rank holds: all of them, or its torch.chunk rows of a DTensor (FSDP2)."""
    rows = p.shape[0] if p.dim() else 1
    world, rank = (p.device_mesh.size(), p.device_mesh.get_local_rank()) if hasattr(p, "device_mesh") else (1, 0)
    per_rank = -(-rows // world)  # torch.chunk's chunk size
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


@torch.no_grad()
def load_shards(model: nn.Module, directory: str | Path) -> set[str]:
    """Copy a Hugging Face safetensors checkpoint (``model.safetensors`` or an index of several files) into
    a model materialised empty, sharded with FSDP2 or not: each rank reads only its own rows of each param
    (safetensors slices), so no rank loads the whole model. Returns the buffers read too. Every param must
    be in the files (a tied one once)."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json (a sharded "
                                "load reads safetensors; save the model with save_pretrained(safe_serialization=True))")
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    read, buffers_read = set(), set()
    for file in files:
        with safe_open(str(directory / file), framework="pt") as st:
            for key in st.keys():
                target = params.get(key, buffers.get(key))
                if target is not None and list(st.get_slice(key).get_shape()) != list(target.shape):
                    raise ValueError(f"{directory}: {key} has shape {st.get_slice(key).get_shape()} in the checkpoint "
                                     f"and {list(target.shape)} in the model (another configuration?)")
                if key in params:
                    p = params[key]
                    local = p.to_local() if hasattr(p, "to_local") else p
                    if p.dim():
                        start, end = _my_rows(p)
                        local.copy_(st.get_slice(key)[start:end])
                    else:
                        local.copy_(st.get_tensor(key))
                    read.add(key)
                elif key in buffers:
                    buffers[key].copy_(st.get_tensor(key))
                    buffers_read.add(key)
    missing = sorted(set(params) - read)
    if missing:
        raise ValueError(f"{directory}: {len(missing)} params of the model are not in its checkpoint under their "
                         f"own names, e.g. {missing[:3]}: a checkpoint whose names differ (another prefix, experts "
                         "saved apart that the model fuses) is read only whole: run in one process")
    return buffers_read


BLOCK_ROWS = 256  # init_shards draws each param in blocks of this many rows, each from a generator of its own


@torch.no_grad()
def init_shards(model: nn.Module, std: float, seed: int = 0) -> None:
    """Params drawn from N(0, std) (norm weights 1 and biases 0, as the model's own init), each rank drawing
    only the blocks of rows that overlap its own rows of a DTensor (FSDP2 shards dim 0 as torch.chunk does).
    Each block of ``BLOCK_ROWS`` rows has a generator of its own, so the values do not depend on how the
    rows are split: the same model in one process and on any number of ranks."""
    for index, (name, p) in enumerate(model.named_parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        if name.endswith("norm.weight") or name.endswith(".bias"):
            local.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            continue
        rows = p.shape[0] if p.dim() else 1
        start, end = _my_rows(p)
        mine = local if p.dim() else local.view(1)
        for block in range(start // BLOCK_ROWS, -(-end // BLOCK_ROWS)):
            first = block * BLOCK_ROWS
            generator = torch.Generator().manual_seed((seed * 10_007 + index) * 1_000_003 + block)
            values = torch.empty((min(BLOCK_ROWS, rows - first), *p.shape[1:]), device="cpu")
            values.normal_(0.0, std, generator=generator)
            lo, hi = max(start, first), min(end, first + BLOCK_ROWS)
            mine[lo - start:hi - start].copy_(values[lo - first:hi - first])
