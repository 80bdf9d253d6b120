"""The bf16-gradient CPU AdamW kernel against torch's fused CPU kernel: elements/s on this host, one JSON line.

    python3 -m bench.cpu_kernel [--numel 25000000] [--threads 1,2] [--dma] [--straggler]

The kernels are timed in turns (one call of each per round, the median of 7 rounds), so a host whose
speed drifts slows them alike. ``--dma`` (a GPU machine) times them again while pinned copies run both
ways over PCIe without pause, as the staged subgroups' copies run beside the CPU path in an update: on
the H200 the engine's bf16 kernel ran at 1.3x torch's time per element there and not during backward
(docs/benchmarks/overlap.md, call 16), which this isolates.

torch's kernel reads fp32 gradients (28 B per element through host memory: p, g, m, v read, p, m, v
written); ours reads bf16 ones (26 B), and with a clip multiplier and the rounded bf16 params written
(28 B: the params with streaming stores; ``..._plain_stores`` is the same built with plain ones, whose
lines are read before they are written, 30 B) does in one pass what the engine otherwise does in two more
(a multiply over the fp32 gradients on the host, the rounding on the GPU after 4 more bytes up). Both are
checked equal, bit for bit, first.
An update run ahead (``speculate``) also keeps the states before aside: ``run_ahead_copy_then_update``
copies them in a pass of its own first, ``run_ahead_saved_in_the_kernel`` in the kernel's pass.
The library's kernel hands its blocks to its threads in chunks as they come free; ``..._fixed_shares`` is
it built to give each thread a fixed share instead (``-DDOS_FIXED_SHARES``, the library's before H200 calls
119-124; rows before then name the chunked build ``..._dynamic_chunks``). ``--straggler`` times them all
again while a process spins on the first CPU this one may use: with the threads bound to cores (run under
``OMP_PROC_BIND=true OMP_PLACES=cores``) one thread then runs at about half speed, as on a vCPU the
hypervisor shares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

import torch

from deep_optimizer_states.core import cpu_adamw
from deep_optimizer_states.core.adam import AdamHyper, adam_update


def rates_in_turns(fns: dict[str, Callable[[], object]], numel: int, rounds: int = 7) -> dict[str, float]:
    """G elements/s of each function, timed in turns: one call of each per round, the median of ``rounds``."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: numel / statistics.median(t) / 1e9 for name, t in times.items()}


class PinnedTraffic:
    """Pinned copies host -> GPU and GPU -> host on two streams, again and again until stopped: the PCIe
    traffic that shares host memory with the CPU path during an update."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.host_in, self.host_out = (torch.empty(numel, pin_memory=True) for _ in range(2))
        self.dev_in, self.dev_out = (torch.empty(numel, device=device) for _ in range(2))
        self.up, self.down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with torch.cuda.stream(self.up):
                self.dev_in.copy_(self.host_in, non_blocking=True)
            with torch.cuda.stream(self.down):
                self.host_out.copy_(self.dev_out, non_blocking=True)
            self.up.synchronize()
            self.down.synchronize()
            self.rounds += 1

    def __enter__(self) -> "PinnedTraffic":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def spinning_on(cpu: int):
    """A process spinning on CPU ``cpu`` while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.5)  # started and bound
        yield
    finally:
        proc.kill()
        proc.wait()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--threads", default=str(torch.get_num_threads()))
    parser.add_argument("--dma", action="store_true", help="also time the kernels beside pinned PCIe copies (a GPU)")
    parser.add_argument("--straggler", action="store_true", help="also time them while a process spins on CPU 0")
    args = parser.parse_args(argv)
    if args.dma and not torch.cuda.is_available():
        print(json.dumps({"status": "--dma needs a GPU"}))
        return 1
    kernel = cpu_adamw.load()
    if kernel is None:
        print(json.dumps({"status": "kernel not available (see the warning)"}))
        return 1
    plain = cpu_adamw.Bf16GradAdam(cpu_adamw.build(["DOS_PLAIN_STORES"]), kernel.variant)  # the params' old stores
    fixed = cpu_adamw.Bf16GradAdam(cpu_adamw.build(["DOS_FIXED_SHARES"]), kernel.variant)
    n, h = args.numel, AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    p, m, v = torch.randn(n), torch.zeros(n), torch.rand(n) * 1e-6
    g32 = torch.randn(n) * 1e-3
    g16, out = g32.bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    clip = torch.tensor(0.5)
    spare = torch.empty(3, n)  # speculation's spare: pageable host memory

    def copy_then_update():  # an update run ahead before: the states copied aside in a pass of their own
        for dst, src in zip(spare, (p, m, v)):
            dst.copy_(src)
        kernel(p, g16, m, v, 5, h, (), out)

    fns = {"torch_fp32_grads": lambda: adam_update(p, g32, m, v, 5, h),
           "torch_fp32_grads_with_clip_multiply": lambda: (g32.mul_(clip), adam_update(p, g32, m, v, 5, h)),
           "ours_bf16_grads": lambda: kernel(p, g16, m, v, 5, h),
           "ours_bf16_grads_clip_bf16_params": lambda: kernel(p, g16, m, v, 5, h, (0.5,), out),
           "ours_bf16_grads_clip_bf16_params_plain_stores": lambda: plain(p, g16, m, v, 5, h, (0.5,), out),
           "ours_bf16_grads_clip_bf16_params_fixed_shares": lambda: fixed(p, g16, m, v, 5, h, (0.5,), out),
           "run_ahead_copy_then_update": copy_then_update,
           "run_ahead_saved_in_the_kernel": lambda: kernel(p, g16, m, v, 5, h, (), out, spare)}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        row = {"date": time.strftime("%Y-%m-%d"), "numel": n, "threads": threads, "cpu": cpu_name(),
               "torch": torch.__version__, "timing": "in turns, median of 7 rounds",
               "omp_proc_bind": os.environ.get("OMP_PROC_BIND"),
               "equal_bit_for_bit": all(cpu_adamw.mismatch(k, seed=threads) is None for k in (kernel, plain, fixed))}
        row.update({f"{name}_G_per_s": rate for name, rate in rates_in_turns(fns, n).items()})
        if args.dma:
            with PinnedTraffic(n, torch.device("cuda")) as traffic:
                start = time.perf_counter()
                beside = rates_in_turns(fns, n)
                seconds = time.perf_counter() - start
            row.update({f"beside_dma_{name}_G_per_s": rate for name, rate in beside.items()})
            row["dma_GB_per_s_each_way"] = traffic.rounds * 4 * n / seconds / 1e9
        if args.straggler:
            with spinning_on(min(os.sched_getaffinity(0))):
                row.update({f"straggler_{name}_G_per_s": rate for name, rate in rates_in_turns(fns, n).items()})
        print(json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
