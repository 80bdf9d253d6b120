"""From a saved ``bench/trace_loop.py`` trace: per traced backward, how busy each CPU thread was, how much
of that was ``AccumulateGrad`` (where our gradient hooks run), and how long the default stream's kernels took.
A backward whose launching thread is busy far longer than its kernels is held by the host, not the GPU.

    python3 -m bench.trace_threads DIR/SYSTEM.trace.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

from deep_optimizer_states.tools.profile import _covered

PHASE = "dos.loop_backward"
ACCUMULATE = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"


def backwards(events: list[dict]) -> list[dict]:
    """Each traced backward: its host milliseconds, each thread's busy ms, AccumulateGrad's ms, the kernels'."""
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") == PHASE),
                   key=lambda e: e["ts"])
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    default = min((e["tid"] for e in kernels), default=None)  # the default stream has the lowest id
    out = []
    for mark in marks:
        start, end = mark["ts"], mark["ts"] + mark["dur"]
        spans, accumulate = defaultdict(list), defaultdict(float)
        for e in ops:
            if start <= e["ts"] < end:
                spans[e["tid"]].append((e["ts"], min(end, e["ts"] + e["dur"])))
                if e["name"] == ACCUMULATE:
                    accumulate[e["tid"]] += e["dur"]
        on_default = [(e["ts"], min(end, e["ts"] + e["dur"])) for e in kernels
                      if e["tid"] == default and start <= e["ts"] < end]
        out.append({"backward_ms": round(mark["dur"] / 1e3, 1),
                    "thread_busy_ms": {str(t): round(_covered(v) / 1e3, 1) for t, v in spans.items()},
                    "accumulate_grad_ms": {str(t): round(v / 1e3, 1) for t, v in accumulate.items()},
                    "default_stream_kernels_ms": round(_covered(on_default) / 1e3, 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    args = ap.parse_args()
    with gzip.open(args.trace, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    for row in backwards(events):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
