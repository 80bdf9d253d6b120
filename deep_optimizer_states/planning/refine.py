"""Refining the calibrated rates from the telemetry of real updates.

Calibration runs for seconds on a synthetic layout. The machine then varies (other tenants, clock, page
placement), and on a real layout the CPU and the link slow each other by more or less than the synthetic
mixes showed. Each finished update shows some rates; each is learnt as a factor on one calibrated rate, the
median over the last REFINE_WINDOW updates that showed it:

- ``cpu_engine``: from updates all on the CPU (their CPU AdamW time);
- ``cpu_contended``: from mixes in which the link, by the model, runs for at least half of the CPU's time;
- ``link_contended``: from mixes that the link bounds (the CPU's AdamW ended well before the update did).

The factor is the one that makes the model's own busy time equal the measured one (found by bisection), so
each lesson is exact for the update it came from and the model's structure stays as it is.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

from ..core.schedule import Placement
from .perfmodel import Prediction, Rates, fills, predict

if TYPE_CHECKING:
    from ..core.engine import UpdateStats

REFINE_WINDOW = 9  # recent updates whose median factor refines a rate
FACTOR_RANGE = (0.25, 4.0)  # a lesson outside this is a hiccup, not the machine
OVERLAP = 0.5  # a mix teaches the CPU's contended rate when the link runs for this share of the CPU's time
LINK_BOUND = 0.85  # ... and the link's when the CPU's AdamW took less than this share of the update
FIELDS = ("cpu_engine", "cpu_contended", "link_contended")


class Refiner:
    """Factors on the calibrated rates, learnt from updates."""

    def __init__(self) -> None:
        self._seen = {name: deque(maxlen=REFINE_WINDOW) for name in FIELDS}

    def factors(self) -> dict[str, float]:
        """Each refined rate's factor: the median of what recent updates showed, else 1."""
        return {name: statistics.median(seen) if seen else 1.0 for name, seen in self._seen.items()}

    def apply(self, base: Rates) -> Rates:
        """``base`` with the refined rates scaled by their factors."""
        return replace(base, **{name: getattr(base, name) * f for name, f in self.factors().items()})

    def learn(self, sizes: Sequence[int], places: Sequence[Placement], slots: int, base: Rates,
              stats: UpdateStats) -> None:
        """Learn from one update that ran ``places`` (nothing if the engine ran another placement)."""
        staged = places.count(Placement.STAGED)
        if stats.staged_subgroups != staged or stats.cpu_subgroups != places.count(Placement.CPU):
            return  # e.g. the engine fell back to the CPU without staging memory: not what was priced
        if stats.cpu_adam_seconds <= 0:
            return  # no CPU work: the link alone, which calibration measures well
        if not staged:
            self._learn("cpu_engine", sizes, places, slots, base, lambda p: p.cpu_s, stats.cpu_adam_seconds)
            return
        now = predict(sizes, places, self.apply(base), slots)
        if now.link_s >= OVERLAP * now.cpu_s:
            self._learn("cpu_contended", sizes, places, slots, base, lambda p: p.cpu_s, stats.cpu_adam_seconds)
        if stats.cpu_adam_seconds < LINK_BOUND * stats.seconds and Placement.RESIDENT not in places:
            # (with residents the update's time holds their GPU work too, which the link rate must not absorb)
            link_fill = fills(sizes, places, base)[1]
            self._learn("link_contended", sizes, places, slots, base, lambda p: p.link_s + link_fill, stats.seconds)

    def _learn(self, name: str, sizes: Sequence[int], places: Sequence[Placement], slots: int, base: Rates,
               busy: Callable[[Prediction], float], measured: float) -> None:
        rates = self.apply(base)
        factor = solve(lambda f: busy(predict(sizes, places, replace(rates, **{name: getattr(rates, name) * f}),
                                              slots)), measured)
        if factor is not None:
            self._seen[name].append(factor * self.factors()[name])


def solve(busy: Callable[[float], float], measured: float) -> float | None:
    """The factor in FACTOR_RANGE at which ``busy`` (falling as the factor grows) equals ``measured``."""
    low, high = FACTOR_RANGE
    if not busy(high) <= measured <= busy(low):
        return None
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (low, mid) if busy(mid) < measured else (mid, high)
    return (low + high) / 2
