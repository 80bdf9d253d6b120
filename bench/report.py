"""From the suite's JSON lines: the markdown table, ours against each peer, the figures, the loss check.

    python -m bench.report docs/benchmarks/results.jsonl [--gpu "NVIDIA H100 80GB HBM3"]

One GPU's rows (``--gpu``, else the GPU with the most rows; the others are named and left out: the latest row
of a cell must not mix an H100's run into an H200's table). Writes docs/benchmarks/README.md,
iteration_time.png and iteration_vs_budget.png next to the results, with the hand-written notes.md from the
same folder, when there is one, ahead of the tables.
Exits non-zero, loudly, when our loss curve leaves the reference's (fused AdamW with our numerics, no offload)
by more than rounding noise.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

from bench.run_system import DATA_SEED
from bench.systems import OURS, REFERENCE

# Per step, |ours - reference| over the reference's first loss. Relative to each step's own loss would blow up
# as a memorised batch's loss nears 0. Ours and the reference (same numerics) stay within 0.05% on the H200;
# fp32 params under autocast (gpu_adamw) leave them by 0.2-1.2%; a wrong update, by tens of percent.
LOSS_TOLERANCE = 0.005


def gpus(path: Path) -> collections.Counter:
    """How many rows each GPU has (rows without one, from a CPU run, under None)."""
    return collections.Counter(json.loads(line).get("gpu") for line in path.read_text().splitlines()
                               if line.strip())


def load(path: Path, gpu: str | None = None) -> list[dict]:
    """The latest row for each (model, budget, system), its iteration time by today's rule (``steady``); a
    row of a ``bench.suite --rounds`` series stands for every round of its series (``over_rounds``). With
    ``gpu``: only that GPU's rows (and rows naming none)."""
    latest: dict[tuple, dict] = {}
    rounds: dict[tuple, list[dict]] = {}
    for number, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            row = steady(json.loads(line))
            if gpu is not None and row.get("gpu") not in (None, gpu):
                continue
            row["line"] = number  # later lines are later runs
            key = (row["model"], row["budget_gb"], row["system"])
            latest[key] = row
            if row.get("series") is not None and row.get("status") == "ok":
                rounds.setdefault((*key, row["series"]), []).append(row)
    return [over_rounds(row, rounds.get((*key, row.get("series")), [])) for key, row in latest.items()]


def over_rounds(row: dict, series: list[dict]) -> dict:
    """The series' row with its iteration the median of its rounds (and the mean of their means), the rounds'
    medians kept in ``rounds_iter_s``: runs of the same settings on one machine moved 8-20% (overlap.md calls
    66-70), so one round's figure is not the series' figure. The other columns (phases, rate, peak) are the
    median round's (the lower of the middle two for an even count), not the last round's; its ``line`` stays
    the last round's, the series' place among later runs."""
    if len(series) < 2 or row.get("status") != "ok":
        return row
    medians = [r["iter_s"] for r in series]
    means = [r["iter_mean_s"] for r in series if r.get("iter_mean_s") is not None]
    middle = sorted(series, key=lambda r: r["iter_s"])[(len(series) - 1) // 2]
    return {**middle, "line": row["line"], "iter_s": statistics.median(medians), "rounds_iter_s": medians,
            "iter_mean_s": statistics.fmean(means) if len(means) == len(series) else middle.get("iter_mean_s")}


def steady(row: dict) -> dict:
    """A row recorded before the timed loop left its first iteration out (no ``first_wall_s``) gets its
    ``iter_s`` from the walls after the first, as newer rows: the first starts after a synchronize, which
    lets an update left running past step() get ahead (it moved such rows by 1-2%, one by 7%)."""
    walls = row.get("iter_walls_s")
    if walls and len(walls) > 1 and "first_wall_s" not in row:
        row = {**row, "iter_s": statistics.median(walls[1:]), "iter_mean_s": statistics.fmean(walls[1:]),
               "first_wall_s": walls[0], "iter_walls_s": walls[1:]}
    return row


def _is_peer(system: str) -> bool:
    return not system.startswith(("ours", REFERENCE))


def _ours_of_each_cell(ok: dict[tuple, dict]) -> dict[tuple, dict]:
    """Per (model, budget), the latest run of ours with schedule "auto" (any of its options): the one
    compared with the peers, so that a ratio comes from the latest call rather than an older variant."""
    cells: dict[tuple, dict] = {}
    for (model, budget, system), row in ok.items():
        if system == OURS or system.startswith(OURS + "_"):
            held = cells.get((model, budget))
            if held is None or row.get("line", 0) > held.get("line", 0):
                cells[(model, budget)] = row
    return cells


def _budget(b: float | None) -> str:
    return "whole" if b is None else f"{b:g} GB"


def reference_of(system: str) -> str:
    """The reference run a run of ours is checked against: clipped for a clipped system, with the same loss
    spikes for one with spikes, the same loss factors for one whose norm hovers about the clip, the same
    batches for one trained on a fresh batch each step."""
    return (REFERENCE + ("_clip" if "_clip" in system else "") + ("_spikes" if "_spikes" in system else "")
            + ("_hover" if "_hover" in system else "") + ("_fresh" if "_fresh" in system else ""))


def loss_gap(row: dict, ref: dict) -> float:
    """The largest |ours - reference| over the steps both ran, over the reference's first loss."""
    return max(abs(a - b) for a, b in zip(row["losses"], ref["losses"])) / abs(ref["losses"][0])


def check_losses(rows: list[dict], tolerance: float = LOSS_TOLERANCE) -> list[str]:
    """One line per run of ours whose losses leave the reference's (same model; same budget, else whole)."""
    ok = {(r["model"], r["budget_gb"], r["system"]): r for r in rows if r.get("status") == "ok"}
    failures = []
    for (model, budget, system), row in ok.items():
        if not system.startswith("ours"):
            continue
        reference = reference_of(system)
        ref = ok.get((model, budget, reference)) or ok.get((model, None, reference))
        if ref is None:
            continue
        if row.get("data_seed", DATA_SEED) != ref.get("data_seed", DATA_SEED):
            continue  # another batch: another loss curve
        worst = loss_gap(row, ref)  # rows of runs with more iterations (a later protocol): the steps both ran
        row["loss_vs_reference"] = worst
        if worst > tolerance or min(len(row["losses"]), len(ref["losses"])) < 2:
            failures.append(f"{system} on {model} ({_budget(budget)}): loss differs from {reference} by "
                            f"{worst:.2%} of its first loss (tolerance {tolerance:.1%})")
    return failures


def loss_drops(rows: list[dict]) -> str:
    """How far each reference run's loss moved: the check has power only where that exceeds the tolerance."""
    refs = [r for r in rows if r["system"] == REFERENCE and r.get("status") == "ok"]
    return "\n".join(f"- {REFERENCE} on {r['model']} ({_budget(r['budget_gb'])}): loss {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f} ({(r['losses'][-1] - r['losses'][0]) / r['losses'][0]:+.1%})"
                     for r in refs)


def not_run(rows: list[dict]) -> list[str]:
    """What is missing, shown, not hidden: ours (any variant of OURS) under a model and budget where
    something ran, and each peer with no row (run or placed) where ours ran."""
    have = {(r["model"], r["budget_gb"], r["system"]) for r in rows}
    cells = sorted({(r["model"], r["budget_gb"]) for r in rows}, key=lambda c: (c[0], c[1] or 1e9))
    ours = {(r["model"], r["budget_gb"]) for r in rows if r["system"].startswith(OURS)}
    peers = sorted({r["system"] for r in rows if _is_peer(r["system"])})
    return [f"{m}, {_budget(b)}, {OURS}" for m, b in cells if (m, b) not in ours] + [
        f"{m}, {_budget(b)}, {s}" for m, b in cells if (m, b) in ours for s in peers if (m, b, s) not in have]


def notes(folder: Path) -> list[str]:
    """The hand-written reading of the results (notes.md beside them), when there is one."""
    path = folder / "notes.md"
    return [path.read_text().strip(), ""] if path.exists() else []


def settings(rows: list[dict]) -> str:
    """The settings each system ran with, as it reported them."""
    seen = {r["system"]: r["settings"] for r in rows if r.get("settings")}
    return "\n".join(f"- {name}: {text}" for name, text in sorted(seen.items()))


def by_footprint(rows: list[dict]) -> list[dict]:
    """Peers placed under the budgets they were not run at, from their run under the smallest budget they
    ran at (the whole device if none): a peer does not adapt to free memory, so under a larger budget it runs
    as there (a best case for it: an allocator near its cap can only do worse), and under a smaller one it
    fits if its peak does. This lets one call measure ours at every budget and each peer once, under the
    tightest budget it fits. The rows say so (``by_footprint``, ``measured_at_gb``)."""
    have = {(r["model"], r["budget_gb"], r["system"]) for r in rows}
    budgets = {m: {r["budget_gb"] for r in rows if r["model"] == m} for m in {r["model"] for r in rows}}
    source: dict[tuple[str, str], dict] = {}
    for r in rows:
        if not _is_peer(r["system"]) or r.get("status") != "ok":
            continue
        key, b = (r["model"], r["system"]), r["budget_gb"] or float("inf")
        if key not in source or b < (source[key]["budget_gb"] or float("inf")):
            source[key] = r
    out = []
    for (model, system), r in source.items():
        for b in sorted(budgets[model], key=lambda b: b or float("inf")):
            if (model, b, system) in have:
                continue
            row = {**r, "budget_gb": b, "by_footprint": True, "measured_at_gb": r["budget_gb"]}
            if b is not None and r["peak_gpu_GB"] > b:
                row.update(status="oom", error=f"peak {r['peak_gpu_GB']:.1f} GB under {_budget(r['budget_gb'])}")
            out.append(row)
    return out


def _measured_at(row: dict) -> str:
    """Where a row placed by its footprint was measured, for the tables; empty for a measured row."""
    return f" (run at {_budget(row.get('measured_at_gb'))}, by its peak)" if row.get("by_footprint") else ""


def _cell(row: dict, key: str, fmt: str = "{:.3f}") -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def _cells(r: dict) -> list[str]:
    """The measured columns of one row, or why there are none."""
    if r.get("status") != "ok":
        reason = "does not fit" if r.get("status") == "oom" else r.get("status", "error")
        detail = (r.get("error") or "").splitlines()[0][:80] if r.get("error") else ""
        return [f"{reason}: {detail}".rstrip(": ")] + [""] * 11
    pcie = r["pcie_h2d_GB"] + r["pcie_d2h_GB"] if "pcie_h2d_GB" in r else None
    return [_cell(r, "fwd_s"), _cell(r, "bwd_s"), _cell(r, "step_s"), _cell(r, "iter_s"), _cell(r, "iter_mean_s"),
            _cell(r, "update_Gparams_per_s", "{:.2f}"), _cell(r, "update_lower_bound_s"),
            _cell(r, "peak_gpu_GB", "{:.1f}"), _cell(r, "host_peak_GB", "{:.1f}"), _cell(r, "pinned_host_GB", "{:.1f}"),
            "-" if pcie is None else f"{pcie:.1f}", _cell(r, "loss_vs_reference", "{:.2%}")]


def table(rows: list[dict]) -> str:
    """One markdown table per model: every system under every budget, failures shown as such. Iteration:
    the median of the free-running walls, and their mean (where walls alternate, the loop runs at the mean)."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        out += [f"### {model}", "", "| system | budget | fwd s | bwd s | step s | iteration s | iteration mean s "
                "| update G params/s | update lower bound s | peak GPU GB | host peak GB | pinned host GB "
                "| PCIe GB/iter (in+out) | loss vs reference |", "|" + "---|" * 14]
        for r in sorted((r for r in rows if r["model"] == model), key=lambda r: (r["budget_gb"] or 1e9, r["system"])):
            name = r["system"] + _measured_at(r)
            out.append("| " + " | ".join([name, _budget(r["budget_gb"]), *_cells(r)]) + " |")
        out.append("")
    return "\n".join(out)


def ratios(rows: list[dict]) -> str:
    """Ours against each peer that ran, per model and budget: peer's time / ours (above 1: ours is faster).
    Ours is the latest run with schedule "auto" in that cell (named in the line)."""
    ok = {(r["model"], r["budget_gb"], r["system"]): r for r in rows if r.get("status") == "ok"}
    lines = []
    for (model, budget), ours in sorted(_ours_of_each_cell(ok).items(), key=lambda kv: (kv[0][0], kv[0][1] or 1e9)):
        parts = [f"{peer}{_measured_at(r)}: "
                 f"iteration x{r['iter_s'] / ours['iter_s']:.2f}{_step_ratio(r, ours)}"
                 for (m, b, peer), r in sorted(ok.items(), key=lambda kv: kv[0][2])
                 if m == model and b == budget and _is_peer(peer)]
        lines.append(f"- {model}, {_budget(budget)}, {ours['system']} {ours['iter_s']:.3f} s: "
                     + ("; ".join(parts) or "no peer ran"))
    return "\n".join(lines)


def _step_ratio(peer: dict, ours: dict) -> str:
    """", step xN" where both rows timed the step phase (a run without phases, ``--no-phases``, did not)."""
    if not peer.get("step_s") or not ours.get("step_s"):
        return ""
    return f", step x{peer['step_s'] / ours['step_s']:.2f}"


def figures(rows: list[dict], folder: Path) -> list[Path]:
    """Iteration time per system per model (whole device) and iteration time against the GPU budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    models = sorted({r["model"] for r in rows})
    systems = sorted({r["system"] for r in rows})
    palette = plt.cm.tab20.colors  # one colour per system, the same in both figures
    colour = {system: palette[i % len(palette)] for i, system in enumerate(systems)}
    paths = [folder / "iteration_time.png", folder / "iteration_vs_budget.png"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        ys = [next((r["iter_s"] for r in ok if r["model"] == m and r["budget_gb"] is None and r["system"] == system),
                   0.0) for m in models]
        ax.bar([x + i * width for x in range(len(models))], ys, width, label=system, color=colour[system])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(models))], models)
    ax.set_ylabel("iteration time, s (whole GPU; missing bar: did not run)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5 * max(len(models), 1) + 2.5, 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for i, system in enumerate(systems):
            mine = [r for r in ok if r["model"] == model and r["system"] == system]
            points = sorted((r["budget_gb"] or r.get("device_GB") or 141.0, r["iter_s"], bool(r.get("by_footprint")))
                            for r in mine)
            if points:
                x, y, placed = zip(*points)
                ax.plot(x, y, color=colour[system])
                ax.scatter([a for a, p in zip(x, placed) if not p], [b for b, p in zip(y, placed) if not p],
                           marker="o", color=colour[system])
                ax.scatter([a for a, p in zip(x, placed) if p], [b for b, p in zip(y, placed) if p], marker="o",
                           facecolors="none", edgecolors=colour[system])  # placed by its whole-device peak
            failed = [r["budget_gb"] for r in rows if r["model"] == model and r["system"] == system
                      and r.get("status") == "oom" and r["budget_gb"] is not None]
            offset = (i - len(systems) / 2) * 0.8  # side by side, so that every system's x shows
            ax.scatter([b + offset for b in failed], [0.0] * len(failed), marker="x", s=50, color=colour[system])
        ax.set_title(model)
        ax.set_xlabel("GPU memory budget, GB (whole device at the right)")
        ax.set_ylabel("iteration time, s (x on the axis: does not fit;\nhollow: a whole-device run placed by its peak)")
    handles = [plt.Line2D([], [], color=colour[s], marker="o", label=s) for s in systems]
    fig.legend(handles=handles, loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def write_report(results: Path, command: str, gpu: str | None = None) -> int:
    """The report of ``gpu``'s rows (default: the GPU with the most rows); 1 when the loss check fails."""
    counts = gpus(results)
    named = {g: n for g, n in counts.items() if g is not None}
    if gpu is None and named:
        gpu = max(named, key=named.get)
    elif gpu is not None and gpu not in named:
        raise SystemExit(f"no row of GPU {gpu!r} in {results}; its GPUs: {sorted(named) or 'none'}")
    others = {g: n for g, n in named.items() if g != gpu}
    rows = load(results, gpu)
    failures = check_losses(rows)
    rows += by_footprint(rows)
    first = next((r for r in rows if r.get("gpu")), {})
    paths = figures(rows, results.parent)
    text = ["# Benchmarks: ours against the peers", "",
            f"Generated by `{command}` from `{results.name}`; dates of the runs: "
            f"{', '.join(sorted({r.get('date', '?') for r in rows}))}. Machine: {first.get('gpu', '?')}, "
            f"torch {first.get('torch', '?')}. Each system ran in its own process. Iteration: the median wall time "
            "of iterations run as a training loop runs them, synchronised only by reading the loss, the first of "
            "them left out (rows with `iter_walls_s`; older rows: the sum of the phases), and their mean (where "
            "the walls alternate, as with `prefetch`, the loop runs at the mean); for a system run in rounds "
            "(`bench.suite --rounds`), the median of its rounds' medians and the mean of their means; forward, "
            "backward and step: measured in other iterations with a device synchronize around each phase.", "",
            *([f"Rows of other GPUs left out: {', '.join(f'{g} ({n})' for g, n in sorted(others.items()))}; "
               f"their report: `python -m bench.report {results.name} --gpu NAME` over a copy elsewhere (it "
               "writes README.md beside its file).", ""] if others else []),
            *notes(results.parent),
            "## Ours against each peer", "", "Each peer's time divided by ours under the same model and budget "
            f"(above 1: ours is faster); ours is the latest run of {OURS} or a variant of it in that cell.", "",
            ratios(rows), "", "## All results", "", table(rows), "",
            "Not run: " + ("; ".join(not_run(rows)) or "none") + ".", "", "## Settings", "", settings(rows), "",
            "## Figures", "", *[f"![{p.stem}]({p.name})" for p in paths], "", "## Loss check", "",
            "\n".join(f"- FAILED: {f}" for f in failures) or
            f"Every run of ours stayed within {REFERENCE}'s loss at every step, to {LOSS_TOLERANCE:.1%} of the "
            "first loss (column \"loss vs reference\": the worst step).",
            "", loss_drops(rows)]
    (results.parent / "README.md").write_text("\n".join(text) + "\n")
    if failures:
        print("LOSS CHECK FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The benchmark report of one GPU's rows.")
    parser.add_argument("results", nargs="?", default="docs/benchmarks/results.jsonl", type=Path)
    parser.add_argument("--gpu", help="the GPU whose rows to report (default: the one with the most rows)")
    args = parser.parse_args()
    command = "python -m bench.report " + str(args.results) + (f" --gpu '{args.gpu}'" if args.gpu else "")
    raise SystemExit(write_report(args.results, command, args.gpu))
