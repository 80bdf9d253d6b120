"""The exactness reference: torch.optim.AdamW (or Adam) on fp32 master copies, fed our gradients.

Used by the tests, by ``dos train --check`` and by the benchmarks: every speed-up is compared to it.
"""

from __future__ import annotations

import torch

from .core.grad_scaling import total_norm
from .core.layout import local
from .optimizer import DeepOptimizerStates

_NOT_COPIED = ("params", "initial_lr", "param_names", "fused", "foreach")  # the reference always runs fused


class ReferenceAdamW:
    """torch's fused optimizer over fp32 copies of ``opt``'s masters, with the same param groups."""

    def __init__(self, opt: DeepOptimizerStates, cls: type[torch.optim.Optimizer] | None = None,
                 scheduler=None) -> None:
        self.ours = opt
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        groups = []
        for g in opt.param_groups:
            copies = []
            for p in g["params"]:
                if id(p) not in opt.layout.where:  # frozen when ``opt`` was built: neither optimizer updates it
                    continue
                m = opt.master(p).detach().to(local(p).device, copy=True).requires_grad_(True)
                self.masters[p] = m
                copies.append(m)
            groups.append({**{k: v for k, v in g.items() if k not in _NOT_COPIED}, "params": copies})
        cls = cls or (torch.optim.AdamW if opt.adamw else torch.optim.Adam)
        self.opt = cls(groups, fused=True)
        self.scheduler = scheduler(self.opt) if scheduler else None

    @torch.no_grad()
    def step(self, max_norm: float | None = None, unscale: float = 1.0) -> torch.Tensor | None:
        """Step on our current gradients (as fp32, times ``unscale``), clipped to ``max_norm``; returns the norm."""
        for p, m in self.masters.items():  # a param without a gradient is skipped by torch, as by us
            g = local(p.grad)
            m.grad = None if g is None else g.detach().to(torch.float32, copy=True).to(m.device) * unscale
        norm = self._clip(max_norm) if max_norm else None
        self.opt.step()
        if self.scheduler:
            self.scheduler.step()
        return norm

    def _clip(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the masters; under FSDP2 the masters are this rank's shards,
        so the squares are summed over the ranks first (as torch's clipping of DTensors does)."""
        grads = [m.grad for m in self.masters.values() if m.grad is not None]
        if self.ours.group is None:
            return torch.nn.utils.clip_grad_norm_(list(self.masters.values()), max_norm)
        norm = total_norm(grads, self.ours.device, self.ours.group)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def relative_errors(self) -> list[float]:
        """Per param: ||ours - reference|| / ||reference|| over the fp32 masters."""
        errs = []
        for p, ref in self.masters.items():
            master = self.ours.master(p)
            ref_here = ref.detach().to(master.device)
            errs.append(((master - ref_here).norm() / ref_here.norm().clamp_min(1e-30)).item() if master.numel() else 0.0)
        return errs

    def assert_matches(self, rtol: float = 1e-6) -> None:
        """Masters within ``rtol`` of the reference, and every param exactly its master rounded."""
        for (p, _), err in zip(self.masters.items(), self.relative_errors()):
            assert err < rtol, f"param {tuple(p.shape)}: relative error {err:.3e} >= {rtol}"
            master = self.ours.master(p)
            assert torch.equal(local(p).detach().cpu(), master.to(p.dtype).cpu()), "param is not its master rounded"
