"""Everything that must see all gradients before any update: the global norm, clipping, fp16 loss scaling.

The results are *multipliers*, 0-dim fp32 tensors on the device that the engine applies, in order, while it
up-casts each subgroup's gradient. Order and arithmetic follow torch: GradScaler's unscale
(grad * (1/scale)), then clip_grad_norm_ (grad * clamp(max_norm / (norm + 1e-6), max=1)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def total_norm(grads: list[torch.Tensor], device: torch.device | None = None,
               group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """The L2 norm over all ``grads``, computed as torch.nn.utils.clip_grad_norm_ does, accumulated in fp32.

    With a process group (FSDP2), ``grads`` are this rank's shards: the squares are summed over the ranks,
    so every rank gets the norm of the whole model's gradient (and skips or clips alike).
    """
    return combine_norms(norms_fp32(grads), device, group)


def norms_fp32(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm in fp32, whatever its dtype, by torch's fused kernel: one call per (device,
    dtype), as clip_grad_norm_ groups them (a mixed list would take the per-tensor fallback, whose bits may
    differ). A tensor's norm does not depend on the others in its call, so norms taken in batches as
    gradients land (``stream_grads``) equal those taken all at once."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    for idx in groups.values():
        for i, n in zip(idx, torch._foreach_norm([grads[i] for i in idx], 2, dtype=torch.float32)):
            out[i] = n
    return out


def combine_norms(norms: list[torch.Tensor], device: torch.device | None = None,
                  group: "dist.ProcessGroup | None" = None) -> torch.Tensor:
    """The L2 norm of tensors whose own fp32 norms are ``norms`` (taken as gradients landed, with
    ``stream_grads``, or all at once by ``total_norm``: the same arithmetic either way), over the ranks."""
    norm = torch.linalg.vector_norm(torch.stack(norms), 2) if norms else torch.zeros((), device=device)
    if group is None:
        return norm
    squares = norm.square()
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    return squares.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 params, with torch.amp.GradScaler's defaults and rules.

    From a power-of-two initial scale (the default; ``loss_scale=<float>`` sets another) the scales stay
    powers of two, so unscaling is exact; from another, unscaling rounds as torch's GradScaler does. A step
    with an inf/nan gradient is skipped and the scale halved; after ``growth_interval`` clean steps in a row
    the scale doubles.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("loss scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             "and growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
