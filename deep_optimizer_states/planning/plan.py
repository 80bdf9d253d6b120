"""The plan: where each subgroup is updated, from the user's schedule and, for "auto", the performance model.

"auto" on a GPU asks the calibrated model for the placement with the least predicted update time, and
plans again when the GPU memory free for staging slots changes. Calibration (seconds, and GPU memory) is
never run while the optimizer is built: a stored calibration is used at once; without one, "auto" starts
with a provisional plan (half of the subgroups staged, no prediction) and calibrates at the first
``refresh`` (the first step) or at an explicit ``calibrate()``. Without a GPU, staging means nothing, so
"auto" keeps half of the subgroups on each path (both run) and never calibrates.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.schedule import Placement, Schedule, placements, validate_schedule
from .perfmodel import Prediction, Rates, choose, predict
from .refine import Refiner

if TYPE_CHECKING:
    from ..core.engine import UpdateStats

log = logging.getLogger(__name__)
SLOT_BYTES_PER_ELEMENT = 16  # fp32 param, grad, exp_avg, exp_avg_sq
SCRATCH_BYTES_PER_ELEMENT = 8  # the CPU path's fp32 grad and param scratch
REPLAN_CHANGE = 0.02  # "auto" plans again when a refined rate moved by more than this since the last plan


@dataclass(frozen=True)
class Plan:
    """One placement per subgroup, the staging slots it was planned for and the model's prediction (None
    when there is none, e.g. for "auto" before calibration)."""

    schedule: Schedule
    placements: list[Placement]
    slots: int
    prediction: Prediction | None


class Planner:
    """Plans for one layout (subgroup sizes) on one device. Rates come from calibration (run when first
    needed), refined by what real updates show (``refine.Refiner``): the CPU's AdamW speed alone and beside
    the link, and the link's beside the CPU."""

    def __init__(self, sizes: list[int], device: torch.device, max_slots: int, rates: Rates | None = None) -> None:
        self.sizes, self.device, self.max_slots = sizes, device, max_slots
        self._calibrated = rates
        self.refiner = Refiner()
        self._observed = 0
        self._planned_factors = self.refiner.factors()
        self._pending = False  # "auto" runs a provisional plan until calibration
        self._announced = False
        self.current: Plan | None = None

    @property
    def calibrated(self) -> Rates:
        """The machine's calibrated rates (a stored calibration, else measured now and stored)."""
        if self._calibrated is None:
            self._calibrated = self._stored() or self._measure()
        return self._calibrated

    def _stored(self) -> Rates | None:
        from .calibrate import cache_path, load_cached

        rates = load_cached(self.device)
        if rates is not None:
            log.info("using the calibration stored in %s", cache_path(self.device))
        return rates

    def _measure(self) -> Rates:
        from .calibrate import cache_path, calibrated_rates

        if not self._announced:
            self._announced = True
            log.info("schedule 'auto': calibrating this machine's rates once (seconds); "
                     "stored in %s and reused from there", cache_path(self.device))
        return calibrated_rates(self.device, force=True, log=log.info)

    def calibrate(self, force: bool = False) -> Rates:
        """Load this machine's rates (measure and store them if none are stored, or if ``force``) and, for
        "auto", plan with them now instead of at the first step."""
        if force or self._calibrated is None:
            self._calibrated = (None if force else self._stored()) or self._measure()
        self._pending = False
        if self.current is not None and self.current.schedule == "auto":
            self.plan("auto")
        return self._calibrated

    @property
    def pending(self) -> bool:
        """Whether "auto" runs a provisional plan that waits for calibration (at the next ``refresh``)."""
        return self._pending

    @property
    def factors(self) -> dict[str, float]:
        """What real updates showed of each refined rate, as a factor on the calibrated one."""
        return self.refiner.factors()

    @property
    def rates(self) -> Rates:
        """The calibrated rates, refined by real updates."""
        return self.refiner.apply(self.calibrated)

    def known_rates(self) -> Rates | None:
        """``rates`` if calibration has been loaded, without calibrating; else None."""
        return self.rates if self._calibrated is not None else None

    def observe(self, stats: UpdateStats) -> None:
        """Learn from a finished update. Skips the first update (one-off costs) and never calibrates for it:
        a fixed schedule uses the cached rates if there are any."""
        self._observed += 1
        if self._observed == 1 or self.device.type != "cuda":
            return
        if self._calibrated is None:
            from .calibrate import load_cached

            self._calibrated = load_cached(self.device)
            if self._calibrated is None:
                return
        self.refiner.learn(self.sizes, self.current.placements, max(self.current.slots, 1), self._calibrated, stats)

    def plan(self, schedule: Schedule) -> Plan:
        """A new plan for ``schedule``. Never measures: "auto" on a GPU without stored rates gets a provisional
        plan (half of the subgroups staged, no prediction) until ``refresh`` or ``calibrate``."""
        schedule = validate_schedule(schedule)
        slots = self.slots_that_fit()
        pending = False
        if schedule != "auto" or self.device.type != "cuda":
            places = placements(schedule, len(self.sizes))
            rates = self.known_rates()
            pred = predict(self.sizes, places, rates, max(slots, 1)) if rates else None
        elif slots == 0:
            places, pred = placements("cpu", len(self.sizes)), None
        else:
            if self._calibrated is None:
                self._calibrated = self._stored()
            if self._calibrated is None:
                places, pred, pending = placements("auto", len(self.sizes)), None, True
            else:
                places, pred = choose(self.sizes, self.rates, slots)
        self.current = Plan(schedule, places, slots, pred)
        self._pending = pending
        self._planned_factors = self.factors
        return self.current

    def refresh(self) -> Plan:
        """The current plan; for "auto" on a GPU, calibrated first if it is still provisional, and planned
        again if the staging memory that fits or a refined rate has changed."""
        if self.current.schedule != "auto" or self.device.type != "cuda":
            return self.current
        if self._pending:
            self._calibrate_for_auto()
            return self.current
        now = self.factors
        moved = any(abs(now[k] / self._planned_factors[k] - 1) > REPLAN_CHANGE for k in now)
        if moved or self.slots_that_fit() != self.current.slots:
            self.plan("auto")
            if self._pending:
                self._calibrate_for_auto()
        return self.current

    def _calibrate_for_auto(self) -> None:
        try:
            self.calibrate()
        except (MemoryError, torch.cuda.OutOfMemoryError) as e:  # no room to calibrate: keep the fixed split
            self._pending = False
            warnings.warn(f"cannot calibrate ({e}); schedule 'auto' stages half of the subgroups")

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
        index = device.index if device.index is not None else torch.cuda.current_device()
        free = min(free, int(get_fraction(index) * total) - allocated)
    return max(0, free)
