"""The Adam/AdamW math for one subgroup, on whichever device holds its tensors.

We call torch's own functional optimizer with ``fused=True``: the same kernels as
``torch.optim.AdamW(fused=True)`` on the CPU and on the GPU, so results match torch by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch
from torch.optim.adam import adam as _adam
from torch.optim.adamw import adamw as _adamw


def check_group(group: dict) -> None:
    """Raise a ValueError naming the bad value, so a typo never reaches the states. Any real number is
    taken (numpy's float32, which a LambdaLR multiplying by one leaves, as torch takes it)."""
    lr, eps, wd, betas = group["lr"], group["eps"], group["weight_decay"], group["betas"]
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr must be a Python float (tensor lr is not supported); got a tensor")
    if not (isinstance(lr, Real) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite float >= 0, got {lr!r}")
    if not (isinstance(eps, Real) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    if not (isinstance(wd, Real) and math.isfinite(wd) and wd >= 0):
        raise ValueError(f"weight_decay must be a finite float >= 0, got {wd!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, Real) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(key):
            raise ValueError(f"{key}=True is not supported by DeepOptimizerStates")


@dataclass(frozen=True)
class AdamHyper:
    """One param group's hyper-parameters, read at the start of each step (LR schedulers change them)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (decoupled weight decay) when True, classic Adam with L2 when False

    @classmethod
    def from_group(cls, group: dict, decoupled: bool) -> "AdamHyper":
        """``decoupled`` unless the group says otherwise (torch's ``decoupled_weight_decay``: a loaded
        torch.optim.Adam checkpoint keeps its L2 decay, as it would in torch)."""
        b1, b2 = group["betas"]
        return cls(float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                   bool(group.get("decoupled_weight_decay", decoupled)))


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                steps_done: int, h: AdamHyper) -> None:
    """Update fp32 ``param``, ``exp_avg``, ``exp_avg_sq`` in place for step number ``steps_done + 1``."""
    step = torch.full((), float(steps_done), dtype=torch.float32, device=param.device)  # the kernel adds 1
    fn = _adamw if h.decoupled else _adam
    fn([param], [grad], [exp_avg], [exp_avg_sq], [], [step], fused=True, amsgrad=False, beta1=h.beta1,
       beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps, maximize=False)
