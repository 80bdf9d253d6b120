"""Trace the free-running training loop of one bench system with torch.profiler: where each wall went.

    python -m bench.trace_loop --system ours_k2_overlap_spec_prefetch_bf16 --model 1.36b --warmup 8 --iters 5 \
        --out DIR
    python -m bench.trace_loop --analyze DIR/SYSTEM.trace.json.gz     # the summary again, from a saved trace

After ``warmup`` free-running iterations (no synchronize but the loss read, as bench/free_loop.py runs them),
``iters`` more run under torch.profiler (CPU threads and GPU streams). Written to DIR: ``SYSTEM.trace.json.gz``
(Chrome trace, for Perfetto) and ``SYSTEM.summary.json``: each traced iteration's wall, the host seconds of
each call, each direction of the link's busy milliseconds (copy-engine copies of any stream), and per GPU
stream (named after our lanes) its busy milliseconds and its copies each way (GB) inside the iteration; and
per stream and direction, how long its copies waited between being enqueued and starting (a direction of
the link runs one copy at a time: a copy that waits long waited behind others).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from deep_optimizer_states.tools.profile import _covered

MARK = "dos.loop_forward"  # each traced iteration starts at its forward's annotation


def _direction(name: str) -> str | None:
    """'h2d', 'd2h' or None, from a Kineto memcpy event's name ("Memcpy HtoD (Pinned -> Device)")."""
    return "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None


def _gpu(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def lane_names(events: list[dict], names: list[str]) -> dict[str, str]:
    """Trace stream id -> lane name, from the marker copies of 4 * (k + 1) bytes the k-th lane ran first."""
    sizes = {4 * (k + 1): name for k, name in enumerate(names)}
    start = min((e["ts"] for e in events if e.get("name") == MARK), default=0)
    return {str(e["args"]["stream"]): sizes[e["args"]["bytes"]] for e in events
            if e.get("cat") == "gpu_memcpy" and e.get("args", {}).get("bytes") in sizes and e["ts"] < start}


def iterations(events: list[dict], lanes: dict[str, str]) -> list[dict]:
    """Per traced iteration: its wall, each direction of the link's busy ms (any stream), each GPU stream's
    busy ms, first and last activity and copy GB each way, and the host ms of the loop's calls."""
    starts = sorted(e["ts"] for e in events if e.get("cat") == "user_annotation" and e.get("name") == MARK)
    gpu, out = _gpu(events), []
    for a, b in zip(starts, starts[1:]):
        busy, copies = defaultdict(list), defaultdict(lambda: defaultdict(float))
        link = defaultdict(list)  # direction -> intervals, whatever the stream
        for e in gpu:
            start, end = max(e["ts"], a), min(e["ts"] + e["dur"], b)
            if end <= start:
                continue
            stream = lanes.get(str(e["args"].get("stream")), str(e["args"].get("stream")))
            busy[stream].append((start, end))
            way = _direction(e.get("name", ""))
            if way is not None:
                copies[stream][way] += e["args"].get("bytes", 0) * (end - start) / max(e["dur"], 1e-9) / 1e9
                link[way].append((start, end))
        host = defaultdict(float)
        for e in events:
            if e.get("cat") == "user_annotation" and e.get("name", "").startswith("dos.loop") and a <= e["ts"] < b:
                host[e["name"][9:]] += e.get("dur", 0) / 1e3
        out.append({"wall_ms": round((b - a) / 1e3, 1), "host_ms": {k: round(v, 1) for k, v in host.items()},
                    "link_busy_ms": {w: round(_covered(v) / 1e3, 1) for w, v in sorted(link.items())},
                    "streams": {k: {"busy_ms": round(_covered(v) / 1e3, 1),
                                    "first_ms": round((min(s for s, _ in v) - a) / 1e3, 1),
                                    "last_ms": round((max(e for _, e in v) - a) / 1e3, 1),
                                    **{w: round(g, 3) for w, g in copies[k].items()}}
                                for k, v in sorted(busy.items())}})
    return out


def copy_waits(events: list[dict], lanes: dict[str, str]) -> dict[str, dict]:
    """Per stream and direction: how many copies, and the median, 90th percentile and largest ms each
    waited between its enqueue call returning and its start on the GPU."""
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    waits = defaultdict(list)
    for e in events:
        way = _direction(e.get("name", "")) if e.get("cat") == "gpu_memcpy" else None
        call = calls.get(e.get("args", {}).get("correlation"))
        if way and call:
            stream = lanes.get(str(e["args"]["stream"]), str(e["args"]["stream"]))
            waits[f"{stream} {way}"].append((e["ts"] - call["ts"] - call["dur"]) / 1e3)
    return {k: {"copies": len(v), "median_ms": round(statistics.median(v), 2),
                "p90_ms": round(sorted(v)[int(0.9 * (len(v) - 1))], 2), "max_ms": round(max(v), 2)}
            for k, v in sorted(waits.items()) if len(v) > 1}


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


def trace(system: str, model: str, warmup: int, iters: int, micro_batch: int, seq: int, out: Path) -> dict:
    """Run and trace the loop (see the module docstring); returns the summary (also written to ``out``)."""
    from bench.free_loop import free_running
    from bench.run_system import batch
    from bench.systems import SYSTEMS
    from deep_optimizer_states.tools.models import PRESETS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trainer = SYSTEMS[system](model, device, micro_batch)
    ids = batch(micro_batch, seq, PRESETS[model][2], device)
    sync()
    _, warm, _, _ = free_running(lambda: trainer.forward(ids), trainer.backward, trainer.step, warmup)

    def marked(name: str, fn):
        def call(*args):
            with torch.profiler.record_function(name):
                return fn(*args)
        return call

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    streams = _streams(trainer.optimizer) if device.type == "cuda" else {}
    with torch.profiler.profile(activities=activities) as prof:
        for k, stream in enumerate(streams.values()):  # a copy of k + 1 words on each names its stream id
            with torch.cuda.stream(stream):
                torch.zeros(k + 1, device=device).to("cpu")
        first, walls, splits, _ = free_running(marked(MARK, lambda: trainer.forward(ids)),
                                               marked("dos.loop_backward", trainer.backward),
                                               marked("dos.loop_step", trainer.step), iters)
        sync()
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"{system}.trace.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with gzip.open(f"{raw}.gz", "wt") as f:
        json.dump({"traceEvents": events, "lanes": list(streams)}, f)
    raw.unlink()
    summary = {"system": system, "model": model, "warmup_walls_s": [round(w, 4) for w in warm],
               "walls_s": [round(w, 4) for w in walls], "first_wall_s": round(first, 4), "splits": splits,
               **analyze(events, list(streams)), "extra": trainer.extra()}
    (out / f"{system}.summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def analyze(events: list[dict], names: list[str]) -> dict:
    """The trace's lanes, iterations and copy waits (``lane_names``, ``iterations``, ``copy_waits``)."""
    lanes = lane_names(events, names)
    return {"lanes": lanes, "iterations": iterations(events, lanes), "copy_waits": copy_waits(events, lanes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system")
    parser.add_argument("--model", default="1.36b")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--analyze", type=Path, help="a saved SYSTEM.trace.json.gz: print its summary")
    parser.add_argument("--lanes", help="with --analyze, for a trace that does not name them: the lane names in "
                        "the order their marker copies ran, comma-separated")
    args = parser.parse_args(argv)
    if args.analyze is not None:
        with gzip.open(args.analyze, "rt") as f:
            saved = json.load(f)
        names = args.lanes.split(",") if args.lanes else saved.get("lanes", [])
        summary = analyze(saved["traceEvents"], names)
    elif args.system is None or args.out is None:
        parser.error("give --system and --out, or --analyze")
    else:
        summary = trace(args.system, args.model, args.warmup, args.iters, args.micro_batch, args.seq, args.out)
        print(json.dumps({k: summary[k] for k in ("system", "walls_s", "warmup_walls_s")}))
    for i, it in enumerate(summary["iterations"]):
        print(i, json.dumps(it))
    print(json.dumps(summary["copy_waits"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
