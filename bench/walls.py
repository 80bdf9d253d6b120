"""Per run of ours, how steady its walls were and what its steps recorded, from the suite's rows.

    python -m bench.walls docs/results/2026-12-02-h200-call67/results-seed7.jsonl [FILE ...] [--last N] [--distinct]
        [--references docs/benchmarks/results.jsonl]

Columns: how many iterations' loss read waited and the walls' standard deviation; the medians over the last
``STEPS`` steps' own records (``history``: the update's seconds, until every param write had run, how long
the next forward waited for them, the rest of the iteration the planner learnt, which sizes the fills
during backward, and what of the update ran before the next forward began, which that rest leaves out);
the median of the timed walls' backward; the CPU path's rate inside the update
(``cpu_path_rate``; with it each model's correlation of that rate with the iteration, over the runs shown);
what the host gave the timed loop (``bench.host_load``: the hypervisor's steal, the process's threads
preempted per second, the host copy's GB/s measured before the first step; each correlated with the
iteration like the rate); what the timed loop started from (``carried_into_loop``); the loss's largest gap
to the reference run of the same model and batch (``report.loss_gap``), found among the rows read and those
of ``--references``. For a clipped run (``clipped_steps`` in its row), a second table splits its walls: those
of steps the clip scaled (and of those among them whose step before was under it: its onsets, and the two
steps after each onset), and those of steps under the clip after two more under it (``clip_split``).

The timed loop reads the loss after ``step()`` (bench/free_loop.py), as a training loop that logs it does.
That read is a copy to the host, and a direction of the link runs one copy at a time in the order enqueued:
when the update's flushes were enqueued first, the read waits for them (a wall 0.1 s long, then a short one,
as the next forward finds the update done). ``--last N`` reads only each file's last N rows (a call's
results file holds the rows of the calls before it); ``--distinct`` shows each run once over many files.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.report import loss_gap, reference_of
from bench.run_system import DATA_SEED
from bench.systems import CLIP

WAITED_S = 0.01  # a loss read of a finished forward takes ~0.1 ms; one queued behind flushes, 0.1 s
STEPS = 12  # the steps of the timed iterations (the rows' history also holds the warm-up's)


def steadiness(row: dict) -> dict:
    """The iterations whose loss read waited (of those timed) and the walls' standard deviation."""
    reads = [split["loss_read"] for split in row["walls_split_s"]]
    return {"system": row["system"], "iter_s": row["iter_s"], "waited": sum(r > WAITED_S for r in reads),
            "walls": len(reads), "walls_sd_s": round(statistics.pstdev(row["iter_walls_s"]), 4)}


def step_records(row: dict) -> dict[str, float | None]:
    """Medians over the last STEPS steps of the update's seconds, its params done, the forward's wait, the
    rest of the iteration the planner learnt (``rest_s``: a step's seconds outside its update, backward
    mostly; what the fills planned during backward are sized by), what of the update after its last param
    write ran before the next forward began (``idle_tail_s``, left out of that rest: about 0 in a loop whose
    forward follows ``step()``; rows before 2026-12-04's forty-fourth session have none) and the subgroups
    filled during backward; and backward's span of final gradients the planner learnt (``backward_s``, which
    ``plan.FILLS_WITHIN_BACKWARD`` bounds the fills by; rows before 2026-12-04's forty-fifth session have none)."""
    steps = row.get("history", [])[-STEPS:]
    out = {}
    for key in ("update_s", "params_done_s", "forward_wait_s", "rest_s", "idle_tail_s", "prefetched", "backward_s"):
        values = [s[key] for s in steps if s.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def cpu_path_rate(row: dict) -> float | None:
    """G elements/s of the CPU path's AdamW inside the update (not what ran ahead during backward): the median
    over the last STEPS steps of the elements it updated there over its seconds (``cpu_adam_s``). The elements
    are counted as subgroups (those neither staged, resident nor run ahead) times the mean subgroup, as the
    rows keep no sizes: the subgroups are equal but the last."""
    count, params = row.get("subgroups"), row.get("params")
    rates = []
    for step in row.get("history", [])[-STEPS:]:
        if not count or not params or not step.get("cpu_adam_s") or step.get("staged") is None:
            continue
        on_cpu = count - step["staged"] - (row.get("resident_subgroups") or 0) - (step.get("speculated") or 0)
        if on_cpu > 0:
            rates.append(on_cpu * params / count / step["cpu_adam_s"] / 1e9)
    return statistics.median(rates) if rates else None


def host_of(row: dict) -> dict[str, float | None]:
    """What the host gave the run's timed loop (``bench.host_load``; rows before 2026-12-03 have none)."""
    load = row.get("host_load") or {}
    return {key: load.get(key) for key in ("steal", "preempted_per_s", "copy_GBps", "slowest_vcpu")}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _fmt(value: float | None) -> str:
    return _num(value, 3)


def new_segments(row: dict) -> int | None:
    """The segments the GPU allocator took from the driver over the timed loop (``bench.run_system``); None for
    rows without them (before 2026-12-04, or no GPU) and under expandable segments, which grow one segment by
    mapping pages that this count leaves out."""
    if "expandable_segments:True" in str(row.get("settings")):
        return None
    return (row.get("allocator_calls") or {}).get("cudaMalloc")


def _segments(row: dict) -> str:
    """``new_segments`` and what the allocator held at the timed loop's start and end: a count that stays high
    with the reserved GB still growing is memory a longer run keeps taking."""
    count = new_segments(row)
    reserved = row.get("reserved_gpu_GB")
    held = f" ({reserved['start']:.1f} -> {reserved['end']:.1f})" if reserved else ""
    return "-" if count is None else f"{count}{held}"


def loop_peak_came(row: dict) -> tuple[float, int, int] | None:
    """The timed loop's peak GB, the iteration it came in (1: the loop's uncounted first one) and how many
    the loop ran, from its peak so far after each (``bench.run_system.peak_reader``). After the synchronised
    phases, a peak in the first iterations came from what they taught the plan; a late one, from the loop's own.
    None for rows without them (before 2026-12-04's forty-fourth session, or no GPU)."""
    so_far = row.get("peak_so_far_gpu_GB")
    if not so_far:
        return None
    return so_far[-1], so_far.index(so_far[-1]) + 1, len(so_far)


def carried_into_loop(row: dict) -> tuple[int | None, int | None, float | None] | None:
    """What the timed loop started from: the subgroups its first update filled during backward, and the plan
    and learnt rest in force before it (the last step of the warm-up or the synchronised phases). After the
    phases those fills were 34-40 of 55 at 1.36B on an H200 against a median of 12-17 later in the loop
    (overlap.md calls 142-145), and the loop's peak came with them. None where the history does not reach
    back that far."""
    history, loop = row.get("history") or [], len(row.get("iter_walls_s") or []) + 1
    if len(history) <= loop:
        return None
    first, before = history[-loop], history[-loop - 1]
    return first.get("prefetched"), before.get("planned_staged"), before.get("rest_s")


def _rest(records: dict) -> str:
    """The learnt rest and, where recorded, backward's span in brackets."""
    span = records.get("backward_s")
    return _fmt(records["rest_s"]) + ("" if span is None else f" ({span:.3f})")


def _carried(row: dict) -> str:
    carried = carried_into_loop(row)
    if carried is None:
        return "-"
    fills, planned, rest = carried
    return f"{'-' if fills is None else fills} ({'-' if planned is None else planned}, {_fmt(rest)})"


def _peak(row: dict) -> str:
    """The run's peak GPU memory and, in brackets, the need over forward and backward that the budget measured
    (the peak less the residents and the step's fills; until the forty-seventh session, with ``overlap``, also
    what the last update still had on the GPU, which rows since leave out) and, where the row has it, what the
    optimizer held at the peak that set that need (``+ N``); then ``loop_peak_came``, where the row has it."""
    peak, need, came = row.get("peak_gpu_GB"), row.get("gpu_need_GB"), loop_peak_came(row)
    ours = row.get("gpu_ours_at_need_GB")
    return "-" if peak is None else (f"{peak:.1f}" + ("" if need is None else f" ({need:.1f}"
                                                      + ("" if ours is None else f" + {ours:.1f}") + ")")
                                     + ("" if came is None else f"; loop {came[0]:.1f} in {came[1]} of {came[2]}"))


def _batch(row: dict) -> tuple:
    return row["model"], row.get("data_seed", DATA_SEED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--last", type=int, default=None, help="only each file's last N rows")
    parser.add_argument("--distinct", action="store_true",
                        help="skip a run already shown (a call's results file holds the rows of the calls before it)")
    parser.add_argument("--references", nargs="*", type=Path, default=[],
                        help="more files to find the reference runs in (their latest run per model and batch)")
    args = parser.parse_args(argv)
    runs = []
    for path in args.files:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        runs += [(path, json.loads(line)) for line in (lines[-args.last:] if args.last else lines)]
    references = {}
    for row in [json.loads(line) for p in args.references for line in p.read_text().splitlines() if line.strip()] \
            + [row for _, row in runs]:
        if row.get("status") == "ok" and not str(row.get("system")).startswith("ours"):
            references[(row["system"], *_batch(row))] = row
    print("| file | system | iteration s | loss reads that waited | walls' sd s | update s | params done s "
          "| forward wait s | rest learnt s (backward span) | idle tail s | backward s | CPU path G el/s | steal "
          "| preempted /s | host copy GB/s "
          "| peak GPU GB (need; the timed loop's, in its iteration) | new GPU segments (reserved GB) "
          "| loop's first fills (staged planned, rest s before it) | loss vs reference |\n" + "|---" * 19 + "|")
    seen, by_model, fills = set(), {}, {}
    for path, row in runs:
        if row.get("status") != "ok" or not str(row.get("system")).startswith("ours") or not row.get("walls_split_s"):
            continue
        key = (row["system"], *_batch(row), tuple(row["iter_walls_s"]))
        if args.distinct and key in seen:
            continue
        seen.add(key)
        s, r, cpu, host = steadiness(row), step_records(row), cpu_path_rate(row), host_of(row)
        ref = references.get((reference_of(row["system"]), *_batch(row)))
        gap = "-" if ref is None else f"{loss_gap(row, ref):.2%}"
        backward = statistics.median(split["backward"] for split in row["walls_split_s"])
        print(f"| {path.parent.name}/{path.name} | {s['system']} | {s['iter_s']:.3f} | {s['waited']} of "
              f"{s['walls']} | {s['walls_sd_s']:.3f} | {_fmt(r['update_s'])} | {_fmt(r['params_done_s'])} | "
              f"{_fmt(r['forward_wait_s'])} | {_rest(r)} | {_fmt(r['idle_tail_s'])} | {backward:.3f} | "
              f"{_num(cpu, 2)} | {_pct(host['steal'])} | {_num(host['preempted_per_s'], 0)} | "
              f"{_num(host['copy_GBps'], 1)} | {_peak(row)} | {_segments(row)} | {_carried(row)} | {gap} |")
        if r["prefetched"] is not None:  # fills during backward against backward's host seconds
            fills.setdefault(row["model"], []).append((r["prefetched"], backward))
        for name, value in (("the CPU path's rate in the update", cpu), ("the host's steal", host["steal"]),
                            ("the threads preempted per s", host["preempted_per_s"]),
                            ("the host copy's GB/s", host["copy_GBps"]),
                            ("the slowest vCPU's speed over the fastest's", host["slowest_vcpu"]),
                            ("the subgroups filled during backward", r["prefetched"]),
                            ("the GPU allocator's new segments", new_segments(row)),
                            ("backward's host seconds", backward)):
            if value is not None:
                by_model.setdefault((row["model"], name), []).append((value, row["iter_s"]))
    splits = [(path, row, clip_split(row)) for path, row in runs if row.get("status") == "ok"
              and str(row.get("system")).startswith("ours")]
    splits = [(path, row, split) for path, row, split in splits if split is not None]
    if splits:
        print(f"\n| file | system | model | iteration s | walls of steps the clip scaled (n, median s) "
              f"| of those, after a step under it (n, median s) | the two after each of those (n, median s) "
              f"| walls of steps under the clip, after two under it (n, median s) "
              f"| run ahead in those walls, undone / stood down: at onsets; other steps the clip scaled; steps "
              f"under it |\n"
              + "|---" * 9 + "|")
        for path, row, split in splits:
            ahead = run_ahead_split(row)
            print(f"| {path.parent.name}/{path.name} | {row['system']} | {row['model']} | {row['iter_s']:.3f} | "
                  f"{_walls(split['clipped'])} | {_walls(split['onset'])} | {_walls(split['after_onset'])} | "
                  f"{_walls(split['steady'])} | "
                  + ("-" if ahead is None else "; ".join(f"{u} / {s}" for u, s in ahead.values())) + " |")
    for (model, name), pairs in by_model.items():
        _print_correlation(f"{model}: {name} against the iteration", pairs)
    for model, pairs in fills.items():
        _print_correlation(f"{model}: the subgroups filled during backward against backward's host seconds", pairs)
    return 0


def _timed_steps(row: dict, max_norm: float) -> tuple[int, list[bool]] | None:
    """The step of the first timed wall (the walls are the last of the steps the norms were recorded for) and,
    per step, whether the clip scaled it; None without a norm for every wall."""
    norms, walls = row.get("grad_norms"), row.get("iter_walls_s")
    if not norms or not walls or len(norms) < len(walls):
        return None
    return len(norms) - len(walls), [n is not None and n + 1e-6 > max_norm for n in norms]


def _clip_did(k: int, scaled: list[bool]) -> str:
    """Step ``k``: "onset" (the clip scaled it, not the step before), "scaled" (the clip scaled it and the step
    before, or it is the first) or "under"."""
    return ("onset" if k and not scaled[k - 1] else "scaled") if scaled[k] else "under"


def clip_split(row: dict, max_norm: float = CLIP) -> dict | None:
    """A clipped run's timed walls split by what the clip did, None for a run without ``clipped_steps``.

    ``clipped``: walls of steps whose norm the clip scaled (their CPU path waits for the global norm: no
    update runs ahead of it); ``onset``: those of them whose step before was under the clip (the updates run
    ahead in their backward stand down once the norm landed passes the clip's, or are undone); ``after_onset``:
    walls of the two steps after each onset, where those under the clip carry its cost on (the update of the
    onset runs beside the next forward, and the step after a clip runs none ahead by default); ``steady``:
    walls of steps under the clip whose two steps before were under it too (the update of the step before ran
    ahead, and so did this one's: ``speculate`` is off for the step after one that clipped); the rest,
    between, counted in neither (``_timed_steps``: which steps the walls are). A memorised batch's norm falls
    under 1.0 after about 8 steps: a loop timed from the third step times 5 that clip (rows run without phases,
    from 2026-12-04)."""
    steps = _timed_steps(row, max_norm)
    if "clipped_steps" not in row or steps is None:
        return None
    first, scaled = steps
    walls = row["iter_walls_s"]
    clipped = [w for j, w in enumerate(walls) if scaled[first + j]]
    onsets = {k for k in range(first, first + len(walls)) if _clip_did(k, scaled) == "onset"}
    onset = [w for j, w in enumerate(walls) if first + j in onsets]
    after_onset = [w for j, w in enumerate(walls) if {first + j - 1, first + j - 2} & onsets]
    steady = [w for j, w in enumerate(walls) if first + j >= 2 and not any(scaled[first + j - 2: first + j + 1])]
    return {"clipped": clipped, "onset": onset, "after_onset": after_onset, "steady": steady}


def run_ahead_split(row: dict, max_norm: float = CLIP) -> dict[str, tuple[int, int]] | None:
    """The updates run ahead undone and stood down in the timed walls' steps (those ``clip_split`` splits:
    warm-up and synchronised steps left out, whose gradients have all landed before the step) at the clip's
    onsets (a step it scaled after one it did not), at the other steps it scaled, and at steps under it; None
    for a row whose steps do not record them (``history``'s ``run_ahead``, from the fifty-fifth session)."""
    steps, history = _timed_steps(row, max_norm), row.get("history") or []
    if steps is None or len(history) != len(steps[1]) or any("run_ahead" not in h for h in history):
        return None
    first, scaled = steps
    out = {"onset": [0, 0], "scaled": [0, 0], "under": [0, 0]}
    before = history[first - 1]["run_ahead"] if first else {"undone": 0, "stood_down": 0}
    for k in range(first, len(scaled)):
        now = history[k]["run_ahead"]
        kind = _clip_did(k, scaled)
        out[kind][0] += now["undone"] - before["undone"]
        out[kind][1] += now["stood_down"] - before["stood_down"]
        before = now
    return {k: (u, s) for k, (u, s) in out.items()}


def _walls(walls: list[float]) -> str:
    return f"{len(walls)}, {statistics.median(walls):.3f}" if walls else "0, -"


def _print_correlation(label: str, pairs: list[tuple[float, float]]) -> None:
    """``label, r = ...`` over the pairs, where there are 3 or more and each side varies."""
    if len(pairs) >= 3 and len({x for x, _ in pairs}) > 1 and len({y for _, y in pairs}) > 1:
        r_value = statistics.correlation([x for x, _ in pairs], [y for _, y in pairs])
        print(f"\n{label}, r = {r_value:.2f} over {len(pairs)} runs")


if __name__ == "__main__":
    raise SystemExit(main())
