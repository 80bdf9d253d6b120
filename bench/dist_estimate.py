"""Seconds a step of ``bench/dist_call.sh`` is expected to take, so that the script does not start a run its
deadline would kill (the device time spent on it would be lost, as in 2026-11-30's x2 call 12, where two
runs were killed that way; how long each had run was not recorded).

    python3 -m bench.dist_estimate SYSTEM MODEL RANKS WARMUP ITERS [SWEEP]   # whole seconds, 0 if unknown

From the newest finished row of the same system, model and rank count in docs/benchmarks/dist-results.jsonl
(for a variant of ours not run yet, the slowest of the variants' rows):
its setup, the iterations this run will take (``WARMUP + ITERS`` phase-timed, ``ITERS + 1`` counted, 3 per
entry of the comma-separated SWEEP) at the slower of its two iteration times, and a fixed cost for launching, calibrating and freeing the pinned memory
(30-35 s measured from call 12's command walls, rounded up).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "dist-results.jsonl"
OVERHEAD_S = 40.0


SWEEP_ITERATIONS = 3  # bench/dist_run.py: iterations per schedule of the sweep


def _variant(system: str) -> bool:
    """A variant of ours that keeps every state on the host (options of one pipeline, alike in cost)."""
    return system.startswith("ours") and system != "ours_auto"


def estimate(rows: list[dict], system: str, model: str, ranks: int, warmup: int, iters: int,
             sweep: int = 0) -> float | None:
    """Expected seconds of one run (with ``sweep`` schedules timed after it), or None when no finished run
    of it is recorded. A variant of ours never run yet is given the slowest estimate of the variants that
    ran at that model and rank count (a new option is not yet known to be cheaper)."""
    done = [r for r in rows if r.get("status") == "ok" and r.get("model") == model and r.get("ranks") == ranks
            and r.get("setup_s") is not None]
    own = [r for r in done if r.get("system") == system]
    if own:
        candidates = own[-1:]
    elif _variant(system):
        candidates = [r for r in done if _variant(r.get("system", ""))]
    else:
        return None
    if not candidates:
        return None
    iterations = warmup + 2 * iters + 1 + SWEEP_ITERATIONS * sweep
    return max(r["setup_s"] + iterations * max(r.get("iter_s") or 0.0, r.get("iter_phases_s") or 0.0)
               for r in candidates) + OVERHEAD_S


def main(argv: list[str] | None = None) -> int:
    system, model, ranks, warmup, iters, *sweep = (argv if argv is not None else sys.argv[1:])
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()] if ROWS.exists() else []
    schedules = len([s for s in (sweep[0] if sweep else "").split(",") if s])
    seconds = estimate(rows, system, model, int(ranks), int(warmup), int(iters), schedules)
    print(0 if seconds is None else round(seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
