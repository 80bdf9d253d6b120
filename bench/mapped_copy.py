"""Host-to-GPU copies by the GPU's copy engine against a kernel reading mapped pinned memory.

Each direction of the link runs one copy-engine copy at a time, whatever its stream (overlap.md, call 35):
a small copy the next forward waits for (the CPU path's params) queues behind the big staged fills enqueued
before it. A kernel that reads pinned host memory through its device mapping (UVA) does not use the copy
engine. This measures, on one GPU:

- the rate of each way alone (MB of bf16 going up);
- how long the small copy takes when enqueued behind FILLS big fills on another stream, each way.

    python3 -m bench.mapped_copy [--fills 8] [--fill-mb 1024] [--small-mb 50]
"""

from __future__ import annotations

import argparse
import json

import torch

from deep_optimizer_states.core.mapped import mapped_view


def _elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return round(start.elapsed_time(end), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fills", type=int, default=8)
    ap.add_argument("--fill-mb", type=int, default=1024)
    ap.add_argument("--small-mb", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    fill_n, small_n = args.fill_mb * 2**20 // 4, args.small_mb * 2**20 // 2
    big_host = [torch.randn(fill_n).pin_memory() for _ in range(args.fills)]
    big_gpu = [torch.empty(fill_n, device=dev) for _ in range(args.fills)]
    small_host = torch.randn(small_n).to(torch.bfloat16).pin_memory()
    small_view = mapped_view(small_host, dev)
    small_gpu = torch.empty(small_n, dtype=torch.bfloat16, device=dev)
    fills, param = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def by_engine() -> None:
        small_gpu.copy_(small_host, non_blocking=True)

    def by_kernel() -> None:
        torch.mul(small_view, 1, out=small_gpu)  # an elementwise kernel: the SMs read the host memory

    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, **vars(args)}
    for name, way in (("engine", by_engine), ("kernel", by_kernel)):
        way()
        assert torch.equal(small_gpu.cpu(), small_host), name
        alone, behind = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(param):
                a.record()
                way()
                b.record()
            torch.cuda.synchronize()
            alone.append(_elapsed_ms(a, b))
            start = torch.cuda.Event(enable_timing=True)
            fills_done = torch.cuda.Event(enable_timing=True)
            done = torch.cuda.Event(enable_timing=True)
            start.record()
            fills.wait_stream(torch.cuda.current_stream(dev))
            param.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(fills):
                for dst, src in zip(big_gpu, big_host):
                    dst.copy_(src, non_blocking=True)
                fills_done.record()
            with torch.cuda.stream(param):
                way()
                done.record()
            torch.cuda.synchronize()
            behind.append((_elapsed_ms(start, done), _elapsed_ms(start, fills_done)))
        med = sorted(alone)[len(alone) // 2]
        out[name] = {"alone_ms": med, "GB_per_s": round(args.small_mb / 1024 / (med / 1e3), 1),
                     "behind_fills_ms": [x for x, _ in behind], "fills_ms": [y for _, y in behind]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
