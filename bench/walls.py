"""Per run of ours, how steady its walls were: how many iterations' loss read waited, and the walls' spread.

    python -m bench.walls docs/results/2026-12-02-h200-call67/results-seed7.jsonl [FILE ...] [--last N]

The timed loop reads the loss after ``step()`` (bench/free_loop.py), as a training loop that logs it does.
That read is a copy to the host, and a direction of the link runs one copy at a time in the order enqueued:
when the update's flushes were enqueued first, the read waits for them (a wall 0.1 s long, then a short one,
as the next forward finds the update done). ``--last N`` reads only each file's last N rows (a call's
results file holds the rows of the calls before it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

WAITED_S = 0.01  # a loss read of a finished forward takes ~0.1 ms; one queued behind flushes, 0.1 s


def steadiness(row: dict) -> dict:
    """The iterations whose loss read waited (of those timed) and the walls' standard deviation."""
    reads = [split["loss_read"] for split in row["walls_split_s"]]
    return {"system": row["system"], "iter_s": row["iter_s"], "waited": sum(r > WAITED_S for r in reads),
            "walls": len(reads), "walls_sd_s": round(statistics.pstdev(row["iter_walls_s"]), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--last", type=int, default=None, help="only each file's last N rows")
    args = parser.parse_args(argv)
    print("| file | system | iteration s | loss reads that waited | walls' sd s |\n|---|---|---|---|---|")
    for path in args.files:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        for line in lines[-args.last:] if args.last else lines:
            row = json.loads(line)
            if row.get("status") == "ok" and str(row.get("system")).startswith("ours") and row.get("walls_split_s"):
                s = steadiness(row)
                print(f"| {path.parent.name}/{path.name} | {s['system']} | {s['iter_s']:.3f} | "
                      f"{s['waited']} of {s['walls']} | {s['walls_sd_s']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
