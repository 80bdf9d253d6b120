"""Time one system training one model under one GPU memory budget; prints one ``RESULT {json}`` line.

    python -m bench.run_system --system ours_auto --model 1.36b [--budget-gb 40] [--iters 5 --warmup 3]

Each system runs in its own process (the suite starts one per system), so memory never leaks between them.
Two measurements per run, after ``warmup`` iterations: ``iters`` iterations with a device synchronize
around each phase (forward, backward, step: the breakdown; each phase's time includes its leading
synchronize, so the phases add up to the wall time), then ``iters`` iterations run as a training loop runs
them, synchronised only by ``loss.item()``: their median wall time is ``iter_s``, their mean ``iter_mean_s``
(a loop whose walls alternate runs at the mean). The second matters for an update left running past
``step()`` (overlap), whose GPU work a synchronize outside the timers would hide. ``peak_gpu_GB`` is the
allocator's peak over the whole run, ``free_peak_gpu_GB`` over the free-running loop alone, and
``peak_so_far_gpu_GB`` the loop's peak after each of its iterations (the uncounted first one first): in
which iteration it came. A loop's first iterations still run on what the synchronised ones taught the plan:
``--no-phases`` synchronises none (the warm-up runs free, untimed; no breakdown), as a training loop that
never synchronises runs, to see what it learns and peaks at on its own. ``host_load``: what the host gave the
free-running loop (bench/host_load.py); ``allocator_calls``: how often the GPU allocator went to the driver
during it (``ALLOCATOR_COUNTERS``);
``reserved_gpu_GB``: what it held from the driver at the loop's start and end (steady, or still growing?).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

from bench import host_load
from bench.free_loop import free_running
from bench.systems import OURS, SYSTEMS, Trainer
from deep_optimizer_states.tools.models import PRESETS

RESULT = "RESULT "


def transparent_huge_pages() -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never"; None off Linux), kept in each row: the host
    buffers are on 4 KB pages unless it is "always" (advising them for 2 MB pages was slower, H200 call 76)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def budget_fraction(budget_gb: float | None, total_bytes: int) -> float | None:
    """The fraction for torch.cuda.set_per_process_memory_fraction, or None for the whole device."""
    if budget_gb is None:
        return None
    if budget_gb <= 0:
        raise ValueError(f"a GPU memory budget must be > 0 GB, got {budget_gb}")
    if budget_gb * 1e9 > total_bytes:
        raise ValueError(f"budget {budget_gb} GB is more than the device's {total_bytes / 1e9:.1f} GB")
    return budget_gb * 1e9 / total_bytes


DATA_SEED = 1000


def batch(size: int, seq: int, vocab: int, device: torch.device, seed: int = DATA_SEED) -> torch.Tensor:
    """One batch of tokens, the same for every system and every step: the loss then falls as the model
    learns it, so the loss check can tell an optimizer that updates wrongly from one that works. Another
    ``seed`` repeats a run on fresh data (a result that moves with it is a race, not the data)."""
    return torch.randint(0, vocab, (size, seq), generator=torch.Generator().manual_seed(seed)).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn):
    """(fn(), seconds), with the device synchronised on both sides, both inside the time."""
    t = time.perf_counter()
    _sync(device)
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t


def _host_peak_gb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024 / 1e9
    except (OSError, StopIteration):
        return None


# torch.cuda.memory_stats counters whose growth over the timed loop says the allocator went to the driver in the
# steady state: cudaMalloc and cudaFree (a cudaFree waits for the whole device), retries after a failed cudaMalloc
# (all cached blocks freed first), and synchronisations of every stream (torch >= 2.1; absent keys are left out)
ALLOCATOR_COUNTERS = {"cudaMalloc": "segment.all.allocated", "cudaFree": "segment.all.freed",
                      "retries": "num_alloc_retries", "sync_all_streams": "num_sync_all_streams"}


def allocator_counts(device: torch.device) -> dict[str, int] | None:
    """The allocator's counters now (``ALLOCATOR_COUNTERS``); None without a GPU."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: stats[key] for name, key in ALLOCATOR_COUNTERS.items() if key in stats}


def reserved_gb(device: torch.device) -> float | None:
    """GB torch's caching allocator holds from the driver now (``torch.cuda.memory_reserved``); None without a
    GPU. Growth with no ``cudaFree`` is memory a longer run keeps taking."""
    return round(torch.cuda.memory_reserved(device) / 1e9, 2) if device.type == "cuda" else None


def allocator_calls(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """How much each counter grew between two ``allocator_counts`` (None without a GPU)."""
    if before is None or after is None:
        return None
    return {name: after[name] - before[name] for name in after if name in before}


def oom_state(device: torch.device, trainer: Trainer | None, losses_read: int, loop_iterations: int,
              fraction: float | None = None) -> dict:
    """Where a run that ran out of GPU memory stood: how far it got (iterations whose loss was read before the
    timed loop, and timed-loop iterations done), the allocator's GB then (allocated, reserved: what the
    process's memory ``fraction`` limits, peak, that limit) and, for ours, the optimizer's view read without
    waiting for its update (its budget, the need of forward and backward it measured and what it held at the
    peak that set it, the staging slots of its plan, the slots filled ahead and resident states it held, its
    last update's staged subgroups and buffers; a failed read of it leaves the rest and says why). A 16 GB
    budget ran out of memory at 1.36B with 13.9 GiB allocated and 0.9 GiB reserved beside it (H200 call 150),
    a row with none of this to tell why."""
    state: dict = {"losses_read": losses_read, "loop_iterations": loop_iterations}
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        state.update(allocated_GB=round(torch.cuda.memory_allocated(device) / 1e9, 3),
                     reserved_GB=round(torch.cuda.memory_reserved(device) / 1e9, 3),
                     peak_GB=round(torch.cuda.max_memory_allocated(device) / 1e9, 3),
                     limit_GB=round((1.0 if fraction is None else fraction) * total / 1e9, 3))
    opt = getattr(trainer, "optimizer", None)
    if opt is not None:
        try:
            budget, last = opt.planner.budget, opt.last_update
            gb = lambda n: None if n is None else round(n / 1e9, 3)
            state.update(budget_GB=gb(budget.bytes()) if budget.active else None, need_GB=gb(budget.need),
                         ours_at_need_GB=gb(budget.ours_at_need), slots_planned=opt.plan.slots,
                         filled_ahead_GB=gb(opt.prefetch.bytes()) if opt.prefetch is not None else None,
                         resident_GB=gb(opt.residents.bytes()),
                         last_update=None if last is None else {"staged": last.staged_subgroups,
                                                                "prefetched": last.prefetched,
                                                                "buffers_GB": gb(last.device_bytes)})
        except Exception as e:  # an update still in flight may change what is read
            state["optimizer_error"] = f"{type(e).__name__}: {e}"[:300]
    return state


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def peak_reader(device: torch.device, peaks: list[float]) -> Callable[[], None] | None:
    """On a GPU, what the timed loop calls after each iteration: append the allocator's peak GB so far (since
    the loop's start) to ``peaks``, which thereby says in which iteration the loop's peak came. Read, never
    reset: the optimizer learns what forward and backward need from rises of the same statistic
    (planning/budget.py), so a reset per iteration would change what the measured run plans."""
    if device.type != "cuda":
        return None
    return lambda: peaks.append(round(torch.cuda.max_memory_allocated(device) / 1e9, 4))


def run(system: str, model: str, budget_gb: float | None, iters: int, warmup: int, micro_batch: int, seq: int,
        device: torch.device, data_seed: int = DATA_SEED, phases: bool = True) -> dict:
    """Set the system up, train warmup + 2 x iters steps (see the module docstring), return its result row.
    Without ``phases`` no iteration is synchronised: the warm-up runs as the timed loop does, untimed, and
    the row has no breakdown (what a training loop that never synchronises learns and peaks at)."""
    row = {"system": system, "model": model, "budget_gb": budget_gb, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
           "device_GB": torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None,
           "torch": torch.__version__, "micro_batch": micro_batch, "seq": seq, "data_seed": data_seed,
           "thp": transparent_huge_pages()}
    trainer, losses, peaks, warm, fraction = None, [], [], [], None  # read by oom_state where a run stops short
    try:
        if device.type == "cuda":
            fraction = budget_fraction(budget_gb, torch.cuda.get_device_properties(device).total_memory)
            if fraction is not None:
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.set_per_process_memory_fraction(fraction, index)
        t0 = time.perf_counter()
        trainer = SYSTEMS[system](model, device, micro_batch)
        _sync(device)
        row.update(setup_s=round(time.perf_counter() - t0, 2), params=trainer.params, settings=trainer.settings)
        copy_gbps = host_load.copy_bandwidth_gbps()  # before any step, so no update of ours runs beside it
        speeds = host_load.vcpu_speeds()
        vocab = PRESETS[model][2]
        split = []
        ids = batch(micro_batch, seq, vocab, device, data_seed)
        if not phases and warmup:
            losses += free_running(lambda: trainer.forward(ids), trainer.backward, trainer.step, warmup - 1,
                                   lambda: warm.append(1))[3]
        for _ in range(warmup + iters if phases else 0):
            loss, fwd = _timed(device, lambda: trainer.forward(ids))
            _, bwd = _timed(device, lambda: trainer.backward(loss))
            _, upd = _timed(device, trainer.step)
            losses.append(loss.item())
            split.append((fwd, bwd, upd))
        _sync(device)
        if device.type == "cuda":  # the free-running loop's own peak, apart from the warm-up's and the phases'
            before_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        before, counts, reserved = host_load.Snapshot.take(), allocator_counts(device), reserved_gb(device)
        first_wall, walls, splits, more = free_running(lambda: trainer.forward(ids), trainer.backward,
                                                       trainer.step, iters, peak_reader(device, peaks))
        row["allocator_calls"] = allocator_calls(counts, allocator_counts(device))  # over the timed loop
        row["reserved_gpu_GB"] = None if reserved is None else {"start": reserved, "end": reserved_gb(device)}
        row["openmp_runtimes"] = host_load.openmp_runtimes()  # the CPU kernel, if any, is loaded by now
        load = {**host_load.between(before, host_load.Snapshot.take()), "copy_GBps": copy_gbps,
                "slowest_vcpu": None if not speeds else min(speeds.values()),
                "vcpu_speeds": None if not speeds else {str(cpu): v for cpu, v in speeds.items()}}
        losses += more
        measured = sorted(split[warmup:], key=sum)
        fwd, bwd, step_s = measured[len(measured) // 2] if measured else (None, None, None)
        extra = trainer.extra()
        update_s = extra.get("update_s") or step_s  # ours: the engine's own time (a step may return before it)
        row.update(status="ok", fwd_s=_round(fwd), bwd_s=_round(bwd), step_s=_round(step_s),
                   iter_s=round(statistics.median(walls), 4), iter_mean_s=round(statistics.fmean(walls), 4),
                   iter_walls_s=[round(w, 4) for w in walls],
                   first_wall_s=round(first_wall, 4), walls_split_s=splits,
                   iter_phases_s=_round(fwd + bwd + step_s) if measured else None, phases=phases,
                   update_Gparams_per_s=_round(trainer.params / update_s / 1e9 if update_s else None, 3),
                   losses=losses,
                   peak_gpu_GB=round(max(before_peak, torch.cuda.max_memory_allocated(device)) / 1e9, 2)
                   if device.type == "cuda" else None,
                   free_peak_gpu_GB=round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
                   if device.type == "cuda" else None, peak_so_far_gpu_GB=peaks or None, host_load=load, **extra)
    except Exception as e:  # a system that cannot run is a result too
        row.update(status="oom" if _is_oom(e) else "error", error=f"{type(e).__name__}: {e}"[:800],
                   traceback=traceback.format_exc()[-2000:])
        if _is_oom(e):
            try:
                row["oom_state"] = oom_state(device, trainer, max(len(losses), len(warm)), len(peaks), fraction)
            except Exception as inner:  # the row and its error come first
                row["oom_state"] = {"error": f"{type(inner).__name__}: {inner}"[:300]}
    row["host_peak_GB"] = _host_peak_gb()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    parser.add_argument("--model", default="1.36b")
    parser.add_argument("--budget-gb", type=float, default=None, help="GPU memory budget (default: the device)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data-seed", type=int, default=DATA_SEED, help="seed of the training batch")
    parser.add_argument("--no-phases", action="store_true",
                        help="synchronise no iteration: the warm-up runs free too, and the row has no breakdown")
    args = parser.parse_args(argv)
    row = run(args.system, args.model, args.budget_gb, args.iters, args.warmup, args.micro_batch, args.seq,
              torch.device(args.device), args.data_seed, phases=not args.no_phases)
    print(RESULT + json.dumps(row), flush=True)
    return 0 if row["status"] in ("ok", "oom") or args.system != OURS else 1


if __name__ == "__main__":
    sys.exit(main())
