"""Calibration: measure the rates the performance model needs on this machine, and cache them per machine.

The cache is a JSON file under the user's cache directory (``$DOS_CACHE_DIR``, else
``$XDG_CACHE_HOME/deep_optimizer_states``, else ``~/.cache/deep_optimizer_states``), one per machine
fingerprint (GPU, CPU count, torch threads and version). A corrupt or stale file is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from ..core.adam import AdamHyper, adam_update
from ..core.engine import BF16_CPU_PATH_BYTES, DEFAULT_STAGING_SLOTS, Engine, Job
from ..core.host_memory import host_empty
from ..core.lanes import Lane
from ..core.residency import Residents
from ..core.layout import Layout
from ..core.ranks import RankSync, local_ranks
from ..core.schedule import Placement, placements, spread
from .perfmodel import CPU_PATH_BYTES, STAGED_BYTES, Rates, fills

CACHE_VERSION = 6  # 5: engine rates with the default staging slots (4); 6: the resident path's rate
MIN_PER_SUBGROUP_S = 1e-6
RESIDENT_SUBGROUPS = 4  # of the synthetic layout, timed resident (their states take 12 B/element of GPU memory)
# The engine's CPU path runs the bare kernel's AdamW on the same threads: 0.44-0.91 of its rate in every
# calibration on the 2-GPU hosts but one (0.07, 2026-11-30, fsdp2.md call 12), which then planned no CPU work,
# so the refiner never saw the CPU again. Below this fraction the engine's rates are measured again.
LOW_ENGINE_CPU = 0.25
ENGINE_ATTEMPTS = 3
_HYPER = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


def fingerprint(device: torch.device, bf16: bool = False) -> dict:
    """What the rates depend on; ``bf16``: the engine's bf16 CPU path (its own rates, its own file)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    out = {"gpu": gpu, "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "host": platform.node(), "local_ranks": local_ranks()}  # ranks on one host share its bandwidth
    return {**out, "cpu_path": "bf16"} if bf16 else out


def cache_path(device: torch.device, bf16: bool = False) -> Path:
    root = os.environ.get("DOS_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "deep_optimizer_states"  # an empty XDG_CACHE_HOME means unset
    key = hashlib.sha1(json.dumps(fingerprint(device, bf16), sort_keys=True).encode()).hexdigest()[:12]
    return Path(root) / f"calibration-{key}.json"


def load_cached(device: torch.device, bf16: bool = False) -> Rates | None:
    """The cached rates for this machine, or None (with a warning when a file is there but unusable)."""
    path = cache_path(device, bf16)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a calibration record")
        if data.get("version") != CACHE_VERSION or data.get("fingerprint") != fingerprint(device, bf16):
            raise ValueError("stale: made by another version or for another machine")
        rates = Rates(**data["rates"])
        if not all(isinstance(v, (int, float)) and (v > 0 or (k == "resident" and v == 0))
                   for k, v in rates.as_dict().items()):
            raise ValueError("rates must be positive numbers (the resident rate may be 0: not measured)")
        return rates
    except (ValueError, KeyError, TypeError, OSError) as e:  # JSONDecodeError is a ValueError
        warnings.warn(f"ignoring the calibration cache {path}: {e}; recalibrating")
        return None


def save(rates: Rates, device: torch.device, bf16: bool = False) -> Path | None:
    """Cache ``rates`` for this machine; where the cache cannot be written (read-only home, disk full), warn
    and go on with the rates in memory (the next process calibrates again). Returns the file, or None."""
    path = cache_path(device, bf16)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # ranks of one host may save at once
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "fingerprint": fingerprint(device, bf16),
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "rates": rates.as_dict()},
                                  indent=1))
        tmp.replace(path)  # atomic: a crash never leaves half a file
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        warnings.warn(f"cannot cache the calibration in {path.parent} ({e}); set DOS_CACHE_DIR to a writable "
                      "folder to keep it between runs")
        return None
    return path


def calibrated_rates(device: torch.device, force: bool = False, log: Callable[[str], None] | None = None,
                     sync: RankSync | None = None, bf16: bool = False) -> Rates:
    """Cached rates for this machine, measuring (and caching) them first if needed or forced. With ``sync``
    (ranks planning together, who must all call this with ``force``), the ranks measure in lock-step and
    keep the average of their rates. ``bf16``: of the engine with its bf16 CPU path."""
    rates = None if force else load_cached(device, bf16)
    if rates is None:
        sync = sync or RankSync(None, device)
        rates = measure(device, log=log, sync=sync, bf16=bf16)
        rates = Rates(**dict(zip(rates.as_dict(), sync.mean(list(rates.as_dict().values())))))
        save(rates, device, bf16)
    return rates


def _no_barrier() -> None:
    pass


def _rate(fn: Callable[[], None], work: float, sync: Callable[[], None], min_s: float = 0.3,
          barrier: Callable[[], None] = _no_barrier) -> float:
    """work/s of ``fn`` (synchronised after each call): the median of three timed batches after a warm-up,
    started together with the other ranks (``barrier``) so that a shared host is measured shared."""
    fn()
    sync()
    barrier()
    runs = []
    for _ in range(3):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_s / 3:
            fn()
            sync()
            calls += 1
        runs.append(calls * work / (time.perf_counter() - t0))
    return statistics.median(runs)


def measure(device: torch.device, numel: int | None = None, subgroups: int = 16,
            log: Callable[[str], None] | None = None, sync: RankSync | None = None, bf16: bool = False) -> Rates:
    """Measure every rate of ``Rates`` on ``device`` (a GPU; on the CPU the link is a host memory copy).
    Ranks that share a host call it together with a ``sync`` over them: each rate is then measured while
    every rank runs the same work, which is how training will run."""
    log = log or (lambda s: None)
    ranks = sync or RankSync(None, device)
    barrier = ranks.barrier
    cuda = device.type == "cuda"
    n = numel or (25_000_000 if cuda else 2_000_000)
    wait = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    if cuda:  # start the CUDA context first: its one-off cost is not part of calibrating
        torch.zeros(1, device=device)
        wait()
    start = time.perf_counter()
    p, g, m, v = (torch.randn(n) * s for s in (1.0, 1e-3, 1e-3, 1e-6))
    v.abs_()
    raw = {"cpu_adam": _rate(lambda: adam_update(p, g, m, v, 1, _HYPER), n, wait, barrier=barrier)}
    dp, dg, dm, dv = (t.to(device) for t in (p, g, m, v))
    raw["gpu_adam"] = _rate(lambda: adam_update(dp, dg, dm, dv, 1, _HYPER), n, wait, barrier=barrier)
    link = _Link(device, 3 * n)
    raw["h2d"] = _rate(link.up, 12 * n, wait, barrier=barrier)
    raw["d2h"] = _rate(link.down, 12 * n, wait, barrier=barrier)
    raw["bidir"] = _rate(link.both, 12 * n, wait, barrier=barrier)
    del link
    half = torch.randn(n, device=device).to(torch.bfloat16)
    raw["gpu_upcast"] = _rate(lambda: dp.copy_(half), n, wait, barrier=barrier)
    host_half = torch.empty(n, dtype=torch.bfloat16)
    raw["cpu_downcast"] = _rate(lambda: host_half.copy_(p), n, wait, barrier=barrier)
    rates = _engine_rates_checked(device, n, subgroups, raw, ranks, log, bf16)
    log(f"calibrated in {time.perf_counter() - start:.1f} s ({torch.get_num_threads()} CPU threads, "
        f"{subgroups} subgroups of {n / 1e6:g}M elements):")
    for line in describe(rates):
        log("  " + line)
    return rates


def _engine_rates_checked(device: torch.device, n: int, count: int, raw: dict, sync: RankSync,
                          log: Callable[[str], None], bf16: bool = False) -> Rates:
    """The engine's rates; measured again (all ranks, while any rank's CPU path read below ``LOW_ENGINE_CPU``
    of the bare kernel) and the attempt with the fastest CPU path kept: a host busy with something else
    slows a reading, never speeds it up. A reading still low after ``ENGINE_ATTEMPTS`` warns: "auto" would
    then leave the CPU idle, and updates that never use the CPU cannot correct its rate."""
    rates = _engine_rates(device, n, count, raw, sync.barrier, bf16)
    for _ in range(ENGINE_ATTEMPTS - 1):
        if not sync.anyone(rates.cpu_engine < LOW_ENGINE_CPU * rates.cpu_adam):
            return rates
        log(f"the engine's CPU path ran at {rates.cpu_engine / 1e9:.2f} G elements/s against the bare AdamW "
            f"kernel's {rates.cpu_adam / 1e9:.2f}: measuring the engine again")
        rates = max(rates, _engine_rates(device, n, count, raw, sync.barrier, bf16), key=lambda r: r.cpu_engine)
    if rates.cpu_engine < LOW_ENGINE_CPU * rates.cpu_adam:
        warnings.warn(f"calibration: the engine's CPU path ran at {rates.cpu_engine / 1e9:.2f} G elements/s in "
                      f"{ENGINE_ATTEMPTS} attempts against the bare AdamW kernel's {rates.cpu_adam / 1e9:.2f}, so "
                      "\"auto\" will put little or nothing on the CPU. If the host was busy (another job, another "
                      f"process freeing memory), measure again: delete {cache_path(device, bf16)} (or call "
                      "opt.calibrate(force=True), on every rank of a sharded model); if the CPU threads "
                      f"({torch.get_num_threads()}) are as many as the cores, pass fewer (cpu_threads=)")
    return rates


@torch.no_grad()
def _engine_rates(device: torch.device, n: int, count: int, raw: dict,
                  barrier: Callable[[], None] = _no_barrier, bf16: bool = False) -> Rates:
    """Run the engine on a synthetic layout: all on the CPU, all staged, and two mixes (contended rates)."""
    params = [torch.nn.Parameter(torch.randn(n, device=device).to(torch.bfloat16)) for _ in range(count)]
    for p in params:
        p.grad = torch.empty_like(p).normal_(0.0, 1e-3)
    layout = Layout([(params, [f"p{i}" for i in range(count)])], n, device)
    engine = Engine(device, bf16)
    path_bytes = BF16_CPU_PATH_BYTES if engine.bf16_kernel is not None else CPU_PATH_BYTES  # bf16 params here
    sizes = [sg.numel for sg in layout.subgroups]
    unknown = dict.fromkeys(("cpu_engine", "cpu_contended", "link", "link_contended", "per_subgroup_s"), 1.0)
    raw_only = Rates(**raw, **unknown, cpu_path_bytes=path_bytes)  # enough to price the unoverlapped first and last transfers

    def run(places: list[Placement]) -> tuple[float, float, float, float]:
        """Medians of three updates after a warm-up: wall seconds less each path's first and last
        transfers (CPU path, staged path), CPU AdamW seconds, and the staged subgroups' window."""
        jobs = [Job(sg, place, _HYPER, 1) for sg, place in zip(layout.subgroups, places)]
        engine.update(jobs, max_slots=DEFAULT_STAGING_SLOTS)
        barrier()
        stats = [engine.update(jobs, max_slots=DEFAULT_STAGING_SLOTS) for _ in range(3)]
        wall = statistics.median(s.seconds for s in stats)
        cpu_fill, link_fill = fills(sizes, places, raw_only)
        # the first and last transfers, priced from raw rates, can exceed a tiny layout's whole update
        # (the CPU machine of the tests): half of the update at least, so that every rate stays positive
        return (max(wall - cpu_fill, wall / 2), max(wall - link_fill, wall / 2),
                statistics.median(s.cpu_adam_seconds for s in stats),
                statistics.median(s.staged_window_s for s in stats))

    def on_cpu(places: list[Placement]) -> int:
        return sum(n for n, p in zip(sizes, places) if p is Placement.CPU)

    total = sum(sizes)
    cpu_body, _, cpu_s, _ = run(placements("cpu", count))
    # event waits, dispatch, hand-offs: besides AdamW; at least 1 us, so that a noisy reading never stores a
    # zero that load_cached refuses (which would recalibrate every time)
    per_subgroup_s = max(cpu_body - cpu_s, MIN_PER_SUBGROUP_S * count) / count
    _, link_body, _, _ = run(placements("gpu", count))
    # Two mixes, so that each contended rate is read while the other side is busy all along: mostly staged
    # (the link outlasts the CPU) for the CPU's rate, mostly on the CPU (the CPU outlasts the staged
    # transfers) for the link's rate, counting the CPU path's own bytes that moved meanwhile.
    link_bound, cpu_bound = spread(count, round(count * 5 / 8)), spread(count, max(1, count // 5))
    cpu_contended = on_cpu(link_bound) / run(link_bound)[2]
    window = max(run(cpu_bound)[3], 1e-9)
    staged_bytes = STAGED_BYTES * (total - on_cpu(cpu_bound))
    return Rates(**raw, cpu_engine=total / cpu_s, cpu_contended=cpu_contended, link=STAGED_BYTES * total / link_body,
                 link_contended=staged_bytes / window + path_bytes * cpu_contended, per_subgroup_s=per_subgroup_s,
                 resident=_resident_rate(engine, layout.subgroups[:RESIDENT_SUBGROUPS], barrier),
                 cpu_path_bytes=path_bytes)


def _resident_rate(engine: Engine, subgroups: list, barrier: Callable[[], None]) -> float:
    """Elements/s of the resident path in the engine (gather and up-cast the gradients, AdamW, scatter the
    params, on the GPU): the median of three in-place updates after the one that admits them. 0.0 (priced
    as the GPU AdamW kernel) when they found no GPU memory; every rank passes the same barriers either way."""
    jobs = [Job(sg, Placement.RESIDENT, _HYPER, 1) for sg in subgroups]
    residents = Residents(engine.device)
    with warnings.catch_warnings():  # a failed admission warns; here it only means "not measured"
        warnings.simplefilter("ignore")
        engine.update(jobs, residents=residents)
        barrier()
        stats = [engine.update(jobs, residents=residents) for _ in range(3)]
    if any(s.resident_subgroups != len(jobs) for s in stats):
        return 0.0
    return sum(sg.numel for sg in subgroups) / statistics.median(s.seconds for s in stats)


class _Link:
    """Pinned host buffers and device buffers for timing copies each way, on their own streams."""

    def __init__(self, device: torch.device, numel: int) -> None:
        cuda = device.type == "cuda"
        self.src, self.dst = host_empty(numel, torch.float32, cuda), host_empty(numel, torch.float32, cuda)
        self.src.fill_(1.0)
        self.dst.fill_(0.0)
        self.dev_in, self.dev_out = torch.empty(numel, device=device), torch.ones(numel, device=device)
        self.lanes = (Lane(device), Lane(device))

    def up(self) -> None:
        with self.lanes[0].run():
            self.dev_in.copy_(self.src, non_blocking=True)

    def down(self) -> None:
        with self.lanes[1].run():
            self.dst.copy_(self.dev_out, non_blocking=True)

    def both(self) -> None:
        self.up()
        self.down()


def describe(r: Rates) -> list[str]:
    """Each rate with its unit."""
    return [f"CPU fused AdamW kernel         {r.cpu_adam / 1e9:7.2f} G elements/s",
            f"  in the engine, CPU path only {r.cpu_engine / 1e9:7.2f} G elements/s",
            f"  in the engine, link busy     {r.cpu_contended / 1e9:7.2f} G elements/s",
            f"GPU fused AdamW kernel         {r.gpu_adam / 1e9:7.2f} G elements/s",
            f"  resident path in the engine  {r.resident / 1e9:7.2f} G elements/s (0: not measured)",
            f"host->GPU pinned copy          {r.h2d / 1e9:7.2f} GB/s",
            f"GPU->host pinned copy          {r.d2h / 1e9:7.2f} GB/s",
            f"both directions at once        {r.bidir / 1e9:7.2f} GB/s each way",
            f"engine transfers, all staged   {r.link / 1e9:7.2f} GB/s each way",
            f"  while the CPU runs AdamW     {r.link_contended / 1e9:7.2f} GB/s each way",
            f"GPU bf16->fp32 up-cast         {r.gpu_upcast / 1e9:7.2f} G elements/s",
            f"CPU fp32->bf16 down-cast       {r.cpu_downcast / 1e9:7.2f} G elements/s",
            f"fixed cost per CPU subgroup    {r.per_subgroup_s * 1e3:7.2f} ms (engine, besides AdamW)"]
