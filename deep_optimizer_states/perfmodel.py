"""The performance model: calibrated rates -> predicted update time for a placement; the choice of placement.

Resources: the CPU (fused AdamW on CPU-placed subgroups), the PCIe link (each direction), the GPU. The CPU
and the link share host memory bandwidth, so each slows the other: calibration measures each alone and
both at full tilt together, and the model interpolates linearly in the other's utilisation:

    r = r_alone * (1 - alpha * y / bw_alone)        CPU AdamW rate, given link traffic y per direction
    y = bw_alone * (1 - beta * r / r_alone)         link rate per direction, given CPU AdamW rate r

with alpha, beta fixed so that both at full tilt give the calibrated pair (r_contended, bw_contended).

Per element: a CPU-placed subgroup moves 4 B down (fp32 grad) and 4 B up (fp32 master) and costs one CPU
AdamW element; a staged one moves 12 B each way (master, exp_avg, exp_avg_sq) and one GPU AdamW element;
a resident one costs one GPU AdamW element only. The update runs in two phases: while both the CPU and
the staged transfers have work they run at the contended rates; whichever finishes first leaves the
other to run alone. Pipeline fill and drain (the first transfer before the CPU or the link can start,
the last one after) and a fixed cost per CPU subgroup are added on top.

With equal subgroups, no residents and no contention, this reduces to the paper's stride rule: staging
one subgroup in k balances when (k - 1) CPU updates take as long as one staged subgroup's transfer,
k* = 1 + t_link / t_cpu (``stride_formula``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from .schedule import Placement, spread

STAGED_BYTES = 12  # per element, each direction: fp32 master, exp_avg, exp_avg_sq
CPU_PATH_BYTES = 4  # per element, each direction: fp32 grad down, fp32 master up


@dataclass(frozen=True)
class Rates:
    """Machine rates: elements/s for AdamW and casts, bytes/s per direction for the link."""

    cpu_adam: float  # CPU fused AdamW, alone
    cpu_adam_contended: float  # CPU fused AdamW while the link runs both ways at full speed
    gpu_adam: float  # GPU fused AdamW
    h2d: float  # pinned host->GPU, alone
    d2h: float  # pinned GPU->host, alone
    bidir: float  # per direction, both directions at once
    bidir_contended: float  # per direction, both directions at once while CPU AdamW runs
    gpu_upcast: float  # GPU bf16 -> fp32 (elements/s)
    cpu_downcast: float  # CPU fp32 -> bf16 (elements/s), for reference: the engine casts on the GPU
    per_subgroup_s: float  # fixed cost of one CPU subgroup (event wait, dispatch)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def alpha(self) -> float:
        return (1 - self.cpu_adam_contended / self.cpu_adam) * self.bidir / self.bidir_contended

    @property
    def beta(self) -> float:
        return (1 - self.bidir_contended / self.bidir) * self.cpu_adam / self.cpu_adam_contended


@dataclass(frozen=True)
class Prediction:
    """Predicted update time and what each resource is busy with."""

    seconds: float
    body_s: float  # the overlapped part, without fill and drain
    fill_drain_s: float
    cpu_s: float  # CPU AdamW busy time
    h2d_s: float  # link busy time, host -> GPU
    d2h_s: float  # link busy time, GPU -> host
    gpu_s: float  # GPU AdamW and casts
    bottleneck: str
    staged: int
    cpu: int
    resident: int

    def as_dict(self) -> dict:
        return asdict(self)


def _cpu_with_own_traffic(r: Rates) -> float:
    """CPU AdamW rate when only the CPU path's own grads and masters use the link."""
    return r.cpu_adam / (1 + r.alpha * CPU_PATH_BYTES * r.cpu_adam / r.bidir)


def _contended(r: Rates) -> tuple[float, float]:
    """(CPU AdamW rate, staged bytes/s per direction) while both CPU and staged transfers are busy."""
    a, b = r.alpha, r.beta
    rho = (1 - a) / (1 - a * b)  # CPU rate / r_alone, solving the two linear equations of the module doc
    cpu = r.cpu_adam * rho
    link = r.bidir * (1 - b * rho)
    return cpu, max(link - CPU_PATH_BYTES * cpu, 1e-9)


def predict(sizes: Sequence[int], places: Sequence[Placement], r: Rates, slots: int = 2) -> Prediction:
    """Predicted update time for subgroups of ``sizes`` elements placed as ``places``."""
    cpu_sizes = [n for n, p in zip(sizes, places) if p is Placement.CPU]
    staged_sizes = [n for n, p in zip(sizes, places) if p is Placement.STAGED]
    resident = sum(n for n, p in zip(sizes, places) if p is Placement.RESIDENT)
    c, s = sum(cpu_sizes), sum(staged_sizes)
    link_work = STAGED_BYTES * s  # staged bytes per direction
    alone_link = r.bidir if slots > 1 else r.bidir / 2  # one slot: in and out take turns
    if c and s:
        rc, xc = _contended(r)
        t_a = min(c / rc, link_work / xc)
        cpu_body = c / rc if c / rc <= t_a else t_a + (c - rc * t_a) / _cpu_with_own_traffic(r)
        link_body = link_work / xc if link_work / xc <= t_a else t_a + (link_work - xc * t_a) / alone_link
    else:
        cpu_body = c / _cpu_with_own_traffic(r) if c else 0.0
        link_body = link_work / alone_link if s else 0.0
    gpu_s = (s + resident) / r.gpu_adam + (s + c) / r.gpu_upcast
    cpu_fill = (CPU_PATH_BYTES * (cpu_sizes[0] / r.d2h + cpu_sizes[-1] / r.h2d) + len(cpu_sizes) * r.per_subgroup_s
                if c else 0.0)
    # the way back starts one transfer (and one GPU update) after the way in
    link_fill = STAGED_BYTES * staged_sizes[0] / r.h2d + staged_sizes[-1] / r.gpu_adam if s else 0.0
    cpu_end, link_end = cpu_body + cpu_fill, link_body + link_fill
    seconds = max(cpu_end, link_end, gpu_s)
    body = max(cpu_body, link_body, gpu_s)
    link_bytes = STAGED_BYTES * s + CPU_PATH_BYTES * c
    busy = {"cpu": cpu_body, "link": link_body, "gpu": gpu_s}
    return Prediction(seconds, body, seconds - body, cpu_body, link_bytes / r.bidir, link_bytes / r.bidir, gpu_s,
                      max(busy, key=busy.get), len(staged_sizes), len(cpu_sizes),
                      sum(p is Placement.RESIDENT for p in places))


def choose(sizes: Sequence[int], r: Rates, slots: int = 2) -> tuple[list[Placement], Prediction]:
    """The placement with the least predicted time over every count of staged subgroups, spread evenly."""
    best = None
    for staged in range(len(sizes) + 1):
        places = spread(len(sizes), staged)
        pred = predict(sizes, places, r, slots)
        if best is None or pred.seconds < best[1].seconds:
            best = (places, pred)
    return best


def stride_places(count: int, k: int | None) -> list[Placement]:
    """Subgroups 0, k, 2k, ... staged; ``k=None`` places all on the CPU."""
    return [Placement.STAGED if k and i % k == 0 else Placement.CPU for i in range(count)]


def best_stride(sizes: Sequence[int], r: Rates, slots: int = 2) -> tuple[int | None, Prediction]:
    """The stride k (None: all on the CPU) with the least predicted time: the paper's search space."""
    options = [None, *range(1, len(sizes) + 1)]
    preds = [(k, predict(sizes, stride_places(len(sizes), k), r, slots)) for k in options]
    return min(preds, key=lambda kp: kp[1].seconds)


def stride_formula(subgroup: int, r: Rates) -> float:
    """k* = 1 + t_link / t_cpu for equal subgroups: one staged subgroup's transfer per (k - 1) CPU updates."""
    t_cpu = subgroup / r.cpu_adam
    t_link = STAGED_BYTES * subgroup / (r.bidir - CPU_PATH_BYTES * r.cpu_adam)
    return 1 + t_link / t_cpu


def lower_bound(params: int, r: Rates) -> tuple[float, float]:
    """(seconds, staged fraction): the least update time the rates allow, perfectly overlapped, any split."""
    best = (math.inf, 0.0)
    for i in range(1001):
        f = i / 1000
        t = predict([params * (1 - f), params * f], [Placement.CPU, Placement.STAGED], r).body_s if 0 < f < 1 else \
            predict([params], [Placement.STAGED if f else Placement.CPU], r).body_s
        best = min(best, (t, f))
    return best
