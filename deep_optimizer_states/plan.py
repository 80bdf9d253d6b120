"""The plan: where each subgroup is updated, from the user's schedule and, for "auto", the performance model.

"auto" on a GPU asks the calibrated model (calibrating once per machine, then cached) for the placement
with the least predicted update time, and plans again when the GPU memory free for staging slots changes.
Without a GPU, staging means nothing, so "auto" keeps half of the subgroups on each path (both run).
"""

from __future__ import annotations

import logging
import statistics
import warnings
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .perfmodel import Prediction, Rates, choose, fills, predict
from .schedule import Placement, Schedule, placements, validate_schedule

if TYPE_CHECKING:
    from .engine import UpdateStats

log = logging.getLogger(__name__)
SLOT_BYTES_PER_ELEMENT = 16  # fp32 param, grad, exp_avg, exp_avg_sq
SCRATCH_BYTES_PER_ELEMENT = 8  # the CPU path's fp32 grad and param scratch
REFINE_WINDOW = 9  # recent updates whose median CPU speed refines the calibrated rates
REPLAN_CHANGE = 0.02  # "auto" plans again when that speed moved by more than this since the last plan


@dataclass(frozen=True)
class Plan:
    schedule: Schedule
    placements: list[Placement]
    slots: int
    prediction: Prediction | None


class Planner:
    """Plans for one layout (subgroup sizes) on one device. Rates come from calibration (run when first
    needed) and are refined by what real updates show: the CPU's AdamW speed (calibration's short runs read
    it with about 10% noise, and it is the rate the choice depends on most), and the link's speed while
    the CPU runs, read from updates that the link bounds (calibration reads it from a CPU-bound mix)."""

    def __init__(self, sizes: list[int], device: torch.device, max_slots: int, rates: Rates | None = None) -> None:
        self.sizes, self.device, self.max_slots = sizes, device, max_slots
        self._calibrated = rates
        self._cpu_speed: deque[float] = deque(maxlen=REFINE_WINDOW)  # measured / calibrated, per update
        self._link_speed: deque[float] = deque(maxlen=REFINE_WINDOW)  # the same for link_contended
        self._observed = 0
        self._planned_speeds = (1.0, 1.0)
        self.current: Plan | None = None

    @property
    def calibrated(self) -> Rates:
        """The machine's calibrated rates (measured on first use, then cached per machine)."""
        if self._calibrated is None:
            from .calibrate import calibrated_rates

            self._calibrated = calibrated_rates(self.device, log=log.info)
        return self._calibrated

    @property
    def cpu_speed(self) -> float:
        """The CPU's AdamW speed in real updates over the calibrated one: median of recent updates, else 1."""
        return statistics.median(self._cpu_speed) if self._cpu_speed else 1.0

    @property
    def link_speed(self) -> float:
        """The link's speed while the CPU runs, in real link-bound updates over the calibrated one, else 1."""
        return statistics.median(self._link_speed) if self._link_speed else 1.0

    @property
    def rates(self) -> Rates:
        """The calibrated rates, the CPU AdamW rates and the contended link rate scaled by what real updates
        measured."""
        return self._refined(self.calibrated)

    def _refined(self, base: Rates) -> Rates:
        cpu, link = self.cpu_speed, self.link_speed
        return replace(base, cpu_engine=base.cpu_engine * cpu, cpu_contended=base.cpu_contended * cpu,
                       link_contended=base.link_contended * link)

    def known_rates(self) -> Rates | None:
        """``rates`` if calibration has been loaded, without calibrating; else None."""
        return self.rates if self._calibrated is not None else None

    def observe(self, stats: UpdateStats) -> None:
        """Learn the CPU's AdamW speed, and the link's when the link bounded the update, from a finished
        update. Skips the first update (one-off costs) and never calibrates for it: a fixed schedule uses
        the cached rates if there are any."""
        self._observed += 1
        if self._observed == 1 or self.device.type != "cuda":
            return
        if self._calibrated is None:
            from .calibrate import load_cached

            self._calibrated = load_cached(self.device)
            if self._calibrated is None:
                return
        places, slots = self.current.placements, max(self.current.slots, 1)
        if stats.staged_subgroups != places.count(Placement.STAGED):
            return  # the engine fell back to the CPU (no memory for staging): not the plan that was priced
        if stats.cpu_adam_seconds > 0:
            expected = predict(self.sizes, places, self._calibrated, slots).cpu_s
            self._cpu_speed.append(expected / stats.cpu_adam_seconds)
        if stats.staged_subgroups and stats.cpu_subgroups:
            speed = link_speed_of(self.sizes, places, self._refined(self._calibrated), slots, stats.seconds)
            if speed is not None:
                self._link_speed.append(speed * self.link_speed)

    def plan(self, schedule: Schedule) -> Plan:
        """A new plan for ``schedule``."""
        schedule = validate_schedule(schedule)
        slots = self.slots_that_fit()
        if schedule != "auto" or self.device.type != "cuda":
            places = placements(schedule, len(self.sizes))
            rates = self.known_rates()
            pred = predict(self.sizes, places, rates, max(slots, 1)) if rates else None
        elif slots == 0:
            places, pred = placements("cpu", len(self.sizes)), None
        else:
            try:
                places, pred = choose(self.sizes, self.rates, slots)
            except (MemoryError, torch.cuda.OutOfMemoryError) as e:  # no room to calibrate: a fixed split
                warnings.warn(f"cannot calibrate ({e}); schedule 'auto' stages half of the subgroups")
                places, pred = placements("auto", len(self.sizes)), None
        self.current = Plan(schedule, places, slots, pred)
        self._planned_speeds = (self.cpu_speed, self.link_speed)
        return self.current

    def refresh(self) -> Plan:
        """The current plan, planned again if "auto" and the staging memory that fits or the measured CPU or
        link speed has changed."""
        auto_on_gpu = self.current.schedule == "auto" and self.device.type == "cuda"
        now = (self.cpu_speed, self.link_speed)
        moved = any(abs(a / b - 1) > REPLAN_CHANGE for a, b in zip(now, self._planned_speeds))
        if auto_on_gpu and (moved or self.slots_that_fit() != self.current.slots):
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


def link_speed_of(sizes: list[int], places: list[Placement], rates: Rates, slots: int,
                  seconds: float) -> float | None:
    """The factor on ``rates.link_contended`` that makes the model's link finish at ``seconds``, for an
    update that the link bounds (by the model); None when the CPU or the GPU bounds it, or no factor in
    [1/4, 4] explains it."""
    def link_end(factor: float) -> float:
        pred = predict(sizes, places, replace(rates, link_contended=rates.link_contended * factor), slots)
        return pred.link_s + fills(sizes, places, rates)[1]

    pred = predict(sizes, places, rates, slots)
    if pred.bottleneck != "link" or not link_end(4.0) <= seconds <= link_end(0.25):
        return None
    low, high = 0.25, 4.0  # the link's end falls as the factor grows
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (low, mid) if link_end(mid) < seconds else (mid, high)
    return (low + high) / 2


def gpu_bytes_free(device: torch.device) -> int:
    """Bytes this process may still allocate: the device's free memory plus our cached blocks, capped by
    torch.cuda.set_per_process_memory_fraction when one is set (how a smaller GPU is emulated)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    free += torch.cuda.memory_reserved(device) - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    if get_fraction is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        free = min(free, int(get_fraction(index) * total) - allocated)
    return max(0, free)
