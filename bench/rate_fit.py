"""Does a library run slower than earlier ones at the same host speed? Fit ``iteration = a + b / rate`` (the
CPU path's AdamW rate in the update, ``bench.walls.cpu_path_rate``) over one set of runs, then print the
other runs' residuals against it.

    python -m bench.rate_fit docs/benchmarks/results.jsonl docs/results/*/results-seed7.jsonl \\
        --fit-dates 2026-12-04 --show-dates 2026-12-05

Across H200 hosts the CPU path ran at 2.1-3.9 G elements/s and the 1.36B iteration followed it (r = -0.84 to
-1.00 within a machine): a residual beyond the fit's spread on a new library hints at a cost of its own, which
only paired rounds on one machine (``bench.suite``'s ``NAME@DIR`` systems) can confirm.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.walls import cpu_path_rate

SYSTEM = "ours_offload_overlap_spec_prefetch_bf16"


def runs(paths: list[Path], system: str, model: str) -> list[tuple[str, float, float, float | None]]:
    """(date, CPU path G el/s, iteration s, steal) of each finished whole-device run, each row once."""
    seen, out = set(), []
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if (row.get("system"), row.get("model"), row.get("budget_gb"), row.get("status")) != \
                    (system, model, None, "ok"):
                continue
            key = (row.get("date"), row.get("iter_s"), row.get("data_seed"), row.get("wall_s"))
            rate = cpu_path_rate(row)
            if key in seen or rate is None or not row.get("iter_s"):
                continue
            seen.add(key)
            out.append((row["date"], rate, row["iter_s"], (row.get("host_load") or {}).get("steal")))
    return out


def fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares ``y = a + b / x``: (a, b, the residuals' standard deviation)."""
    us = [1 / x for x, _ in points]
    ys = [y for _, y in points]
    if len(points) < 3 or len(set(us)) < 2:
        raise ValueError(f"{len(points)} runs with {len(set(us))} distinct rates: too few to fit")
    mu, my = statistics.fmean(us), statistics.fmean(ys)
    b = sum((u - mu) * (y - my) for u, y in zip(us, ys)) / sum((u - mu) ** 2 for u in us)
    a = my - b * mu
    return a, b, statistics.pstdev([y - (a + b * u) for u, y in zip(us, ys)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--system", default=SYSTEM)
    parser.add_argument("--model", default="1.36b")
    parser.add_argument("--fit-dates", required=True, help="comma-separated dates whose runs make the fit")
    parser.add_argument("--show-dates", required=True, help="comma-separated dates whose residuals to print")
    args = parser.parse_args(argv)
    rows = runs(args.files, args.system, args.model)
    base = [(rate, it) for date, rate, it, _ in rows if date in args.fit_dates.split(",")]
    a, b, sd = fit(base)
    print(f"fit over {len(base)} runs of {args.fit_dates}: iteration = {a:.3f} + {b:.3f} / rate, "
          f"residuals' sd {sd:.4f} s")
    print("| date | CPU path G el/s | iteration s | fit s | residual s | steal |\n|---|---|---|---|---|---|")
    for date, rate, it, steal in sorted(r for r in rows if r[0] in args.show_dates.split(",")):
        steal_text = "-" if steal is None else f"{steal:.1%}"
        print(f"| {date} | {rate:.2f} | {it:.3f} | {a + b / rate:.3f} | {it - a - b / rate:+.3f} | {steal_text} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
