"""Replay a recorded update-phase sweep through the optimizer's rate refinement, offline (no GPU needed).

    python -m bench.replay_refinement docs/results/2026-11-29-update-5.2b-run7.jsonl [--probe 2]

Feeds each schedule's measured update and CPU AdamW times (their medians, once per recorded update, warm-up
included) to the optimizer's Planner in the order the sweep ran, and prints for each schedule the prediction
that the refined rates give before that schedule's own updates are seen, beside the measurement and the
prediction from calibration alone. It cannot replay a different choice of "auto": the placement measured
is priced.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from deep_optimizer_states.core.schedule import placements, spread
from deep_optimizer_states.planning.perfmodel import Rates, predict
from deep_optimizer_states.planning.plan import Plan, Planner

SUBGROUP = 25_000_000


@dataclass
class _Recorded:
    """The part of an update's telemetry that the planner reads."""

    seconds: float
    cpu_adam_seconds: float
    cpu_subgroups: int
    staged_subgroups: int
    prefetched: int = 0  # the recorded updates ran without prefetch
    speculated: int = 0  # ... and without speculate
    speculated_elements: int = 0


def replay(rows: list[dict], updates_per_schedule: int = 7, probe: str | None = None) -> list[dict]:
    """One line per schedule: measured, refined prediction (made before its run), calibration-only one.
    ``probe``: the schedule whose recorded updates stand in for untimed probe updates before the sweep
    (three, the first of them skipped as the optimizer does)."""
    head, count = rows[0], rows[0]["subgroups"]
    sizes = [SUBGROUP] * (count - 1) + [head["params"] - SUBGROUP * (count - 1)]
    calibrated = Rates(**head["rates"])
    planner = Planner(sizes, torch.device("cuda"), 2, calibrated)
    planner.slots_that_fit = lambda: 2  # the sweep ran with two staging slots
    out = []
    if probe is not None:
        r = next(r for r in rows if str(r["schedule"]) == probe)
        planner.current = Plan(r["schedule"], _placements(r, count), 2, None)
        for _ in range(3):
            planner.observe(_Recorded(r["update_s"], r["cpu_adam_s"], count - r["staged"], r["staged"]))
    for r in rows:
        places = _placements(r, count)
        refined = predict(sizes, places, planner.rates, 2).seconds
        plain = predict(sizes, places, calibrated, 2).seconds
        out.append({"schedule": r["schedule"], "staged": r["staged"], "measured_s": r["update_s"],
                    "refined_s": round(refined, 4), "refined_error": round(refined / r["update_s"] - 1, 4),
                    "calibrated_s": round(plain, 4), "calibrated_error": round(plain / r["update_s"] - 1, 4),
                    "factors": {k: round(v, 3) for k, v in planner.factors.items()}})
        planner.current = Plan(r["schedule"], places, 2, None)  # what ran, as the optimizer would hold it
        for _ in range(updates_per_schedule):
            planner.observe(_Recorded(r["update_s"], r["cpu_adam_s"], count - r["staged"], r["staged"]))
    out.append({"auto_now_stages": planner.plan("auto").prediction.staged})
    return out


def _placements(row: dict, count: int) -> list:
    return spread(count, row["staged"]) if row["schedule"] == "auto" else placements(row["schedule"], count)


def main(paths: list[str], probe: str | None = None) -> None:
    for path in paths:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        print(f"### {path}\n\n| schedule | staged | measured s | predicted s, refined | error "
              "| predicted s, calibration only | error "
              "| factors before the run: CPU alone, CPU contended, link contended |\n"
              "|---|---|---|---|---|---|---|---|")
        *lines, last = replay(rows, probe=probe)
        for x in lines:
            print(f"| {x['schedule']} | {x['staged']} | {x['measured_s']:.3f} | {x['refined_s']:.3f} | "
                  f"{x['refined_error']:+.1%} | {x['calibrated_s']:.3f} | {x['calibrated_error']:+.1%} | "
                  f"{', '.join(f'{v:.3f}' for v in x['factors'].values())} |")
        print(f"\nWith the rates refined by the whole sweep, auto would now stage {last['auto_now_stages']} "
              f"of {rows[0]['subgroups']} subgroups.\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="update-phase JSON lines from `dos bench --out`")
    parser.add_argument("--probe", default=None, help="the schedule whose updates stand in for the probes")
    args = parser.parse_args()
    main(args.paths, args.probe)
