"""Trace the free-running training loop of one bench system with torch.profiler: where each wall went.

    python -m bench.trace_loop --system ours_k2_overlap_spec_prefetch_bf16 --model 1.36b --warmup 6 --iters 4 \
        --out DIR

After ``warmup`` free-running iterations (no synchronize but the loss read, as bench/free_loop.py runs them),
``iters`` more run under torch.profiler (CPU threads and GPU streams). Written to DIR: ``SYSTEM.trace.json.gz``
(Chrome trace, for Perfetto) and ``SYSTEM.summary.json``: each traced iteration's wall, the host seconds of
each call, and per GPU stream its busy milliseconds and its copies each way (GB) inside the iteration.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

import torch

from bench.free_loop import free_running
from bench.run_system import batch
from bench.systems import SYSTEMS
from deep_optimizer_states.tools.models import PRESETS
from deep_optimizer_states.tools.profile import _covered


def _copy_direction(name: str) -> str | None:
    """'h2d', 'd2h' or None, from a Kineto memcpy event's name ("Memcpy HtoD (Pinned -> Device)")."""
    if "HtoD" in name:
        return "h2d"
    if "DtoH" in name:
        return "d2h"
    return None


def summarize(events: list[dict], marks: list[tuple[float, float]]) -> list[dict]:
    """Per iteration window (host microseconds, the trace's clock): each GPU stream's busy ms and its copy
    GB each way, and the host time of the user annotations ``dos.*``."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    out = []
    for a, b in marks:
        busy, copies = defaultdict(list), defaultdict(lambda: defaultdict(float))
        for e in gpu:
            start, end = max(e["ts"], a), min(e["ts"] + e["dur"], b)
            if end <= start:
                continue
            stream = str(e.get("args", {}).get("stream"))
            busy[stream].append((start, end))
            way = _copy_direction(e.get("name", ""))
            if way is not None:
                moved = e.get("args", {}).get("bytes", 0) * (end - start) / max(e["dur"], 1e-9)
                copies[stream][way] += moved / 1e9
        notes = defaultdict(float)
        for e in events:
            if e.get("cat") == "user_annotation" and e.get("name", "").startswith("dos.") and a <= e["ts"] < b:
                notes[e["name"]] += e.get("dur", 0) / 1e3
        out.append({"wall_ms": (b - a) / 1e3,
                    "streams": {k: {"busy_ms": round(_covered(v) / 1e3, 2),
                                    "first_ms": round((min(s for s, _ in v) - a) / 1e3, 2),
                                    "last_ms": round((max(e for _, e in v) - a) / 1e3, 2),
                                    **{w: round(g, 3) for w, g in copies[k].items()}}
                                for k, v in sorted(busy.items())},
                    "host_ms": {k: round(v, 2) for k, v in sorted(notes.items())}})
    return out


def _streams(opt) -> dict[str, torch.cuda.Stream]:
    """Our optimizer's CUDA streams by name (none for a peer)."""
    if opt is None:
        return {}
    out = {f"lane.{name}": lane.stream for name, lane in opt.engine.lanes.items()}
    if opt.prefetch is not None:
        out["prefetch"] = opt.prefetch.lane.stream
    if opt.grad_stream is not None:
        out["grad_stream"] = opt.grad_stream.stream
    out["default"] = torch.cuda.default_stream()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    parser.add_argument("--model", default="1.36b")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = SYSTEMS[args.system](args.model, device, args.micro_batch)
    ids = batch(args.micro_batch, args.seq, PRESETS[args.model][2], device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    _, warm, _, _ = free_running(lambda: trainer.forward(ids), trainer.backward, trainer.step, args.warmup)

    def forward():
        with torch.profiler.record_function("dos.loop_forward"):
            return trainer.forward(ids)

    def backward(loss):
        with torch.profiler.record_function("dos.loop_backward"):
            trainer.backward(loss)

    def step():
        with torch.profiler.record_function("dos.loop_step"):
            trainer.step()

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    streams = _streams(trainer.optimizer) if device.type == "cuda" else {}
    with torch.profiler.profile(activities=activities) as prof:
        for k, stream in enumerate(streams.values()):  # a copy of k + 1 words on each: names its stream id
            with torch.cuda.stream(stream):
                torch.zeros(k + 1, device=device).to("cpu", non_blocking=False)
        first, walls, splits, _ = free_running(forward, backward, step, args.iters)
        sync()
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / f"{args.system}.trace.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with gzip.open(f"{raw}.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    raw.unlink()
    # the trace's clock: the profiler's own; each iteration starts at its forward annotation
    names = {4 * (k + 1): name for k, name in enumerate(streams)}
    lanes = {str(e["args"]["stream"]): names[e["args"]["bytes"]] for e in events
             if e.get("cat") == "gpu_memcpy" and e.get("args", {}).get("bytes") in names
             and e["ts"] < min((x["ts"] for x in events if x.get("name") == "dos.loop_forward"), default=0)}
    starts = sorted(e["ts"] for e in events if e.get("name") == "dos.loop_forward" and "dur" in e)
    windows = list(zip(starts, starts[1:]))
    summary = {"system": args.system, "model": args.model, "warmup_walls_s": [round(w, 4) for w in warm],
               "walls_s": [round(w, 4) for w in walls], "first_wall_s": round(first, 4), "splits": splits,
               "lanes": lanes,
               "iterations": summarize(events, windows), "extra": trainer.extra()}
    (args.out / f"{args.system}.summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: summary[k] for k in ("system", "walls_s", "warmup_walls_s", "lanes")}))
    for i, it in enumerate(summary["iterations"]):
        print(i, round(it["wall_ms"], 1), json.dumps(it["streams"]), json.dumps(it["host_ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
