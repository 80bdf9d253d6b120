"""The GPU memory one update holds of its own, sized from its jobs.

An update allocates staging slots, the CPU path's fp32 scratch (gradients down, params up), the residents'
fp32 gradient buffer and the one its subgroups filled ahead share, and it holds the slots filled ahead
(``prefetch``) until their flush or its end. With ``overlap`` all of that sits beside the next forward and
backward, so the memory budget is told the bytes the update holds (``MemoryBudget.note_update``): a peak the
allocator reaches while the update holds them is not the model's need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from .layout import Subgroup
from .schedule import Placement
from .slots import FILL_BYTES_PER_ELEMENT, SLOT_BYTES_PER_ELEMENT

FP32_BYTES = 4


class PlacedJob(Protocol):
    """What sizing reads of an update's job (``engine.Job``): its subgroup and where it is updated."""

    subgroup: Subgroup
    placement: Placement


@dataclass(frozen=True)
class BufferSizes:
    """Elements of each buffer an update allocates (0: none), each sized for the biggest subgroup using it."""

    slots: int = 0  # staging slots
    slot_numel: int = 0  # ... of this many elements each
    ahead_grad: int = 0  # the gradient buffer the subgroups filled ahead share
    down: int = 0  # the CPU path's gradients on their way down (GPU only)
    up: int = 0  # ... and its params on their way up (GPU only)
    grads: int = 0  # the residents' fp32 gradients

    @classmethod
    def of(cls, jobs: Sequence[PlacedJob], count: int, landed: dict, ahead: dict, cuda: bool) -> "BufferSizes":
        """What ``jobs`` need with at most ``count`` staging slots, where ``landed`` CPU subgroups' gradients
        are on the host already and ``ahead`` staged ones have slots filled ahead."""
        def biggest(numels: list[int]) -> int:
            return max(numels, default=0)

        def numels(place: Placement, keep=lambda index: True) -> list[int]:
            return [j.subgroup.numel for j in jobs if j.placement is place and keep(j.subgroup.index)]

        staged = numels(Placement.STAGED, lambda i: i not in ahead)
        return cls(slots=min(count, len(staged)), slot_numel=biggest(staged),
                   ahead_grad=biggest(numels(Placement.STAGED, lambda i: i in ahead)),
                   down=biggest(numels(Placement.CPU, lambda i: i not in landed)) if cuda else 0,
                   up=biggest(numels(Placement.CPU)) if cuda else 0,
                   grads=biggest(numels(Placement.RESIDENT)))

    def bytes(self) -> int:
        """The GPU bytes of these buffers."""
        return (SLOT_BYTES_PER_ELEMENT * self.slots * self.slot_numel
                + FP32_BYTES * (self.ahead_grad + self.down + self.up + self.grads))


def filled_bytes(ahead: dict) -> int:
    """The GPU bytes of the slots filled ahead in ``ahead`` (subgroup index -> ``Ahead``)."""
    return sum(FILL_BYTES_PER_ELEMENT * filled.p.numel() for filled in ahead.values())
