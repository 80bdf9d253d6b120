"""The params an optimizer is given: a param group's entries taken as torch takes them, named, and checked
before any host memory is pinned (their dtype, contiguity and device, no two sharing memory, dense
gradients), so that a bad model fails at once with what to change."""

from __future__ import annotations

import torch
from torch import nn

from .core.layout import local

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def normalized_group(param_group: dict) -> dict:
    """``param_group`` with its params as a list of tensors, as torch.optim accepts them (tensors, or
    (name, tensor) pairs: the names kept as ``param_names``); the same Parameter given twice (tied weights,
    under two names) is kept once."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    raw = param_group["params"]
    if isinstance(raw, set):
        raise TypeError("params must be an ordered collection (a list), not a set")
    raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
    named = [x for x in raw if isinstance(x, tuple)]
    if named and len(named) != len(raw):
        raise ValueError("give every param with a name, or none: some param names are missing")
    pairs = named if named else [(None, x) for x in raw]
    seen, params, names = set(), [], []
    for name, p in pairs:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"the optimizer can only optimize tensors, got {type(p).__name__}")
        if id(p) not in seen:  # tied weights (the same Parameter) once
            seen.add(id(p))
            params.append(p)
            names.append(name)
    group = {**param_group, "params": params}
    if named:
        group["param_names"] = names
    return group


def param_names(param_groups: list[dict], module: nn.Module | None) -> list[list[str]]:
    """Per group, each param's name for messages: the one given, else the module's, else its place and shape."""
    module_names = {}
    if module is not None:
        module_names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for gi, g in enumerate(param_groups):
        given = g.get("param_names") or [None] * len(g["params"])
        out.append([n or module_names.get(id(p)) or f"{gi}.{i} (shape {tuple(p.shape)})"
                    for i, (n, p) in enumerate(zip(given, g["params"]))])
    return out


def trainable_params(param_groups: list[dict], names: list[list[str]]) -> list[tuple[list[torch.Tensor], list[str]]]:
    """Per group, the params that get host memory, with their names: those that require a gradient (torch
    never updates the others; a LoRA's frozen base model must not cost 16 bytes per param of host memory)."""
    return [([p for p in g["params"] if p.requires_grad],
             [n for n, p in zip(group_names, g["params"]) if p.requires_grad])
            for g, group_names in zip(param_groups, names)]


def checked_device(param_groups: list[dict], names: list[list[str]], device: str | torch.device | None) -> torch.device:
    """The one device of the trainable params, after refusing what the optimizer cannot keep a master of."""
    given = [(n, p) for g, gn in zip(param_groups, names) for n, p in zip(gn, g["params"])]
    for name, p in given:
        if p.dtype not in SUPPORTED_DTYPES and (p.requires_grad or not p.is_floating_point()):
            raise TypeError(f"param {name} has dtype {p.dtype}; DeepOptimizerStates supports float32, bfloat16 "
                            "and float16 params (fp32 masters). Convert it, or leave it out of the optimizer")
    params = [(n, p) for n, p in given if p.requires_grad]
    if not params:
        raise ValueError("no trainable params: every param has requires_grad=False")
    for name, p in params:
        if not local(p).is_contiguous():
            raise ValueError(f"param {name} is not contiguous: make it so before building the optimizer "
                             "(with torch.no_grad(): p.data = p.data.contiguous())")
    _refuse_overlapping(params)
    devices = sorted({str(local(p).device) for _, p in params})
    if len(devices) > 1:
        raise ValueError(f"params are on several devices ({', '.join(devices)}); move the model to one device "
                         "first (one optimizer per GPU)")
    found = local(params[0][1]).device
    if device is not None and torch.device(device) != found and str(torch.device(device)) != found.type:
        raise ValueError(f"device={str(device)!r} but the params are on {found}; move the model there or "
                         "drop the device argument")
    return found

def _refuse_overlapping(params: list[tuple[str, torch.Tensor]]) -> None:
    """Two params viewing the same memory would each keep a master of it, and the last written would win
    (torch's AdamW applies both updates in turn): refused. Disjoint views of one buffer are fine."""
    spans = sorted((t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
                    (t.storage_offset() + t.numel()) * t.element_size(), name)
                   for name, p in params if (t := local(p)).numel())
    for (base, _, end, name), (base2, start2, _, name2) in zip(spans, spans[1:]):
        if base == base2 and start2 < end:
            raise ValueError(f"params {name} and {name2} share memory: each would keep its own fp32 master of "
                             "it, so one's update would undo the other's. Tie them as one Parameter (as tied "
                             "embeddings are), or give each its own storage")


def refuse_sparse_modules(module: nn.Module) -> None:
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise ValueError(f"module {name or type(m).__name__} has sparse=True: DeepOptimizerStates (like torch's "
                             "fused AdamW) needs dense gradients; build it with sparse=False")
