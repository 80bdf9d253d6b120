"""The plan: where each subgroup is updated, from the user's schedule and, for "auto", the performance model.

"auto" on a GPU first keeps resident as many subgroups as the GPU memory budget leaves room for beside what
forward and backward were measured to need (``budget.MemoryBudget``): their update costs no PCIe traffic.
The rest are placed by the calibrated model (the placement with the least predicted update time), planned
again when the memory free for staging slots or for residents changes. Calibration (seconds, and GPU
memory) is never run while the optimizer is built: a stored calibration is used at once; without one,
"auto" starts with a provisional plan (half of the subgroups staged, no prediction) and calibrates at the
first ``refresh`` (the first step) or at an explicit ``calibrate()``; a plan with every subgroup resident
needs no calibration. Without a GPU, staging means nothing, so "auto" keeps half of the subgroups on each
path (both run) and never calibrates.

With ``speculate`` part of the CPU path's work is done during backward; the plan prices that head start
(``perfmodel.price``'s ``ahead``: the median of what recent updates kept) and moves work to the CPU for it,
planning again when it moves by more than REPLAN_AHEAD of all elements. An update that kept every CPU
element its plan gave (none, when the plan staged everything) shows only a floor: its head start might be
larger. Until an update shows where speculation stops, the plan prices the most the spares can hold, so a
plan that staged everything does not stay there for want of a head start it never let run (on an H200 x2
the 2-rank plans staged every subgroup, and speculation had nothing to do: fsdp2.md, call 17).

With ``overlap`` and ``prefetch`` the plan prices the iteration, not the update alone (``perfmodel.Window``):
the staged subgroups' way in that came during backward (as many as the memory for slots filled ahead
holds and the link carries in the rest of the iteration, until an update shows fills stopping short: then
the median of what recent updates found filled; the optimizer fills no more than the link carries,
``fill_cap``),
and the rest of the iteration around the update (the least over recent steps of the time between two
``step()`` calls less the update's time until its last param write had run and less the next step's
wait for the update's end), beside which the link's traffic of a whole step bounds the iteration. It
plans again when either moves (REPLAN_AHEAD of all elements, REPLAN_REST of the rest).
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from ..core.engine import STAGED_BYTES
from ..core.slots import FILL_BYTES_PER_ELEMENT, FILL_GRAD_BYTES_PER_ELEMENT, SLOT_BYTES_PER_ELEMENT
from ..core.ranks import RankSync
from ..core.residency import RESIDENT_BYTES_PER_ELEMENT
from ..core.schedule import MODELLED, Placement, Schedule, placements, validate_schedule
from .budget import CudaProbe, MemoryBudget
from .perfmodel import Prediction, Rates, Window, choose, predict
from .refine import Refiner

if TYPE_CHECKING:
    from ..core.engine import UpdateStats

log = logging.getLogger(__name__)
SCRATCH_BYTES_PER_ELEMENT = 8  # the CPU path's fp32 grad and param scratch
RESIDENT_SCRATCH_BYTES_PER_ELEMENT = 4  # the residents' fp32 grad buffer
REPLAN_CHANGE = 0.02  # "auto" plans again when a refined rate moved by more than this since the last plan
AHEAD_WINDOW = 5  # recent updates whose median of CPU elements kept from speculation is the head start
REPLAN_AHEAD = 0.02  # ... and plans again when that head start moved by more than this share of all elements
REPLAN_REST = 0.1  # ... or the rest of the overlapped iteration by more than this share of it
FILL_CAP = 1.0  # slots filled ahead hold at most this many times what the link carries in the rest (``carried``)
# ``carried`` from backward's span (first to last final gradient) where it is shorter than the learnt rest: a loop
# that synchronises the device after backward counts the fills' own link time as rest, and sized by that rest the
# plan climbed from 24 to 39-40 of 55 staged at 1.36B (overlap.md calls 142-145). On by default since calls 146-150
# (one H200): that climb stopped (25 of 55 held, peak 43.5 -> 23.3 GB), and in a loop that never synchronises the
# iteration's median over 4 pairs 0.3143 against 0.3231 s, faster in 3 of 4, peak 22.1-24.5 against 24.5-28.1 GB
FILLS_WITHIN_BACKWARD = True


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

    def __init__(self, sizes: list[int], device: torch.device, max_slots: int, rates: Rates | None = None,
                 budget: MemoryBudget | None = None, provisional: Schedule = "auto",
                 sync: RankSync | None = None, bf16: bool = False, ahead_cap: int = 0, overlap: bool = False,
                 prefetch: bool = False) -> None:
        """``provisional``: the fixed schedule "auto" runs until calibration ("cpu" when gradients are
        streamed off the GPU: the first backward then keeps none of them there). ``sync``: the ranks that
        plan together (FSDP2); they decide together whether to load stored rates or to calibrate, and
        calibrate in lock-step. ``bf16``: the engine runs its bf16 CPU path (its rates are calibrated apart).
        ``ahead_cap``: the CPU elements ``speculate`` can run ahead per step (its spares times the largest
        subgroup); 0 without speculation. ``overlap``, ``prefetch``: the optimizer's options of those names
        (the plan then prices the iteration around the update, ``window``)."""
        self.sizes, self.device, self.max_slots, self.bf16 = sizes, device, max_slots, bf16
        self.provisional = validate_schedule(provisional)
        if budget is None:
            gpu = device.type == "cuda" and torch.cuda.is_available()
            budget = MemoryBudget(None, CudaProbe(device) if gpu else None)
        self.budget = budget
        self._gpu = device.type == "cuda" or budget.active  # a GPU memory to plan (a fake one in tests)
        self._held = 0  # resident bytes allocated now
        self._filled_now = 0  # bytes of slots filled ahead now, which the update will hold (``overlap``)
        self._want = 0  # resident subgroups the plan being made wants
        self._fixed: list[Placement] | None = None  # the placements of a fixed schedule being planned
        self._warned_no_slot = False
        self._calibrated = rates
        self.refiner = Refiner()
        self._observed = 0
        self._planned_factors = self.refiner.factors()
        self.ahead_cap = ahead_cap
        self._ahead_seen: deque[int] = deque(maxlen=AHEAD_WINDOW)  # CPU elements each update found done ahead
        self._ahead_floor = False  # an update kept all its plan's CPU work: a head start of unknown size
        self.overlap, self.prefetch = overlap, prefetch
        self._filled_seen: deque[int] = deque(maxlen=AHEAD_WINDOW)  # staged elements found filled, fills short
        self._rest_seen: deque[float] = deque(maxlen=AHEAD_WINDOW)  # seconds of each step outside its update
        self._backward_seen: deque[float] = deque(maxlen=AHEAD_WINDOW)  # each backward's span of final gradients
        self._planned_window = Window()
        self._pending = False  # "auto" runs a provisional plan until calibration
        self._announced = False
        self.current: Plan | None = None
        self.sync = sync or RankSync(None, device)
        self._stored_checked = False
        if self.sync.collective and self._gpu and rates is None:
            self._calibrated = self._stored()  # all ranks at once, while they build the optimizer together

    @property
    def calibrated(self) -> Rates:
        """The machine's calibrated rates (a stored calibration, else measured now and stored)."""
        if self._calibrated is None:
            self._calibrated = self._stored() or self._measure()
        return self._calibrated

    def _stored(self) -> Rates | None:
        """The stored rates, if any. Ranks decide once, together (at construction or at the first
        ``calibrate``): a file that another rank writes later must not split them."""
        from .calibrate import cache_path, load_cached

        if self.sync.collective and self._stored_checked:
            return None
        rates = load_cached(self.device, self.bf16)
        if self.sync.collective:
            self._stored_checked = True
            if not self.sync.everyone(rates is not None):
                rates = None
        if rates is not None:
            log.info("using the calibration stored in %s", cache_path(self.device, self.bf16))
        return rates

    def _measure(self) -> Rates:
        """Measure the rates (every rank at once, in lock-step, then averaged over the ranks) and store them."""
        from .calibrate import cache_path, calibrated_rates

        if not self._announced:
            self._announced = True
            log.info("schedule 'auto': calibrating this machine's rates once (seconds); "
                     "stored in %s and reused from there", cache_path(self.device, self.bf16))
        return calibrated_rates(self.device, force=True, log=log.info, sync=self.sync, bf16=self.bf16)

    def calibrate(self, force: bool = False) -> Rates:
        """Load this machine's rates (measure and store them if none are stored, or if ``force``) and, for
        "auto", plan with them now instead of at the first step."""
        if force or self._calibrated is None:
            self._calibrated = (None if force else self._stored()) or self._measure()
        self._pending = False
        if self.current is not None and self.current.schedule in MODELLED:
            self.plan(self.current.schedule)
        return self._calibrated

    @property
    def pending(self) -> bool:
        """Whether "auto" runs a provisional plan that waits for calibration (at the next ``refresh``)."""
        return self._pending

    @property
    def ahead(self) -> float:
        """CPU AdamW elements the next update should find done during backward (``speculate``): the median
        of what recent updates kept where speculation stopped short of their plan's CPU work; before any did,
        the spares' capacity once an update kept all of it; 0 without speculation."""
        if self._ahead_seen:
            return float(statistics.median(self._ahead_seen))
        return float(self.ahead_cap) if self._ahead_floor else 0.0

    @property
    def filled(self) -> float:
        """Staged elements the next update should find filled during backward (``prefetch``): as many as the
        GPU memory for slots filled ahead holds and the link carries in the rest of the iteration
        (``carried``), or fewer, the median of what recent updates found where the fills stopped short of
        their plan's staged subgroups; 0 without prefetch."""
        if not self.prefetch:
            return 0.0
        room = self.fill_room() // FILL_BYTES_PER_ELEMENT
        reach = float(min(room, statistics.median(self._filled_seen))) if self._filled_seen else float(room)
        return min(reach, self.carried)

    @property
    def carried(self) -> float:
        """Staged elements whose way in the link carries outside the update (``overlap``): the learnt rest at
        the contended rate, 12 B per element; none before a rest is learnt (the first steps), unbounded
        without overlap (no rest is learnt) or rates (nothing to convert it by). Fills beyond it
        queue ahead of the update's own copies up: memory alone priced 95 of 208 subgroups at 5.2B (28.5 GB)
        as filled for free beside a 0.21 s rest that carries about 7.3 GB, 0.99 s predicted against 1.04 s
        measured (docs/benchmarks/overlap.md, call 46)."""
        rates = self.known_rates()
        if not self.overlap or rates is None:
            return math.inf
        return self.fill_window_s * rates.link_contended / STAGED_BYTES

    @property
    def fill_window_s(self) -> float:
        """The seconds whose link time ``carried`` counts: the learnt rest, or with ``FILLS_WITHIN_BACKWARD``
        backward's span where it is shorter (fills start at the first final gradient; a synchronize after
        backward may lengthen the rest by the fills it waits for, not that span)."""
        if FILLS_WITHIN_BACKWARD and self.backward_s is not None:
            return min(self.rest_s, self.backward_s)
        return self.rest_s

    def observe_backward(self, seconds: float | None) -> None:
        """Learn backward's span from a step's first final gradient to its last (host seconds; None when no
        gradient streamed, as without ``stream_grads``)."""
        if seconds is not None:
            self._backward_seen.append(seconds)

    @property
    def backward_s(self) -> float | None:
        """The least backward span of recent steps (``observe_backward``); None before any."""
        return min(self._backward_seen, default=None)

    @property
    def rest_s(self) -> float:
        """Seconds of a step outside its update (``overlap``): the least of recent steps (what else happens
        between two steps, an evaluation, a checkpoint, a loop that synchronizes, only adds to it); 0 before
        any."""
        return min(self._rest_seen, default=0.0)

    @property
    def window(self) -> Window:
        """What the iteration gives the next update, as recent steps showed it."""
        return Window(self.ahead, self.filled, self.overlap, self.rest_s)

    def fill_room(self) -> int:
        """GPU bytes that slots filled during backward may take, beside forward's and backward's measured
        need, the residents this plan keeps and the update's own buffers; 0 before a need was measured."""
        if not self.budget.active or self.budget.need is None:
            return 0
        return max(0, self._room_beside(self._resident_bytes()))

    def _room_beside(self, resident_bytes: int) -> int:
        """The budget's room beside the measured need, ``resident_bytes`` of residents and the update's own
        buffers (negative where they do not fit); the budget must have measured a need."""
        return self.budget.resident_room() - resident_bytes - self._update_buffers()

    def observe_step(self, period_s: float, params_done_s: float | None, joined_s: float = 0.0,
                     idle_tail_s: float = 0.0) -> None:
        """Learn the rest of the iteration (``overlap``) from the seconds between two ``step()`` calls, the
        first one's update's time until its last param write had run (on the GPU's clock: a write that
        waited for a fill counts in the update), how long the second waited for that update to end
        (``joined_s``: its last flushes, the link's cycle, which the model prices apart) and how much of the
        update after its last write ran before the next forward began (``idle_tail_s``: beside none of the
        caller's work, as in a loop that calls ``opt.synchronize()`` after each step). Without them a link-bound
        plan would look like a long rest, and the plan would stay link-bound, or grow. The first update's
        step is left out, as its update is (one-off costs: calibration, the bf16 kernel's first call; on an
        H200 its 7 s made the next plan stage 53 of 55 subgroups, overlap.md call 41)."""
        if self.overlap and params_done_s is not None and period_s > 0 and self._observed > 1:
            self._rest_seen.append(max(0.0, period_s - params_done_s - joined_s - idle_tail_s))

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

    def observe(self, stats: UpdateStats, placements: Sequence[Placement] | None = None,
                overlapped: bool = False, planned_in_backward: bool = True, fills_bounded: bool = False) -> None:
        """Learn from a finished update that ran ``placements`` (default: the current plan's), the plan in
        force during its backward if ``planned_in_backward`` (else what ran ahead then says nothing of this
        plan's head start: a plan made at the step runs at once when no gradient went down during backward,
        as when the plan before staged everything). Skips the first
        update (one-off costs) and never calibrates for it: a fixed schedule uses the cached rates if any.
        An update that ran beside the next forward and backward (``overlapped``) teaches nothing: its times
        show their contention, not the rates of an update the model prices; learning from them moved the
        1.36B plans on an H200 towards staging everything, and the iterations got slower
        (docs/benchmarks/overlap.md). Nor does one whose staged subgroups came in during backward
        (``prefetch``), nor one whose CPU subgroups were updated during backward (``speculate``): the rates
        are refined on updates priced alone. Those teach the window instead: how much ran ahead, and how
        many staged elements the fills reached where they stopped short of the plan's, unless the room they
        were given could not hold the plan's staged subgroups (``fills_bounded``: ``filled`` prices that room
        already; learnt as a reach, the steps before a rest was learnt, which fill nothing, would hold the
        price at none once the fills reach every staged subgroup and stop teaching)."""
        self._observed += 1
        ran = list(placements) if placements is not None else (self.current.placements if self.current else [])
        if self._observed > 1 and self.ahead_cap and planned_in_backward:
            self._learn_ahead(stats.speculated_elements, ran)
        if self._observed > 1 and self.prefetch and planned_in_backward and not fills_bounded:
            staged = sum(n for n, p in zip(self.sizes, ran) if p is Placement.STAGED)
            if stats.prefetched_elements < staged:  # the fills stopped short: what they reach
                self._filled_seen.append(stats.prefetched_elements)
        if self._observed == 1 or self.device.type != "cuda" or overlapped or stats.prefetched or stats.speculated:
            return
        if self._calibrated is None:
            if self.sync.collective:  # ranks decided together at construction: loading now could split them
                return
            from .calibrate import load_cached

            self._calibrated = load_cached(self.device, self.bf16)
            if self._calibrated is None:
                return
        self.refiner.learn(self.sizes, ran, max(self.current.slots, 1), self._calibrated, stats)

    def _learn_ahead(self, kept: int, ran: list[Placement]) -> None:
        """What an update that ran ``ran`` and found ``kept`` CPU elements done during backward says of the
        head start: a floor when it kept all the CPU work its plan gave, short of the spares' capacity."""
        on_cpu = sum(n for n, p in zip(self.sizes, ran) if p is Placement.CPU)
        if on_cpu <= kept < self.ahead_cap:
            self._ahead_floor = True
        else:
            self._ahead_seen.append(kept)

    def plan(self, schedule: Schedule) -> Plan:
        """A new plan for ``schedule``. Never measures: "auto" on a GPU without stored rates gets a provisional
        plan (half of the non-resident subgroups staged, no prediction) until ``refresh`` or ``calibrate``."""
        schedule = validate_schedule(schedule)
        count, pending = len(self.sizes), False
        if schedule not in MODELLED or not self._gpu:
            self._want = 0
            places = placements(schedule, count)
            self._fixed = places
            slots = self.slots_that_fit()
            if self._gpu and not slots and Placement.STAGED in places:
                self._warn_no_slot()
        else:
            self._fixed = None
            self._want = self.residents_that_fit() if schedule == "auto" else 0
            rest, slots = len(self.sizes) - self._want, self.slots_that_fit()
            if not rest:
                tail = []
            elif slots == 0:
                tail = placements("cpu", rest)
            else:
                if self._calibrated is None:
                    self._calibrated = self._stored()
                if self._calibrated is None:
                    tail, pending = placements(self.provisional, rest), True
                else:
                    tail = choose(self.sizes[self._want:], self.rates, slots, sum(self.sizes[: self._want]),
                                  self.window)[0]
            places = [Placement.RESIDENT] * self._want + tail
        rates = self.known_rates()
        window = self.window
        pred = predict(self.sizes, places, rates, max(slots, 1), window) if rates and not pending else None
        self.current = Plan(schedule, places, slots, pred)
        self._pending = pending
        self._planned_factors, self._planned_window = self.factors, window
        return self.current

    def _window_moved(self) -> bool:
        """Whether what the iteration gives the update moved enough since the plan to plan again."""
        now, then, total = self.window, self._planned_window, sum(self.sizes)
        return (abs(now.ahead - then.ahead) > REPLAN_AHEAD * total
                or abs(min(now.filled, total) - min(then.filled, total)) > REPLAN_AHEAD * total
                or abs(now.rest_s - then.rest_s) > REPLAN_REST * max(then.rest_s, now.rest_s))

    def refresh(self, resident_bytes: int = 0, filled_bytes: int = 0, filled_now: int = 0,
                resident_now: int | None = None) -> Plan:
        """The current plan, at a step whose forward and backward held ``resident_bytes`` of resident states
        and ``filled_bytes`` of slots filled ahead at the allocator's peak (``resident_now`` and ``filled_now``
        allocated now, the latter held by the update to come); for "auto" on a GPU, calibrated first if it is
        still provisional, and planned again if the memory for residents or staging slots, or a refined rate,
        has changed (a fixed schedule: its staging slots only)."""
        schedule = self.current.schedule
        if self.budget.active:  # also under a fixed schedule: the room for slots filled ahead reads it
            self.budget.observe(resident_bytes + filled_bytes)
        if not self._gpu:
            return self.current
        self._held = resident_bytes if resident_now is None else resident_now
        self._filled_now = filled_now
        try:
            self._plan_again_if_moved(schedule)
        finally:
            self._filled_now = 0  # between steps no slot is filled ahead (a plan made then counts none)
        return self.current

    def _plan_again_if_moved(self, schedule: Schedule) -> None:
        """``refresh``'s decision: plan again where the memory, the rates or the iteration's window moved."""
        if schedule not in MODELLED:  # placements fixed by the user; the staging slots still follow the memory
            if self.slots_that_fit() != self.current.slots:
                self.plan(schedule)
            return
        now = self.factors
        moved = any(abs(now[k] / self._planned_factors[k] - 1) > REPLAN_CHANGE for k in now) or self._window_moved()
        residents = self.current.placements.count(Placement.RESIDENT)
        fit = self.residents_that_fit() if schedule == "auto" else 0
        if self._pending or moved or fit != residents:
            self.plan(schedule)
        else:
            self._want = residents
            if self.slots_that_fit() != self.current.slots:
                self.plan(schedule)
        if self._calibrated is None and self.sync.anyone(self._pending):  # ranks calibrate together
            self._calibrate_for_auto()

    def after_update(self) -> None:
        """The update's transient allocations raised the allocator's peak, not forward or backward."""
        if self.budget.active:
            self.budget.after_update()

    def _calibrate_for_auto(self) -> None:
        """Calibrate now (every rank with a plan, together). A rank that runs out of memory here leaves the
        others at a barrier: calibration runs at the first step, before memory is tight."""
        try:
            self.calibrate()
        except (MemoryError, torch.cuda.OutOfMemoryError) as e:  # no room to calibrate: keep the fixed split
            self._pending = False
            warnings.warn(f"cannot calibrate ({e}); schedule 'auto' stages half of the subgroups")
        finally:
            self.after_update()  # calibration's own buffers raised the allocator's peak, not the model

    def residents_that_fit(self) -> int:
        """How many subgroups, from the first, the budget lets stay resident: all of them if their states and
        gradient buffer fit beside the measured need; otherwise those that fit beside staging slots and the
        CPU path's scratch as well."""
        room = self.budget.resident_room() if self.budget.active else 0
        biggest = max(self.sizes, default=0)
        if room <= 0:
            return 0
        if RESIDENT_BYTES_PER_ELEMENT * sum(self.sizes) + RESIDENT_SCRATCH_BYTES_PER_ELEMENT * biggest <= room:
            return len(self.sizes)
        room -= self._update_buffers()
        fits = torch.tensor(self.sizes, dtype=torch.int64).cumsum(0) * RESIDENT_BYTES_PER_ELEMENT <= room
        return int(fits.sum())  # the cumulative sum grows: the ones that fit are a prefix

    def _update_buffers(self) -> int:
        """GPU bytes of the update's own buffers at most: its staging slots, the CPU path's scratch, the
        residents' gradient buffer and (``prefetch``) the one of the subgroups filled ahead, each sized for
        the biggest subgroup."""
        fill_grad = FILL_GRAD_BYTES_PER_ELEMENT if self.prefetch else 0
        return (SLOT_BYTES_PER_ELEMENT * self.max_slots + SCRATCH_BYTES_PER_ELEMENT
                + RESIDENT_SCRATCH_BYTES_PER_ELEMENT + fill_grad) * max(self.sizes, default=0)

    def room_ahead(self, resident_bytes: int, ahead_bytes: int) -> int:
        """GPU bytes that slots filled ahead of the update (during backward) may still take: within the
        budget even where forward and backward reach the peak measured for them, beside the residents
        (``resident_bytes``), the update's own buffers and the slots already filled (``ahead_bytes``), no
        more than the link carries in the rest (``fill_cap``), and within what is free now less the headroom
        (backward is still running). 0 before a need was measured (the first step) and without a GPU (no
        budget to fill)."""
        if not self.budget.active or self.budget.need is None:
            return 0
        room = min(self._room_beside(resident_bytes), self.fill_cap()) - ahead_bytes
        return max(0, min(room, self.budget.free() - self.budget.headroom()))

    def _resident_bytes(self) -> int:
        """GPU bytes of the residents of the plan being made: the first ``_want`` subgroups ("auto"), or those
        a fixed schedule places there."""
        if self._fixed is not None:
            return RESIDENT_BYTES_PER_ELEMENT * sum(
                size for size, place in zip(self.sizes, self._fixed) if place is Placement.RESIDENT)
        return RESIDENT_BYTES_PER_ELEMENT * sum(self.sizes[: self._want])

    def _warn_no_slot(self) -> None:
        """Once: a fixed schedule stages subgroups where the budget leaves no room for a staging slot."""
        if not self._warned_no_slot:
            self._warned_no_slot = True
            warnings.warn("gpu_memory_budget leaves no room for a staging slot beside what forward and backward "
                          "were measured to need, but the schedule stages subgroups: the update still uses one, "
                          "which may take the GPU past the budget. Give schedule='offload' or 'auto' (they move "
                          "those subgroups to the CPU), fewer staged subgroups, or a larger budget.")

    def fill_cap(self) -> int | float:
        """GPU bytes worth filling ahead: the slots of what the link carries in the rest of the iteration
        (``carried``, times FILL_CAP): none in the first steps, before a rest is learnt. The link cannot
        bring more in before the update: fills beyond it still queue when the update starts, ahead of its
        own copies up on the one host-to-GPU copy engine, and hold their slots all the while. At 5.2B on an
        H200, 95 subgroups filled ahead took the peak from 32 to 138 GB where the rest carried about 24
        (overlap.md, call 46); bounded, 51.5 GB and 1.087 against 1.331 s (calls 51-54)."""
        if math.isinf(FILL_CAP) or math.isinf(self.carried):
            return math.inf
        return int(FILL_CAP * self.carried) * FILL_BYTES_PER_ELEMENT

    def slots_that_fit(self) -> int:
        """How many staging slots (up to ``max_slots``) fit in the GPU memory free at the update, within the
        budget, beside the residents this plan adds. With ``overlap`` the update holds them into the next
        forward and backward, so they must also fit beside what those were measured to need: the memory free
        at the step (activations gone) would let the next forward run out of it."""
        if not self._gpu:
            return self.max_slots
        free = self.budget.free() if self.budget.active else CudaProbe(self.device).free()
        residents = self._resident_bytes()
        free -= max(0, residents - self._held)
        if self.overlap and self.budget.active and self.budget.need is not None:
            free = min(free, self.budget.resident_room() - residents - self._filled_now)
        biggest = max(self.sizes, default=0)
        if not biggest:  # nothing to stage (every local shard empty)
            return self.max_slots
        fill_grad = FILL_GRAD_BYTES_PER_ELEMENT if self.prefetch else 0  # the fills are held already: not their buffer
        spare = free - (SCRATCH_BYTES_PER_ELEMENT + RESIDENT_SCRATCH_BYTES_PER_ELEMENT + fill_grad) * biggest
        return int(max(0, min(self.max_slots, spare // (SLOT_BYTES_PER_ELEMENT * biggest))))

