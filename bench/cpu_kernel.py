"""The bf16-gradient CPU AdamW kernel against torch's fused CPU kernel: elements/s on this host, one JSON line.

    python3 -m bench.cpu_kernel [--numel 25000000] [--threads 1,2]

torch's kernel reads fp32 gradients (28 B per element through host memory: p, g, m, v read, p, m, v
written); ours reads bf16 ones (26 B), and with a clip multiplier and the rounded bf16 params written
(28 B) does in one pass what the engine otherwise does in two more (a multiply over the fp32 gradients on
the host, the rounding on the GPU after 4 more bytes up). Both are checked equal, bit for bit, first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deep_optimizer_states.core import cpu_adamw
from deep_optimizer_states.core.adam import AdamHyper, adam_update


def _rate(fn, numel: int, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return numel / statistics.median(times)


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
    args = parser.parse_args(argv)
    kernel = cpu_adamw.load()
    if kernel is None:
        print(json.dumps({"status": "kernel not available (see the warning)"}))
        return 1
    n, h = args.numel, AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    p, m, v = torch.randn(n), torch.zeros(n), torch.rand(n) * 1e-6
    g32 = torch.randn(n) * 1e-3
    g16, out = g32.bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    clip = torch.tensor(0.5)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        row = {"date": time.strftime("%Y-%m-%d"), "numel": n, "threads": threads, "cpu": cpu_name(),
               "torch": torch.__version__,
               "equal_bit_for_bit": cpu_adamw.mismatch(kernel, seed=threads) is None,
               "torch_fp32_grads_G_per_s": _rate(lambda: adam_update(p, g32, m, v, 5, h), n) / 1e9,
               "torch_fp32_grads_with_clip_multiply_G_per_s":
                   _rate(lambda: (g32.mul_(clip), adam_update(p, g32, m, v, 5, h)), n) / 1e9,
               "ours_bf16_grads_G_per_s": _rate(lambda: kernel(p, g16, m, v, 5, h), n) / 1e9,
               "ours_bf16_grads_clip_bf16_params_G_per_s":
                   _rate(lambda: kernel(p, g16, m, v, 5, h, (0.5,), out), n) / 1e9}
        print(json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
