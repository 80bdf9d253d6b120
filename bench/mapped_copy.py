"""Host-to-GPU copies by the GPU's copy engine against a kernel reading mapped pinned memory.

Each direction of the link runs one copy-engine copy at a time, whatever its stream (overlap.md, call 35):
a small copy the next forward waits for (the CPU path's params) queues behind the big staged fills enqueued
before it. A kernel that reads pinned host memory through its device mapping (UVA) does not use the copy
engine. This measures, on one GPU:

- the rate of each way alone (MB of bf16 going up);
- how long the small copy takes when enqueued behind FILLS big fills on another stream, each way.

    python3 -m bench.mapped_copy [--fills 8] [--fill-mb 1024] [--small-mb 50]

(The engine took the CPU path's params up this way behind ``engine.PARAMS_UP_MAPPED`` from H200 call 62 until
the twenty-ninth session: slower than the copy engine in the iteration, overlap.md calls 63-73.)
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json

import torch

_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _device_pointer(host_ptr: int) -> int:
    """The GPU's address of a pinned host address (equal to it where the device can use host pointers)."""
    out = ctypes.c_uint64()
    rc = _driver().cuPointerGetAttribute(ctypes.byref(out), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                         ctypes.c_uint64(host_ptr))
    if rc != 0:
        raise RuntimeError(f"host memory at {host_ptr:#x} has no device mapping (cuPointerGetAttribute: error {rc}); "
                           "it must be pinned (pin_memory() or cudaHostRegister)")
    return out.value


class _Interface:
    """What torch.as_tensor reads (__cuda_array_interface__ v2: no stream, the caller orders the reads)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` over the memory of the pinned, contiguous CPU tensor ``host`` (which it keeps
    alive). Copy from it with a kernel (an elementwise op), not ``copy_`` between equal dtypes, which torch
    hands to the copy engine."""
    if host.device.type != "cpu" or not host.is_contiguous() or not host.is_pinned():
        raise ValueError("mapped_view needs a contiguous, pinned CPU tensor")
    nbytes = host.numel() * host.element_size()
    with torch.cuda.device(device):
        raw = torch.as_tensor(_Interface(_device_pointer(host.data_ptr()), nbytes), device=device)
    view = raw.view(host.dtype).view(host.shape)
    view._dos_host = host  # the view does not own the memory
    return view


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
