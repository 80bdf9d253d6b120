"""Paired rounds of one ``bench.suite --rounds N`` call: each system's iteration per round, and each system
against the first one listed, round by round.

    python -m bench.rounds /tmp/bench/results.jsonl            # the newest series in the file
    python -m bench.rounds results.jsonl --series 2026-12-02T13:10:00

Runs of the same settings on one machine moved 8-20% within a lease (overlap.md calls 66-70): a single run of
each side cannot tell a 3% lever from the spread. Within a round the systems ran back to back, so the ratio of
two systems in the same round leaves out what drifts between rounds; a lever is shown when it wins most rounds
and the median of its per-round ratios is clear of 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def series_rows(rows: list[dict], series: str | None = None) -> tuple[str, list[dict]]:
    """The rows of ``series`` (the newest when None) that ran; raises when the file has no rounds."""
    marked = [r for r in rows if r.get("series") is not None]
    if not marked:
        raise ValueError("no rows with rounds here: run bench.suite with --rounds 2 or more")
    name = series if series is not None else max(r["series"] for r in marked)
    chosen = [r for r in marked if r["series"] == name and r.get("status") == "ok"]
    if not chosen:
        raise ValueError(f"no finished rows in series {name!r}; series here: "
                         f"{', '.join(sorted({r['series'] for r in marked}))}")
    return name, chosen


def summarise(rows: list[dict]) -> str:
    """Markdown: per (model, budget, system) its iteration per round and the median over rounds; then each
    system against the first of its cell, over the rounds where both ran."""
    cells: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["budget_gb"]), {}).setdefault(r["system"], {})[r["round"]] = r["iter_s"]
    lines = []
    for (model, budget), systems in cells.items():
        rounds = sorted({k for per in systems.values() for k in per})
        lines += [f"### {model}, {'whole' if budget is None else f'{budget:g} GB'}", "",
                  "| system | " + " | ".join(f"round {k}" for k in rounds) + " | median s | vs first | faster in |",
                  "|---|" + "---|" * (len(rounds) + 3)]
        base_name, base = next(iter(systems.items()))
        for name, per in systems.items():
            walls = " | ".join(f"{per[k]:.3f}" if k in per else "-" for k in rounds)
            paired = [k for k in rounds if k in per and k in base]
            if name == base_name or not paired:
                versus, wins = "-", "-"
            else:
                ratios = [per[k] / base[k] for k in paired]
                versus = f"x{statistics.median(ratios):.3f}"
                wins = f"{sum(x < 1 for x in ratios)} of {len(ratios)}"
            lines.append(f"| {name} | {walls} | {statistics.median(per.values()):.3f} | {versus} | {wins} |")
        lines.append("")
    lines.append("vs first: the median over rounds of this system's iteration over the first system's in the "
                 "same round (below 1: faster); faster in: the rounds where it was.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--series", default=None, help="the series to show (default: the newest)")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    try:
        name, chosen = series_rows(rows, args.series)
    except ValueError as e:
        print(f"bench.rounds: {e}", file=sys.stderr)
        return 2
    print(f"## Series {name} ({args.results})\n")
    print(summarise(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
