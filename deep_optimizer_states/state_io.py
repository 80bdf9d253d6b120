"""state_dict / load_state_dict for DeepOptimizerStates.

The format is torch.optim.AdamW's (``state[i] = {step, exp_avg, exp_avg_sq}``, ``param_groups`` with param
indices) plus ``master_param`` (the fp32 master weight) per param and a ``dos`` entry for the loss scaler.
So a torch AdamW checkpoint loads into us (masters are then taken from the model's params), and ours into
torch AdamW. Loading validates the whole dict first: a mismatch raises before any buffer is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .adam import check_group

if TYPE_CHECKING:
    from .optimizer import DeepOptimizerStates

FORMAT_VERSION = 1
_MOMENTS = ("exp_avg", "exp_avg_sq")


def pack(opt: "DeepOptimizerStates") -> dict:
    """Per-param views of the live host buffers (as torch's own state_dict, copy it to keep a snapshot)."""
    state, groups, index = {}, [], 0
    for gi, group in enumerate(opt.param_groups):
        ids = []
        for p in group["params"]:
            live = opt.state[p]
            state[index] = {"step": torch.tensor(float(opt._steps[gi])), "exp_avg": live["exp_avg"],
                            "exp_avg_sq": live["exp_avg_sq"], "master_param": live["master"]}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    scaler = opt.scaler.state_dict() if opt.scaler is not None else None
    return {"state": state, "param_groups": groups, "dos": {"version": FORMAT_VERSION, "loss_scaler": scaler}}


def _check(opt: "DeepOptimizerStates", sd: dict) -> list[int]:
    """Raise ValueError on the first mismatch; return each group's step count."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("not an optimizer state_dict: expected the keys 'state' and 'param_groups'")
    saved_groups, state = sd["param_groups"], sd["state"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(opt.param_groups)}")
    steps = []
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        check_group({**group, **saved})
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"param group {gi}: state_dict has {len(saved['params'])} params, "
                             f"this optimizer {len(group['params'])}: was it saved for another model?")
        group_steps = set()
        for idx, p in zip(saved["params"], group["params"]):
            entry = state.get(idx, state.get(str(idx)))
            if entry is None:
                group_steps.add(0)
                continue
            for key in (*_MOMENTS, "master_param"):
                if key in entry and not (isinstance(entry[key], torch.Tensor) and entry[key].is_floating_point()):
                    raise ValueError(f"param {idx} ({key}): expected a floating-point tensor, got "
                                     f"{type(entry[key]).__name__}")
                if key in entry and tuple(entry[key].shape) != tuple(p.shape):
                    raise ValueError(f"param {idx} ({key}): state_dict shape {tuple(entry[key].shape)} does not "
                                     f"match the param's shape {tuple(p.shape)}: was it saved for another model?")
            if any(k not in entry for k in (*_MOMENTS, "step")):
                raise ValueError(f"param {idx}: state_dict entry lacks step/exp_avg/exp_avg_sq")
            group_steps.add(int(float(entry["step"])))
        if len(group_steps) > 1:
            raise ValueError(f"param group {gi}: params have different step counts {sorted(group_steps)}; "
                             "DeepOptimizerStates steps a whole group together")
        steps.append(group_steps.pop() if group_steps else 0)
    return steps


def load(opt: "DeepOptimizerStates", sd: dict) -> None:
    steps = _check(opt, sd)
    for saved, group in zip(sd["param_groups"], opt.param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    with torch.no_grad():
        for saved, group in zip(sd["param_groups"], opt.param_groups):
            for idx, p in zip(saved["params"], group["params"]):
                entry = sd["state"].get(idx, sd["state"].get(str(idx)))
                live = opt.state[p]
                entry = entry or {}
                for key in _MOMENTS:
                    if key in entry:
                        live[key].copy_(entry[key])
                    else:
                        live[key].zero_()
                live["master"].copy_(entry.get("master_param", p.detach()))
                p.copy_(live["master"])  # the model's params are the masters, rounded
    for gi, n in enumerate(steps):
        opt._steps[gi] = n
        opt._step_tensors[gi].fill_(n)
    scaler = (sd.get("dos") or {}).get("loss_scaler")
    if scaler is not None and opt.scaler is not None:
        opt.scaler.load_state_dict(scaler)
