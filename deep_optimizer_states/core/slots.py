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
    """One subgroup's states in a slot of their own: p, g, m, v (g is written by the update), the event
    after which p, m and v hold the host's values, and the stream that copied them in (None on the CPU)."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    loaded: object
    stream: object = None

    def release_after(self, *streams: object) -> None:
        """Let the allocator hand this slot's memory out again once the work enqueued so far on its copy-in
        stream and on ``streams`` has run, instead of when the last reference goes (``record_stream``: p, g,
        m and v are views of one allocation). The caller then drops its references."""
        for stream in (self.stream, *streams):
            if stream is not None:
                self.p.record_stream(stream)
