"""The performance model: calibrated rates -> predicted update time for a placement; the choice of placement.

Resources: the CPU (fused AdamW on CPU-placed subgroups), the PCIe link, the GPU. The CPU and the link
share host memory bandwidth, so each slows the other. Calibration therefore runs the engine itself on a
small synthetic layout and measures two regimes: each path alone (all subgroups on the CPU; all staged)
and both at once (5 in 8 staged, so the link is busy all the time the CPU runs), reading the CPU AdamW
time from the engine's telemetry. Raw kernel and copy rates are measured too, for fill and drain.

Per element: a CPU-placed subgroup moves 4 B down (fp32 grad) and 4 B up (fp32 master; 2 and 2 with
``bf16_cpu_path``: ``Rates.cpu_path_bytes``, set by the engine that was calibrated) and costs one CPU
AdamW element; a staged one moves 12 B each way (master, exp_avg, exp_avg_sq) and one GPU AdamW element;
a resident one costs the GPU its gather, AdamW and scatter (the engine's calibrated resident rate) and no
PCIe traffic. The update runs in two phases: while both the CPU and
the link have work, both run at their contended rates; whichever finishes first leaves the other to run
alone. The link's work is the staged bytes plus the CPU path's own (4 B per element each way). Pipeline
fill and drain (the first transfer before the CPU or the link can start, the last one after) and a fixed
cost per CPU subgroup are added on top.

With equal subgroups and no residents this reduces to the paper's stride rule: staging one subgroup in k
balances when (k - 1) CPU updates take as long as one staged subgroup's transfer,
k* = 1 + t_link / t_cpu (``stride_formula``).

The iteration around the update gives it a ``Window`` (what ``plan.Planner`` learnt from recent steps):
- ``ahead`` (``speculate``): elements of the CPU path's AdamW run during backward and kept. The CPU path has
  that much less to do beside the link, so the balance moves towards the CPU; its transfers and
  per-subgroup costs are still priced (conservatively: their params still go up in the update).
- ``filled`` (``prefetch``): elements of staged subgroups whose way in came during backward. Their 12 B
  per element up leave the update's host-to-GPU direction; the first staged subgroup's fill leaves the
  pipeline's fill once it is among them.
- ``overlap``: the update runs beside the next forward, which waits only for params. A staged subgroup's
  way back then leaves the critical path (its params are written on the GPU first), so the price is the
  time until the last param is written, and the link's whole traffic of a step, both ways
  (``Prediction.cycle_s``), bounds the iteration instead: ``Prediction.iteration_s`` is the larger of
  ``rest_s`` (the rest of the iteration: backward, the step's own work, the forward after the last write)
  plus the update, and that cycle. ``choose`` minimises ``iteration_s``; without overlap it is ``rest_s``
  plus the update. So with prefetch and overlap, staging is priced by the link's cycle rather than inside
  the update, and the plan stages more (on an H200, 1.36B: 19 of 55 staged without it; half staged ran
  0.290 against 0.374 s, docs/benchmarks/overlap.md call 38).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

import torch

from ..core.engine import CPU_PATH_BYTES, STAGED_BYTES
from ..core.schedule import Placement, spread


@dataclass(frozen=True)
class Rates:
    """Machine rates: elements/s for AdamW and casts, bytes/s (per direction) for copies."""

    cpu_adam: float  # CPU fused AdamW kernel, nothing else running
    cpu_engine: float  # CPU AdamW in the engine, all subgroups on the CPU (only their own grads/masters move)
    cpu_contended: float  # CPU AdamW in the engine while staged subgroups stream both ways
    gpu_adam: float  # GPU fused AdamW kernel
    h2d: float  # pinned host->GPU copy, alone
    d2h: float  # pinned GPU->host copy, alone
    bidir: float  # pinned copies both directions at once, per direction
    link: float  # the engine's transfers, all subgroups staged, per direction
    link_contended: float  # the engine's transfers (staged and CPU path) while the CPU runs AdamW, per direction
    gpu_upcast: float  # GPU bf16 -> fp32 (elements/s)
    cpu_downcast: float  # CPU fp32 -> bf16 (elements/s), for reference: the engine casts on the GPU
    per_subgroup_s: float  # fixed cost of one CPU subgroup (event wait, dispatch)
    resident: float = 0.0  # the engine's resident path (gather, up-cast, AdamW, scatter); 0: not measured
    cpu_path_bytes: float = CPU_PATH_BYTES  # PCIe bytes per CPU element each way in the calibrated engine

    @property
    def resident_path(self) -> float:
        """Elements/s of a resident update: measured, else (an older calibration) the AdamW kernel's."""
        return self.resident or self.gpu_adam

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Window:
    """What the iteration around the update gives it (all defaults: an update alone, nothing overlapped)."""

    ahead: float = 0.0  # CPU AdamW elements run during backward and kept (``speculate``)
    filled: float = 0.0  # staged elements whose way in came during backward (``prefetch``); math.inf: all
    overlap: bool = False  # the next forward waits only for params: the staged way back is off the critical path
    rest_s: float = 0.0  # the iteration's time outside the update (0: not measured yet)

    def __post_init__(self) -> None:
        if min(self.ahead, self.filled, self.rest_s) < 0 or math.isnan(self.ahead + self.filled + self.rest_s):
            raise ValueError(f"a window's elements and seconds are >= 0, got {self}")


ISOLATED = Window()


@dataclass(frozen=True)
class Prediction:
    """Predicted update time and what each resource is busy with."""

    seconds: float  # the update; with ``Window.overlap`` until its last param is written
    body_s: float  # the overlapped part, without fill and drain
    fill_drain_s: float
    cpu_s: float  # CPU AdamW busy time
    link_s: float  # link busy time in the update, the busier direction (staged subgroups, the CPU path's copies)
    gpu_s: float  # GPU AdamW and casts
    bottleneck: str
    staged: int
    cpu: int
    resident: int
    cycle_s: float = 0.0  # the link's busy time per step, each direction, wherever it runs (every copy of the update)
    iteration_s: float = 0.0  # what ``choose`` minimises: the window's rest plus the update, at least the cycle

    def as_dict(self) -> dict:
        return asdict(self)


def _two_phases(work_a: float, rate_a: float, alone_a: float, work_b: float, rate_b: float,
                alone_b: float) -> tuple[float, float]:
    """Finish times of two jobs that run at contended rates while both run, alone rates after."""
    if not work_a or not work_b:
        return (work_a / alone_a if work_a else 0.0), (work_b / alone_b if work_b else 0.0)
    together = min(work_a / rate_a, work_b / rate_b)
    end_a = together + (work_a - rate_a * together) / alone_a
    end_b = together + (work_b - rate_b * together) / alone_b
    return end_a, end_b


class Counts(NamedTuple):
    """What a placement's price depends on: each path's element sum and subgroup count, and the sizes of
    each path's first and last subgroups (0 when the path has none)."""

    cpu_sum: float
    staged_sum: float
    resident_sum: float
    cpu: int
    staged: int
    resident: int
    cpu_first: float = 0
    cpu_last: float = 0
    staged_first: float = 0
    staged_last: float = 0


def counts(sizes: Sequence[float], places: Sequence[Placement]) -> Counts:
    """The ``Counts`` of subgroups of ``sizes`` elements placed as ``places``."""
    cpu = [n for n, p in zip(sizes, places) if p is Placement.CPU]
    staged = [n for n, p in zip(sizes, places) if p is Placement.STAGED]
    resident = [n for n, p in zip(sizes, places) if p is Placement.RESIDENT]
    return Counts(sum(cpu), sum(staged), sum(resident), len(cpu), len(staged), len(resident),
                  cpu[0] if cpu else 0, cpu[-1] if cpu else 0, staged[0] if staged else 0,
                  staged[-1] if staged else 0)


def _fills(k: Counts, r: Rates, w: Window = ISOLATED) -> tuple[float, float]:
    cpu_fill = r.cpu_path_bytes * (k.cpu_first / r.d2h + k.cpu_last / r.h2d) if k.cpu else 0.0
    first_in = 0.0 if w.filled >= k.staged_first else STAGED_BYTES * k.staged_first / r.h2d  # filled in order
    link_fill = first_in + k.staged_last / r.gpu_adam if k.staged else 0.0
    return cpu_fill, link_fill


def fills(sizes: Sequence[float], places: Sequence[Placement], r: Rates,
          window: Window = ISOLATED) -> tuple[float, float]:
    """Transfers that nothing overlaps: the CPU path's first grad down and last master up; the staged path's
    first way in (unless it came during backward) and last GPU update (the way back starts one transfer
    after the way in)."""
    return _fills(counts(sizes, places), r, window)


def predict(sizes: Sequence[float], places: Sequence[Placement], r: Rates, slots: int = 2,
            window: Window = ISOLATED) -> Prediction:
    """Predicted update time for subgroups of ``sizes`` elements placed as ``places``, in ``window``."""
    return price(counts(sizes, places), r, slots, window)


def price(k: Counts, r: Rates, slots: int = 2, window: Window = ISOLATED) -> Prediction:
    """Predicted update time of a placement given by its ``Counts``: constant time in the subgroup count."""
    w = window
    c, s, resident = max(0.0, k.cpu_sum - w.ahead), k.staged_sum, k.resident_sum
    turns = 1 if slots > 1 else 2  # one slot: the way in and the way back take turns
    cpu_copies = r.cpu_path_bytes * k.cpu_sum
    way_in = STAGED_BYTES * (s - min(s, w.filled)) + cpu_copies  # bytes, host to GPU, in the update
    way_out = (0 if w.overlap else STAGED_BYTES * s) + cpu_copies  # bytes, GPU to host, the update waits for
    link_work = max(way_in, way_out)
    cycle = (STAGED_BYTES * s + cpu_copies) / r.link_contended
    if s:
        cpu_body, link_body = _two_phases(c, r.cpu_contended, r.cpu_engine,
                                          link_work, r.link_contended / turns, r.link / turns)
    else:  # the CPU path alone: its rate already includes its own light traffic
        cpu_body, link_body = c / r.cpu_engine, link_work / r.link
    gpu_s = s / r.gpu_adam + resident / r.resident_path + (s + c) / r.gpu_upcast
    cpu_fill, link_fill = _fills(k, r, w)
    cpu_fill += k.cpu * r.per_subgroup_s
    seconds = max(cpu_body + cpu_fill, link_body + link_fill, gpu_s)
    body = max(cpu_body, link_body, gpu_s)
    busy = {"cpu": cpu_body, "link": link_body, "gpu": gpu_s}
    iteration = max(w.rest_s + seconds, cycle) if w.overlap else w.rest_s + seconds
    return Prediction(seconds, body, seconds - body, cpu_body, link_body, gpu_s,
                      max(busy, key=busy.get), k.staged, k.cpu, k.resident, cycle, iteration)


def choose(sizes: Sequence[int], r: Rates, slots: int = 2, resident: int = 0,
           window: Window = ISOLATED) -> tuple[list[Placement], Prediction]:
    """The placement with the least predicted iteration (``Prediction.iteration_s``) over every count of
    staged subgroups, spread evenly, beside ``resident`` elements updated resident (their GPU time counts,
    they are not placed here), in ``window``.

    Every count is priced at once from its sums and end subgroups (``_times_by_count``): a few vector
    operations over the counts instead of a placement list per count. The winner (the smallest count among
    equal times) gets the same prediction as ``predict`` gives its placement with the residents.
    """
    table = torch.tensor(sizes, dtype=torch.int64)
    staged = int(torch.argmin(_times_by_count(table, r, slots, resident, window)))
    return spread(len(sizes), staged), price(_spread_counts(table, staged, resident), r, slots, window)


def _marks_below(table: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """For each staged count in ``s``: the elements of the subgroups ``spread`` stages. It marks index
    (i * count) // s for i < s, so ceil(b * s / count) marks lie below index b; summed over the runs of
    equal sizes (a layout's subgroups are near-equal, so there are few)."""
    count = len(table)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(table[1:] != table[:-1]).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([count])])
    total = torch.zeros_like(s)
    for start, end in zip(starts.tolist(), ends.tolist()):
        total += int(table[start]) * ((end * s + count - 1) // count - (start * s + count - 1) // count)
    return total


def _spread_counts(table: torch.Tensor, staged: int, resident: int = 0) -> Counts:
    """``counts(sizes, spread(len(sizes), staged))`` without the placement list, beside ``resident``
    elements (their subgroups' count is not needed: nothing is priced per resident subgroup)."""
    count, total = len(table), int(table.sum())
    if staged == 0:
        return Counts(total, 0, resident, count, 0, 0, int(table[0]), int(table[-1]))
    staged_sum = int(_marks_below(table, torch.tensor([staged]))[0])
    first, last = int(table[0]), int(table[((staged - 1) * count) // staged])
    if staged == count:
        return Counts(0, staged_sum, resident, 0, count, 0, 0, 0, first, last)
    first_cpu = int(table[-(-staged // (count - staged))])
    return Counts(total - staged_sum, staged_sum, resident, count - staged, staged, 0, first_cpu, int(table[-1]),
                  first, last)


def _times_by_count(table: torch.Tensor, r: Rates, slots: int, resident: int = 0,
                    window: Window = ISOLATED) -> torch.Tensor:
    """``price(_spread_counts(table, s), r, slots, window).iteration_s`` for every s in 0..count, in float64
    with the same operations in the same order as ``price``, so the times are identical. With s in
    1..count-1, the first staged subgroup is 0, the last one (s - 1) * count // s, the first on the CPU
    ceil(s / (count - s)) and the last on the CPU count - 1."""
    count, w = len(table), window
    f64 = torch.float64
    out = torch.empty(count + 1, dtype=f64)
    out[0] = price(_spread_counts(table, 0, resident), r, slots, w).iteration_s
    out[count] = price(_spread_counts(table, count, resident), r, slots, w).iteration_s
    if count == 1:
        return out
    s = torch.arange(1, count, dtype=torch.int64)  # the mixes: at least one subgroup on each path
    staged_sum = _marks_below(table, s)
    total = int(table.sum())
    cpu_sum = total - staged_sum
    first_cpu = table[(s + (count - s) - 1) // (count - s)].to(f64)
    last_staged = table[((s - 1) * count) // s].to(f64)
    c, st = torch.clamp(cpu_sum.to(f64) - w.ahead, min=0.0), staged_sum.to(f64)
    turns = 1 if slots > 1 else 2
    cpu_copies = r.cpu_path_bytes * cpu_sum.to(f64)
    way_in = STAGED_BYTES * (st - torch.clamp(st, max=w.filled)) + cpu_copies
    way_out = (0 if w.overlap else STAGED_BYTES * st) + cpu_copies
    link_work = torch.maximum(way_in, way_out)
    cycle = (STAGED_BYTES * st + cpu_copies) / r.link_contended
    rate_b, alone_b = r.link_contended / turns, r.link / turns
    together = torch.minimum(c / r.cpu_contended, link_work / rate_b)
    cpu_body = together + (c - r.cpu_contended * together) / r.cpu_engine
    link_body = together + (link_work - rate_b * together) / alone_b
    gpu_s = st / r.gpu_adam + resident / r.resident_path + float(total) / r.gpu_upcast
    cpu_fill = r.cpu_path_bytes * (first_cpu / r.d2h + float(table[-1]) / r.h2d)
    first_in = 0.0 if w.filled >= float(table[0]) else STAGED_BYTES * float(table[0]) / r.h2d
    link_fill = first_in + last_staged / r.gpu_adam
    cpu_fill = cpu_fill + (count - s).to(f64) * r.per_subgroup_s
    seconds = torch.maximum(torch.maximum(cpu_body + cpu_fill, link_body + link_fill), gpu_s)
    out[1:count] = torch.maximum(w.rest_s + seconds, cycle) if w.overlap else w.rest_s + seconds
    return out


def stride_places(count: int, k: int | None) -> list[Placement]:
    """Subgroups 0, k, 2k, ... staged; ``k=None`` places all on the CPU."""
    return [Placement.STAGED if k and i % k == 0 else Placement.CPU for i in range(count)]


def best_stride(sizes: Sequence[int], r: Rates, slots: int = 2) -> tuple[int | None, Prediction]:
    """The stride k (None: all on the CPU) with the least predicted time: the paper's search space."""
    options = [None, *range(1, len(sizes) + 1)]
    preds = [(k, predict(sizes, stride_places(len(sizes), k), r, slots)) for k in options]
    return min(preds, key=lambda kp: kp[1].seconds)


def stride_formula(subgroup: int, r: Rates) -> float:
    """k* = 1 + t_link / t_cpu for equal subgroups: one staged subgroup's transfer per (k - 1) CPU updates.

    t_link is the staged subgroup's transfer on the link left over by the CPU path's own traffic.
    """
    t_cpu = subgroup / r.cpu_contended
    t_link = STAGED_BYTES * subgroup / (r.link_contended - r.cpu_path_bytes * r.cpu_contended)
    return 1 + t_link / t_cpu


def lower_bound(params: int, r: Rates) -> tuple[float, float]:
    """(seconds, staged fraction): the least update time the rates allow, perfectly overlapped, any split."""
    def body(f: float) -> float:
        return predict([params * (1 - f), params * f], [Placement.CPU, Placement.STAGED], r).body_s

    return min((body(i / 1000), i / 1000) for i in range(1001))
