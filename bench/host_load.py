"""What the host gave a run: the VM's CPU time taken by the hypervisor, preemptions, and memory bandwidth.

The iteration follows the CPU path's AdamW rate inside the update (2.3-3.7 G elements/s between runs of the
same settings on machines of one kind, overlap.md calls 71-90), and nothing in the rows said why. Three
candidates can be read from inside the VM, so each run records them (``row["host_load"]``):

- ``steal``: the share of the VM's CPU time over the timed loop that the hypervisor gave to someone else
  (``/proc/stat``'s steal column): neighbours on the same physical cores.
- ``busy``: the share the VM spent working (user, system, interrupts), and the process's involuntary
  context switches per second (``/proc/self/task/*/status``): threads preempted, by ours or by others.
- ``copy_GBps``: host memory bandwidth measured in the process after setup and before the first step (a
  256 MB copy, read plus write, best of three): neighbours' memory traffic, or a slow placement of this
  process's memory.
- ``slowest_vcpu``: the speed of the slowest CPU this process may run on, over the fastest's, measured beside
  ``copy_GBps`` (the same loop timed on each CPU in turn, this thread bound to it), and ``vcpu_speeds`` each
  CPU's: with a fixed share per thread (the CPU kernel before H200 calls 119-124) one vCPU the hypervisor
  shares would hold up every update; the H200 hosts read 0.35-0.65 in every run of calls 119-124, and which
  CPUs read slow says whether it is always the same ones (docs/benchmarks/cpu-kernel.md).

Off Linux, or where a file cannot be read, a field is None.
"""

from __future__ import annotations

import glob
import os
import statistics
import time
from dataclasses import dataclass

import torch

_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class Snapshot:
    """The host's CPU counters (jiffies, all CPUs) and this process's involuntary switches at one moment."""

    cpu: dict[str, int] | None
    nonvoluntary: int | None
    at: float

    @staticmethod
    def take() -> "Snapshot":
        return Snapshot(_read_cpu(), _read_nonvoluntary(), time.perf_counter())


def parse_cpu_line(text: str) -> dict[str, int] | None:
    """The aggregate ``cpu`` line of ``/proc/stat`` as named counters (missing trailing ones count 0)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:1 + len(_FIELDS)]]
            return dict(zip(_FIELDS, values + [0] * (len(_FIELDS) - len(values))))
    return None


def parse_nonvoluntary(status_text: str) -> int | None:
    """``nonvoluntary_ctxt_switches`` of one ``/proc/<pid>/task/<tid>/status``."""
    for line in status_text.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    return None


def _read_cpu() -> dict[str, int] | None:
    try:
        with open("/proc/stat") as f:
            return parse_cpu_line(f.read())
    except OSError:
        return None


def _read_nonvoluntary() -> int | None:
    """The sum over this process's live threads (a thread that ended meanwhile takes its count with it)."""
    total, found = 0, False
    for path in glob.glob("/proc/self/task/*/status"):
        try:
            with open(path) as f:
                count = parse_nonvoluntary(f.read())
        except OSError:
            continue
        if count is not None:
            total, found = total + count, True
    return total if found else None


def between(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """Steal and busy shares of the host's CPU time between two snapshots, and involuntary switches per s."""
    out: dict[str, float | None] = {"steal": None, "busy": None, "preempted_per_s": None}
    seconds = after.at - before.at
    if before.cpu and after.cpu:
        delta = {k: after.cpu[k] - before.cpu[k] for k in _FIELDS}
        total = sum(delta.values())
        if total > 0:
            out["steal"] = round(delta["steal"] / total, 4)
            out["busy"] = round(sum(delta[k] for k in ("user", "nice", "system", "irq", "softirq")) / total, 4)
    if before.nonvoluntary is not None and after.nonvoluntary is not None and seconds > 0:
        out["preempted_per_s"] = round(max(0, after.nonvoluntary - before.nonvoluntary) / seconds, 1)
    return out


def copy_bandwidth_gbps(megabytes: int = 256, repeats: int = 3) -> float:
    """Host memory GB/s of a copy between two fresh buffers (bytes read plus written), the best of
    ``repeats``: torch's CPU copy runs on its intra-op threads, as the CPU path's AdamW does."""
    count = megabytes * 2**20 // 4
    src, dst = torch.ones(count), torch.empty(count)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return round(2 * src.numel() * 4 / best / 1e9, 1)


def openmp_runtimes() -> list[str] | None:
    """The OpenMP runtimes mapped into this process (libgomp, libiomp, libomp), by path. Two means two
    thread pools: torch's intra-op threads and the CPU kernel's (built with the compiler's ``-fopenmp``)
    would then be apart, each team's threads spinning after its regions beside the other's work. None off
    Linux."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if len(line.split()) >= 6}
    except OSError:
        return None
    return sorted(p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp")))


def _spin(count: int) -> float:
    """Seconds this thread takes for ``count`` turns of a plain Python loop (one core's speed, no memory)."""
    t = time.perf_counter()
    for _ in range(count):
        pass
    return time.perf_counter() - t


def vcpu_speeds(count: int = 200_000, repeats: int = 5) -> dict[int, float] | None:
    """Each CPU this process may run on: its speed over the fastest's (1.0 the fastest), the median of
    ``repeats`` timings of the same loop with this thread bound to it; None where threads cannot be bound."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    seconds = {}
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})  # this thread only
            seconds[cpu] = statistics.median(_spin(count) for _ in range(repeats))
    except OSError:
        return None
    finally:
        os.sched_setaffinity(0, allowed)
    fastest = min(seconds.values())
    return {cpu: round(fastest / t, 3) for cpu, t in seconds.items()}
