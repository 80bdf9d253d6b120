"""The plan: where each subgroup is updated, from the user's schedule and, for "auto", the performance model.

"auto" on a GPU asks the calibrated model (calibrating once per machine, then cached) for the placement
with the least predicted update time, and plans again when the GPU memory free for staging slots changes.
Without a GPU, staging means nothing, so "auto" keeps half of the subgroups on each path (both run).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from .perfmodel import Prediction, Rates, choose, predict
from .schedule import Placement, Schedule, placements, validate_schedule

log = logging.getLogger(__name__)
SLOT_BYTES_PER_ELEMENT = 16  # fp32 param, grad, exp_avg, exp_avg_sq
SCRATCH_BYTES_PER_ELEMENT = 8  # the CPU path's fp32 grad and param scratch


@dataclass(frozen=True)
class Plan:
    schedule: Schedule
    placements: list[Placement]
    slots: int
    prediction: Prediction | None


class Planner:
    """Plans for one layout (subgroup sizes) on one device; ``rates`` come from calibration when needed."""

    def __init__(self, sizes: list[int], device: torch.device, max_slots: int, rates: Rates | None = None) -> None:
        self.sizes, self.device, self.max_slots = sizes, device, max_slots
        self._rates = rates
        self.current: Plan | None = None

    @property
    def rates(self) -> Rates:
        if self._rates is None:
            from .calibrate import calibrated_rates

            self._rates = calibrated_rates(self.device, log=log.info)
        return self._rates

    def plan(self, schedule: Schedule) -> Plan:
        """A new plan for ``schedule``."""
        schedule = validate_schedule(schedule)
        slots = self.slots_that_fit()
        if schedule != "auto" or self.device.type != "cuda":
            places = placements(schedule, len(self.sizes))
            pred = predict(self.sizes, places, self._rates, max(slots, 1)) if self._rates else None
        elif slots == 0:
            places, pred = placements("cpu", len(self.sizes)), None
        else:
            try:
                places, pred = choose(self.sizes, self.rates, slots)
            except (MemoryError, torch.cuda.OutOfMemoryError) as e:  # no room to calibrate: a fixed split
                warnings.warn(f"cannot calibrate ({e}); schedule 'auto' stages half of the subgroups")
                places, pred = placements("auto", len(self.sizes)), None
        self.current = Plan(schedule, places, slots, pred)
        return self.current

    def refresh(self) -> Plan:
        """The current plan, planned again if "auto" and the staging memory that fits has changed."""
        auto_on_gpu = self.current.schedule == "auto" and self.device.type == "cuda"
        if auto_on_gpu and self.slots_that_fit() != self.current.slots:
            return self.plan("auto")
        return self.current

    def slots_that_fit(self) -> int:
        """How many staging slots (up to ``max_slots``) fit in the GPU memory free right now."""
        if self.device.type != "cuda":
            return self.max_slots
        free = gpu_bytes_free(self.device)
        biggest = max(self.sizes)
        spare = free - SCRATCH_BYTES_PER_ELEMENT * biggest
        return int(max(0, min(self.max_slots, spare // (SLOT_BYTES_PER_ELEMENT * biggest))))


def gpu_bytes_free(device: torch.device) -> int:
    """Bytes this process may still allocate: the device's free memory plus our cached blocks, capped by
    torch.cuda.set_per_process_memory_fraction when one is set (how a smaller GPU is emulated)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    free += torch.cuda.memory_reserved(device) - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    if get_fraction is not None:
        free = min(free, int(get_fraction(torch.cuda._get_device_index(device, optional=True)) * total) - allocated)
    return max(0, free)
