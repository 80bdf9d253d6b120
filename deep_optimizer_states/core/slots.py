"""GPU memory for one staged subgroup's fp32 states: the update's staging slots, and those filled ahead of
it during backward (``prefetch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SLOT_BYTES_PER_ELEMENT = 16  # a staging slot: fp32 param, grad, exp_avg, exp_avg_sq


def slot_tensors(numel: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One allocation, viewed as p, g, m, v of ``numel`` fp32 elements each."""
    return torch.empty(4, numel, dtype=torch.float32, device=device).unbind(0)


class Slot:
    """A staging slot the update reuses from subgroup to subgroup."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.p, self.g, self.m, self.v = slot_tensors(numel, device)
        self.free = None  # event: the slot's last flush has completed


@dataclass
class Ahead:
    """One subgroup's states in a slot of their own: p, g, m, v (g is written by the update), and the event
    after which p, m and v hold the host's values."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    loaded: object
