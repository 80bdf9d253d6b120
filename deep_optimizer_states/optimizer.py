"""DeepOptimizerStates: AdamW with fp32 states in pinned host memory, updated interleaved on the CPU and GPU."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from . import state_io
from .adam import AdamHyper, check_group
from .engine import Engine, Job, UpdateStats
from .grad_scaling import DynamicLossScaler, clip_coefficient, total_norm
from .layout import Layout
from .plan import Plan, Planner
from .schedule import Placement, Schedule

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _frozen(p) -> bool:
    """A floating-point tensor that needs no gradient: torch's AdamW never updates it, so we leave it out."""
    return isinstance(p, torch.Tensor) and p.is_floating_point() and not p.requires_grad


class DeepOptimizerStates(torch.optim.Optimizer):
    """AdamW (or Adam) whose fp32 master weights and moments live in pinned host memory.

    Params must share one device (a GPU, or the CPU for testing). They become views into flat per-bucket
    device buffers, and their grads views into flat grad buffers. Each step updates the subgroups either
    on the CPU or staged through the GPU, as ``schedule`` says: "cpu" (ZeRO-Offload), "gpu" (every subgroup
    staged), an int k (one subgroup in every k staged), or "auto".

    Results equal ``torch.optim.AdamW(fused=True)`` applied to fp32 master weights; bf16/fp16 params hold
    the masters rounded to their dtype. ``zero_grad`` zeroes the flat grad buffers in place (``set_to_none``
    is accepted for compatibility; grads stay allocated, and a param whose grad is missing at ``step`` is
    updated with a zero gradient). fp16 params use dynamic loss scaling: backpropagate
    ``opt.scale_loss(loss)``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict] | nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        adamw: bool = True,
        subgroup_size: int = 25_000_000,
        schedule: Schedule = "auto",
        max_grad_norm: float | None = None,
        loss_scale: str | float | None = "auto",
        staging_slots: int = 2,
        device: str | torch.device | None = None,
    ) -> None:
        self.module = params if isinstance(params, nn.Module) else None
        if self.module is not None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        if isinstance(subgroup_size, bool) or not isinstance(subgroup_size, int) or subgroup_size <= 0:
            raise ValueError(f"subgroup_size must be an int > 0 (elements per subgroup), got {subgroup_size!r}")
        if isinstance(staging_slots, bool) or not isinstance(staging_slots, int) or staging_slots < 1:
            raise ValueError(f"staging_slots must be an int >= 1, got {staging_slots!r}")
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a finite float > 0 or None, got {max_grad_norm!r}")
        self.layout: Layout | None = None
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.adamw = adamw
        self.max_grad_norm = max_grad_norm
        self.device = self._check_params(device)
        self.layout = Layout(self.param_groups, subgroup_size, self.device)
        self.engine = Engine(self.device)
        self.planner = Planner([sg.numel for sg in self.layout.subgroups], self.device, staging_slots)
        self.schedule = schedule
        self.scaler = self._make_scaler(loss_scale)
        self._steps = [0] * len(self.param_groups)
        self._step_tensors = [torch.zeros(()) for _ in self.param_groups]
        self._scaled_since_step = False
        self._clip_once: float | None = None
        self._norm_cache: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.last_update: UpdateStats | None = None
        self._expose_state()

    # ---- construction -------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Validate and add a group; only during construction (the flat layout is built once)."""
        if getattr(self, "layout", None) is not None:
            raise RuntimeError("DeepOptimizerStates packs its params once: add_param_group after construction is "
                               "not supported; build a new optimizer with all param groups")
        if isinstance(param_group.get("params"), torch.Tensor):
            param_group["params"] = [param_group["params"]]
        unique = list(dict.fromkeys(param_group["params"]))  # tied weights (the same Parameter) once
        param_group = {**param_group, "params": [p for p in unique if not _frozen(p)]}
        super().add_param_group(param_group)
        check_group(self.param_groups[-1])

    def _check_params(self, device: str | torch.device | None) -> torch.device:
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            raise ValueError("no trainable params: every param has requires_grad=False")
        names = {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else {}
        for p in params:
            if p.dtype not in SUPPORTED_DTYPES:
                name = names.get(id(p), f"of shape {tuple(p.shape)}")
                raise TypeError(f"param {name} has dtype {p.dtype}; DeepOptimizerStates supports float32, bfloat16 "
                                "and float16 params (fp32 masters). Convert it, or leave it out of the optimizer")
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise ValueError(f"params are on several devices ({', '.join(devices)}); move the model to one device "
                             "first (one optimizer per GPU)")
        found = params[0].device
        if device is not None and torch.device(device) != found and str(torch.device(device)) != found.type:
            raise ValueError(f"device={str(device)!r} but the params are on {found}; move the model there or "
                             "drop the device argument")
        return found

    def _make_scaler(self, loss_scale: str | float | None) -> DynamicLossScaler | None:
        fp16 = any(b.param_flat.dtype == torch.float16 for b in self.layout.buckets)
        if loss_scale == "auto":
            return DynamicLossScaler() if fp16 else None
        if loss_scale == "dynamic":
            return DynamicLossScaler()
        if loss_scale is None:
            return None
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0:
            return DynamicLossScaler(init_scale=float(loss_scale))
        raise ValueError(f"loss_scale must be 'auto', 'dynamic', None or a float > 0, got {loss_scale!r}")

    def _expose_state(self) -> None:
        """opt.state[p] holds views into the host buffers, as torch's AdamW holds its tensors."""
        for b in self.layout.buckets:
            step = self._step_tensors[b.group_index]
            for i, p in enumerate(b.params):
                s = b.param_slice(i)
                self.state[p] = {"step": step, **{k: getattr(b, k)[s].view(p.shape)
                                                  for k in ("exp_avg", "exp_avg_sq", "master")}}

    # ---- schedule -----------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @schedule.setter
    def schedule(self, value: Schedule) -> None:
        self.planner.plan(value)

    @property
    def plan(self) -> Plan:
        """Where each subgroup is updated now, with the performance model's prediction when it has one."""
        return self.planner.current

    @property
    def placements(self) -> list[Placement]:
        return list(self.plan.placements)

    # ---- the training-loop API ----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: multiplied by the loss scale for fp16 params, unchanged otherwise."""
        if self.scaler is None:
            return loss
        self._scaled_since_step = True
        return loss * self.scaler.scale

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients to global L2 norm ``max_norm`` (applied in ``step``); returns the norm."""
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"max_norm must be a finite float > 0, got {max_norm!r}")
        self.layout.sync_grads()
        self._norm_cache = total_norm(self.layout.grad_views())
        self._clip_once = float(max_norm)
        return self._norm_cache / self.scaler.scale if self.scaler is not None else self._norm_cache

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One AdamW step for every param; returns when params and states are all updated."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            check_group(group)
        self.layout.sync_grads()
        multipliers = self._grad_multipliers()
        if multipliers is None:  # fp16 overflow: nothing updated, the scale backed off
            return loss
        hyper = [AdamHyper.from_group(g, self.adamw) for g in self.param_groups]
        plan = self.planner.refresh()
        jobs = [Job(sg, place, hyper[sg.group_index], self._steps[sg.group_index])
                for sg, place in zip(self.layout.subgroups, plan.placements)]
        self.last_update = self.engine.update(jobs, multipliers, max(plan.slots, 1))
        self.planner.observe(self.last_update)
        for gi in range(len(self._steps)):
            self._steps[gi] += 1
            self._step_tensors[gi].fill_(self._steps[gi])
        return loss

    def _grad_multipliers(self) -> list[torch.Tensor] | None:
        """Unscale and clip factors for this step, or None when fp16 gradients overflowed."""
        clip = self._clip_once if self._clip_once is not None else self.max_grad_norm
        raw, self._norm_cache, self._clip_once = self._norm_cache, None, None
        if self.scaler is None and clip is None:
            return []
        if raw is None:
            raw = total_norm(self.layout.grad_views())
        norm, multipliers = raw, []
        if self.scaler is not None:
            if not self._scaled_since_step:
                raise RuntimeError("fp16 params need a scaled loss: call opt.scale_loss(loss).backward() "
                                   "(or pass loss_scale=None to DeepOptimizerStates to train unscaled)")
            self._scaled_since_step = False
            inv_scale = 1.0 / self.scaler.scale
            finite = bool(torch.isfinite(raw))
            self.scaler.update(found_inf=not finite)
            if not finite:
                self.last_grad_norm = raw
                return None
            multipliers.append(torch.full((), inv_scale, device=self.device))
            norm = raw * inv_scale
        if clip is not None:
            multipliers.append(clip_coefficient(norm, clip))
        self.last_grad_norm = norm
        return multipliers

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (in place, whatever ``set_to_none`` says)."""
        self.layout.zero_grad()
        self._norm_cache = None

    # ---- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's layout (per-param step/exp_avg/exp_avg_sq) plus fp32 ``master_param`` and the loss scaler."""
        return state_io.pack(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of ours (or of torch.optim.AdamW); validated whole before anything is written."""
        state_io.load(self, state_dict)
