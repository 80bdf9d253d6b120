"""Per run of ours, the bytes its iteration moves through host memory and the rate that implies, from the rows.

    python -m bench.host_bytes docs/results/2026-12-03-h200-calls100-103/results.jsonl [FILE ...]

Every optimizer state lives in host memory, and each of its bytes crosses the host's memory bus once or twice
per step whichever path updates it: a staged subgroup's states are read by the copy up and written by the copy
down (``2 * STAGED_BYTES`` per element); the CPU path reads and writes them (24 B) and also moves the gradient
and the param: with the bf16 kernel 2 B written by the copy down, read, 2 B written and read by the copy up
(32 B in all), with torch's fp32 kernel 4 B down, read, and the fp32 master read by the copy up (36 B); an
update run ahead during backward (``speculate``) streams the states before into its spare (12 B more). A
resident subgroup moves nothing. The counts are the medians over the timed steps' ``history`` (staged, run
ahead), the elements the subgroup count times the mean subgroup (the rows keep no sizes; the subgroups are
equal but the last). This is a model of the traffic, not a measurement: it counts each access once (the
streams are far larger than the caches) and leaves out the undo of a step that clipped or was skipped (24 B
per element run ahead) and everything else on the host. Its use: the iteration's GB over its seconds is the
host memory rate the run achieved, which compares runs on different hosts (overlap.md, calls 100-103), and
the floor column is the iteration at that rate were every element to move only its 24 B of states.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.walls import STEPS
from deep_optimizer_states.core.engine import BF16_CPU_PATH_BYTES, CPU_PATH_BYTES, STAGED_BYTES
from deep_optimizer_states.core.speculate import SPARE_BYTES_PER_ELEMENT

STATE_BYTES = 2 * STAGED_BYTES  # fp32 master, exp_avg, exp_avg_sq: read once and written once
BF16_CPU_ELEMENT = STATE_BYTES + 4 * BF16_CPU_PATH_BYTES  # grad written, read; param written, read
FP32_CPU_ELEMENT = STATE_BYTES + 3 * CPU_PATH_BYTES  # grad written, read; the master read by the copy up


def host_bytes(row: dict) -> dict[str, float] | None:
    """GB per step by path, their sum, and GB/s over the iteration; None for a row without the counts."""
    steps = [s for s in row.get("history", [])[-STEPS:] if s.get("staged") is not None]
    count, params = row.get("subgroups"), row.get("params")
    if not steps or not count or not params or not row.get("iter_s"):
        return None
    size = params / count
    staged = statistics.median(s["staged"] for s in steps)
    ahead = statistics.median(s.get("speculated") or 0 for s in steps)
    on_cpu = count - staged - (row.get("resident_subgroups") or 0)
    per_cpu = BF16_CPU_ELEMENT if row.get("bf16_kernel") else FP32_CPU_ELEMENT
    out = {"staged": staged, "ahead": ahead, "staged_GB": staged * size * STATE_BYTES / 1e9,
           "cpu_GB": on_cpu * size * per_cpu / 1e9, "ahead_GB": ahead * size * SPARE_BYTES_PER_ELEMENT / 1e9}
    out["total_GB"] = out["staged_GB"] + out["cpu_GB"] + out["ahead_GB"]
    out["GBps"] = out["total_GB"] / row["iter_s"]
    out["floor_s"] = params * STATE_BYTES / 1e9 / out["GBps"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print("| file | model | system | iteration s | staged | run ahead | staged GB | CPU path GB | spares GB "
          "| host GB | host GB/s | floor s |\n" + "|---" * 12 + "|")
    for path in args.files:
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("status") != "ok" or not str(row.get("system")).startswith("ours"):
                continue
            b = host_bytes(row)
            if b is None:
                continue
            print(f"| {path.parent.name}/{path.name} | {row['model']} | {row['system']} | {row['iter_s']:.3f} "
                  f"| {b['staged']:g} | {b['ahead']:g} | {b['staged_GB']:.1f} | {b['cpu_GB']:.1f} "
                  f"| {b['ahead_GB']:.1f} | {b['total_GB']:.1f} | {b['GBps']:.0f} | {b['floor_s']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
