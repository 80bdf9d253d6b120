"""Start-up cost of the optimizer's host buffers: how fast we get pinned fp32 states, masters copied in.

    python3 -m bench.startup --sizes 1.36e9,5.2e9 --out $OUT/startup.jsonl     # GPU machine
    python3 -m bench.startup --sizes 1e8 --out /tmp/startup.jsonl              # CPU: pageable, no CUDA

For each size (parameters; 16 B each on the host: master, exp_avg, exp_avg_sq, grad32, all fp32):

* ``pin_memory``: torch.empty(..., pin_memory=True) of one fp32 buffer (torch's caching host allocator);
* ``old``: the previous path for one buffer: torch.empty, one cudaHostRegister (the driver faults the
  pages in, single-threaded), then zero_();
* ``new``: ``host_empty_many`` of all four buffers, then the masters copied in from a bf16 tensor on the
  device (``parallel_chunks``), end to end; also the copy-in alone;
* ``h2d_span`` / ``h2d_chunk`` (GPU only): host->GPU bandwidth of a copy that crosses chunk registrations
  and of one inside a single chunk: they should match (a crossing copy treated as pageable would be slow);
* ``alloc_memset``: the allocation of ``new`` again, zero-filling with libc memset instead of torch's
  zero_ (which opens torch's intra-op threads inside each pool thread), to see which faults faster.

The one-buffer cases use at most ``--single-gb`` GB so that the run stays within about two minutes. Each
case prints GB/s and appends a JSON line to ``--out``. Sizes that do not fit host memory are skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import time

import torch

from deep_optimizer_states.core import host_memory as hm
from deep_optimizer_states.core.host_memory import GB, HostSpec

FP32 = 4


def _free_host_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        empty = getattr(torch._C, "_host_emptyCache", None)  # torch's pinned blocks stay cached otherwise
        if empty is not None:
            empty()


def _timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _emit(out, row: dict) -> None:
    row = {"bench": "startup", "host": socket.gethostname(), "torch": torch.__version__,
           "workers": hm.workers(), **row}
    if "bytes" in row and "seconds" in row:
        row["gb_per_s"] = row["bytes"] / GB / max(row["seconds"], 1e-9)
        print(f"  {row['case']:<12} {row['bytes'] / GB:7.2f} GB  {row['seconds']:7.2f} s  {row['gb_per_s']:7.2f} GB/s"
              + (f"  ({row['note']})" if row.get("note") else ""), flush=True)
    else:
        print(f"  {row['case']:<12} {row.get('note', '')}", flush=True)
    if out is not None:
        out.write(json.dumps(row) + "\n")
        out.flush()


def _fits(nbytes: int) -> bool:
    available = hm.available_host_bytes()
    return available is None or nbytes * 1.05 + 2 * GB <= available


def _pin_memory_case(numel: int, pin: bool) -> float:
    def run():
        t = torch.empty(numel, dtype=torch.float32, pin_memory=pin)
        return t.zero_() if not pin else t

    seconds, t = _timed(run)
    del t
    return seconds


def _old_case(numel: int, pin: bool) -> float:
    """The previous host_empty + zero_(): one registration of the whole (untouched) buffer."""
    cudart = torch.cuda.cudart() if pin else None

    def run():
        t = torch.empty(numel, dtype=torch.float32)
        if pin and int(cudart.cudaHostRegister(t.data_ptr(), numel * FP32, 0)) != 0:
            raise RuntimeError("cudaHostRegister failed")
        return t.zero_()

    seconds, t = _timed(run)
    if pin:
        cudart.cudaHostUnregister(t.data_ptr())
    del t
    return seconds


def _copy_bandwidth(src: torch.Tensor, dst: torch.Tensor, repeats: int = 3) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up
    seconds, _ = _timed(lambda: [dst.copy_(src, non_blocking=True) for _ in range(repeats)])
    return seconds / repeats


def _memset_fault_in(t: torch.Tensor, start: int, end: int, zero: bool) -> None:
    """host_memory's fault-in with libc memset (one thread per chunk, no intra-op threads) for zeroing."""
    if zero:
        ctypes.memset(t.data_ptr() + start * t.element_size(), 0, (end - start) * t.element_size())
    else:
        _FAULT_IN(t, start, end, zero)


_FAULT_IN = hm._fault_in


def _memset_case(numel: int, pin: bool, out, base: dict) -> None:
    """The allocation alone with memset instead of torch's zero_ (8 pool threads x torch's intra-op threads)."""
    specs = [HostSpec(numel, torch.float32, zero=False)] + [HostSpec(numel, torch.float32)] * 3
    hm._fault_in = _memset_fault_in
    try:
        seconds, buffers = _timed(lambda: hm.host_empty_many(specs, pin=pin))
    finally:
        hm._fault_in = _FAULT_IN
    ok = all(not b.any() for b in buffers[1:])
    _emit(out, {**base, "case": "alloc_memset", "bytes": hm.host_bytes(specs), "seconds": seconds, "pinned": pin,
                "note": f"zeros={ok}"})
    del buffers
    _free_host_cache()


def _new_case(numel: int, pin: bool, out, base: dict) -> None:
    device = "cuda" if pin else "cpu"
    source = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()  # the model's params
    specs = [HostSpec(numel, torch.float32, zero=False)] + [HostSpec(numel, torch.float32)] * 3
    total = hm.host_bytes(specs)
    alloc_s, buffers = _timed(lambda: hm.host_empty_many(specs, pin=pin, progress="optimizer states"))
    master = buffers[0]
    copy_s, _ = _timed(lambda: hm.parallel_chunks(master, lambda s, e: master[s:e].copy_(source[s:e])))
    ok = all(torch.equal(master[s:e], source[s:e].float().cpu()) for s, e in hm.buffer_chunks(master)[::17])
    pinned = all(b.is_pinned() for b in buffers) if pin else False
    note = f"{len(hm.buffer_chunks(master))} chunks/buffer, pinned={pinned}, masters match={ok}"
    _emit(out, {**base, "case": "new", "bytes": total, "seconds": alloc_s + copy_s, "pinned": pinned,
                "alloc_s": alloc_s, "copy_s": copy_s, "masters_match": ok, "note": note})
    _emit(out, {**base, "case": "new_alloc", "bytes": total, "seconds": alloc_s, "pinned": pinned})
    _emit(out, {**base, "case": "copy_in", "bytes": numel * FP32, "seconds": copy_s, "pinned": pinned})
    if pin:  # does a copy across registration cuts run at pinned speed?
        chunks = hm.buffer_chunks(master)
        if len(chunks) > 2:
            s0, e0 = chunks[1]
            width = e0 - s0
            mid = s0 + width // 2
            span = master[mid : min(numel, mid + 4 * width)]  # crosses three or four cuts
            one = master[s0:e0]
            dev = torch.empty(span.numel(), dtype=torch.float32, device="cuda")
            for case, host in (("h2d_span", span), ("h2d_chunk", one)):
                secs = _copy_bandwidth(host, dev[: host.numel()])
                _emit(out, {**base, "case": case, "bytes": host.numel() * FP32, "seconds": secs, "pinned": True})
            del dev
    del buffers, master, source
    _free_host_cache()


def _optimizer_case(preset: str, out) -> None:
    """End to end: DeepOptimizerStates built on a bf16 model of ``preset`` on the device (host buffers
    allocated, pinned, masters copied in from the model), as a user waits for it."""
    from deep_optimizer_states import DeepOptimizerStates
    from deep_optimizer_states.tools.models import llama

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = llama(preset, torch.bfloat16, device)
    numel = sum(p.numel() for p in model.parameters())
    seconds, opt = _timed(lambda: DeepOptimizerStates(model, schedule="cpu"))
    pinned = opt.layout.buckets[0].master.is_pinned()
    _emit(out, {"params": numel, "case": "optimizer", "model": preset, "bytes": opt.layout.bytes()["host"],
                "seconds": seconds, "pinned": pinned, "note": "DeepOptimizerStates(model) end to end"})
    opt.close()
    del opt, model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1.36e9,5.2e9", help="parameter counts, comma-separated")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    parser.add_argument("--single-gb", type=float, default=8.0, help="cap for the one-buffer cases (GB)")
    parser.add_argument("--no-memset", action="store_true", help="skip the memset variant of the allocation")
    parser.add_argument("--no-pin", action="store_true", help="pageable buffers even with CUDA")
    parser.add_argument("--optimizer", default="", help="also time DeepOptimizerStates built on these presets")
    args = parser.parse_args(argv)
    pin = torch.cuda.is_available() and not args.no_pin
    if pin:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # context up front, not inside the first timing
    out = None
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        out = open(args.out, "a")
    print(f"pinned={pin}, workers={hm.workers()}, cpus={os.cpu_count()}, torch threads={torch.get_num_threads()}, "
          f"host available={hm.format_bytes(hm.available_host_bytes() or 0)}")
    for size in (float(s) for s in args.sizes.split(",")):
        numel = int(size)
        base = {"params": numel, "host_bytes_per_param": 16}
        print(f"{size:.3g} params: {hm.format_bytes(16 * numel)} of host states", flush=True)
        if not _fits(16 * numel):
            _emit(out, {**base, "case": "skipped",
                        "note": f"needs {hm.format_bytes(16 * numel)}, "
                                f"{hm.format_bytes(hm.available_host_bytes() or 0)} available"})
            continue
        single = min(numel, int(args.single_gb * GB) // FP32)
        capped = "" if single == numel else f"one buffer capped at {args.single_gb:g} GB"
        _emit(out, {**base, "case": "pin_memory" if pin else "empty_zero", "bytes": single * FP32,
                    "seconds": _pin_memory_case(single, pin), "pinned": pin, "note": capped})
        _free_host_cache()
        _emit(out, {**base, "case": "old", "bytes": single * FP32, "seconds": _old_case(single, pin),
                    "pinned": pin, "note": capped})
        _free_host_cache()
        _new_case(numel, pin, out, base)
        if not args.no_memset:
            _memset_case(numel, pin, out, base)
    for preset in filter(None, args.optimizer.split(",")):
        _optimizer_case(preset, out)
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
