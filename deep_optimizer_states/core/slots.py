"""GPU memory for one staged subgroup's fp32 states: the update's staging slots, and those filled ahead of
it during backward (``prefetch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SLOT_BYTES_PER_ELEMENT = 16  # a staging slot: fp32 param, grad, exp_avg, exp_avg_sq
# a slot filled ahead: fp32 param, exp_avg, exp_avg_sq. Its update reads the gradient from one fp32 buffer the
# update's GPU lane shares across those subgroups (``FILL_GRAD_BYTES_PER_ELEMENT`` of the biggest), which it
# writes and reads in stream order: a quarter less memory per slot held from backward into the next forward
FILL_BYTES_PER_ELEMENT = 12
FILL_GRAD_BYTES_PER_ELEMENT = 4


def slot_tensors(numel: int, device: torch.device, rows: int = 4) -> tuple[torch.Tensor, ...]:
    """One allocation, viewed as ``rows`` fp32 tensors of ``numel`` elements each (p, g, m, v; a slot filled
    ahead: p, m, v)."""
    return torch.empty(rows, numel, dtype=torch.float32, device=device).unbind(0)


class Slot:
    """A staging slot the update reuses from subgroup to subgroup."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.p, self.g, self.m, self.v = slot_tensors(numel, device)
        self.free = None  # event: the slot's last flush has completed


@dataclass
class Ahead:
    """One subgroup's states in a slot of their own: p, m, v (the update's gradient goes to the GPU lane's
    shared buffer), the event after which they hold the host's values, and the stream that copied them in
    (None on the CPU)."""

    p: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    loaded: object
    stream: object = None

    def release_after(self, *streams: object) -> None:
        """Let the allocator hand this slot's memory out again once the work enqueued so far on its copy-in
        stream and on ``streams`` has run, instead of when the last reference goes (``record_stream``: p, m
        and v are views of one allocation). The caller then drops its references."""
        for stream in (self.stream, *streams):
            if stream is not None:
                self.p.record_stream(stream)
