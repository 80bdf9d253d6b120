"""state_dict / load_state_dict for DeepOptimizerStates.

The format is torch.optim.AdamW's (``state[i] = {step, exp_avg, exp_avg_sq}`` for every param that has
taken a step, ``param_groups`` with param indices) plus ``master_param`` (the fp32 master weight) per param
and a ``dos`` entry for the loss scaler. So a torch AdamW (or Adam) checkpoint loads into us (masters then
come from the model's params) and ours into torch. Loading validates the whole dict first: a mismatch or a
corrupt value (a NaN moment, a negative ``exp_avg_sq``) raises before any buffer is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import TYPE_CHECKING

import torch

from .core.adam import check_group
from .core.layout import DTensor, local

if TYPE_CHECKING:
    from .optimizer import DeepOptimizerStates

FORMAT_VERSION = 2
_MOMENTS = ("exp_avg", "exp_avg_sq")


def pack(opt: "DeepOptimizerStates") -> dict:
    """Per-param views of the live host buffers (as torch's own state_dict: copy it to keep a snapshot);
    under FSDP2, DTensors over those views."""
    state, groups, index = {}, [], 0
    for group in opt.param_groups:
        ids = []
        for p in group["params"]:
            live = opt.state.get(p)
            if live:  # as torch: no entry before a param's first step
                state[index] = {"step": live["step"],  # live, as the moments: a loaded-back sd is consistent
                                **{k: _like(p, live[k]) for k in _MOMENTS}, "master_param": _like(p, live["master"])}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups, "dos": dos_entry(opt)}


def dos_entry(opt: "DeepOptimizerStates") -> dict:
    """Ours beyond torch's layout: the format version, the loss scaler, the skipped steps."""
    scaler = opt.scaler.state_dict() if opt.scaler is not None else None
    return {"version": FORMAT_VERSION, "loss_scaler": scaler, "skipped_steps": opt.skipped_steps}


def _like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A state tensor as the param is: sharded like it under FSDP2 (so torch.distributed.checkpoint saves and
    reshards it), the host view itself otherwise. The DTensor wraps the host view where it is, as FSDP2's
    CPU offload does (``DTensor.from_local`` would copy it to the mesh's GPU: all the states at once)."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(p.device_mesh, tuple(p.placements), TensorMeta(p.shape, p.stride(), t.dtype))
        return DTensor(t, spec, requires_grad=False)
    return t


def _count(value, what: str) -> int:
    """A saved count (a step, skipped steps): an int, a whole float or a one-element tensor of them, >= 0;
    anything else (a bool, a string, inf, 2.5, -1) is a corrupt state_dict."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real):  # numpy's scalars too, as torch takes them
        raise ValueError(f"{what} is {value!r}, not a whole number >= 0: the state_dict is corrupt")
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"{what} is {value}, not a whole number >= 0: the state_dict is corrupt")
    return int(value)


def _step_count(idx, entry: dict) -> int:
    return _count(entry["step"], f"param {idx}: step")


def _check_entry(idx, entry: dict, p: torch.Tensor) -> int:
    """Validate one param's saved state against the param; return its step count."""
    if not isinstance(entry, Mapping) or any(k not in entry for k in (*_MOMENTS, "step")):
        raise ValueError(f"param {idx}: state_dict entry lacks step/exp_avg/exp_avg_sq")
    shape = tuple(local(p).shape)
    for key in (*_MOMENTS, "master_param"):
        if key not in entry:
            continue
        t = entry[key]
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise ValueError(f"param {idx} ({key}): expected a floating-point tensor, got {type(t).__name__}")
        t = local(t)
        if tuple(t.shape) != shape:
            raise ValueError(f"param {idx} ({key}): state_dict shape {tuple(t.shape)} does not match the param's "
                             f"shape {shape}: was it saved for another model?")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"param {idx} ({key}) holds inf/nan: the state_dict is corrupt")
        if key == "exp_avg_sq" and bool((t < 0).any()):
            raise ValueError(f"param {idx} (exp_avg_sq) holds negative values: the state_dict is corrupt")
    return _step_count(idx, entry)


def check(opt: "DeepOptimizerStates", sd: dict) -> None:
    """Raise ValueError on the first mismatch or corrupt value, before anything is written."""
    if not isinstance(sd, Mapping) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("not an optimizer state_dict: expected the keys 'state' and 'param_groups'")
    saved_groups, state = sd["param_groups"], sd["state"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(opt.param_groups)}")
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if "betas" not in saved:
            raise ValueError(f"param group {gi} of the state_dict has no 'betas': it is not an Adam or AdamW "
                             "state_dict (another optimizer's would start every moment from zero)")
        check_group({**group, **saved})
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"param group {gi}: state_dict has {len(saved['params'])} params, "
                             f"this optimizer {len(group['params'])}: was it saved for another model?")
        for idx, p in zip(saved["params"], group["params"]):
            entry = state.get(idx, state.get(str(idx)))
            if entry and id(p) in opt.layout.where:  # {} (a param without a step yet): no state, as torch
                _check_entry(idx, entry, p)
    check_dos(sd.get("dos") or {})


def check_dos(dos: object) -> None:
    """Raise ValueError if ``dos`` (a state_dict's ``dos`` entry) is not one this code can load."""
    if not isinstance(dos, Mapping):
        raise ValueError(f"state_dict['dos'] is {type(dos).__name__}, not our entry: the state_dict is corrupt")
    version = dos.get("version", FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"state_dict['dos'] has format version {version!r}, this code reads up to "
                         f"{FORMAT_VERSION}: upgrade deep_optimizer_states to load it")
    if "skipped_steps" in dos:
        _count(dos["skipped_steps"], "state_dict['dos']['skipped_steps']")
    scaler = dos.get("loss_scaler")
    if scaler is not None:
        _check_scaler(scaler)


def _check_scaler(scaler) -> None:
    """A loss scaler's saved state: a finite scale > 0 and whole counts >= 0."""
    what = f"state_dict['dos']['loss_scaler'] is not a loss scaler's state: {scaler!r}"
    if not isinstance(scaler, Mapping) or "scale" not in scaler or "clean_steps" not in scaler:
        raise ValueError(what)
    scale = scaler["scale"]
    if isinstance(scale, bool) or not isinstance(scale, Real) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(what)
    for key in ("clean_steps", "skipped_steps"):
        if key in scaler:
            _count(scaler[key], f"state_dict['dos']['loss_scaler']['{key}']")


@torch.no_grad()
def load(opt: "DeepOptimizerStates", sd: dict) -> None:
    check(opt, sd)
    for saved, group in zip(sd["param_groups"], opt.param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    where, loaded = opt.layout.where, []
    for saved, group in zip(sd["param_groups"], opt.param_groups):
        for idx, p in zip(saved["params"], group["params"]):
            if id(p) not in where:  # frozen when the optimizer was built: it has no state to load into
                continue
            b, i = where[id(p)]
            entry = sd["state"].get(idx, sd["state"].get(str(idx))) or {}
            live = opt.layout.views(p)
            for key in _MOMENTS:
                if key in entry:
                    live[key].copy_(local(entry[key]))
                else:
                    live[key].zero_()
            if "master_param" in entry:  # the params stay as they are (as torch's load): see recheck
                live["master"].copy_(local(entry["master_param"]))
                loaded.append(p)
            else:  # a torch checkpoint: the model's weights are the masters (later edits are taken too)
                opt.layout.take_param(b, i)
            b.steps[i] = _step_count(idx, entry) if entry else 0
            b.step_tensors[i].fill_(b.steps[i])
    opt.layout.record_writes()
    opt.layout.recheck(loaded)
    opt._expose_state()
    load_dos(opt, sd.get("dos") or {})


def load_dos(opt: "DeepOptimizerStates", dos: Mapping) -> None:
    """The loss scaler and skipped steps of a ``dos`` entry that ``check_dos`` passed."""
    if dos.get("loss_scaler") is not None and opt.scaler is not None:
        opt.scaler.load_state_dict(dos["loss_scaler"])
    if "skipped_steps" in dos:
        opt.skipped_steps = _count(dos["skipped_steps"], "skipped_steps")
