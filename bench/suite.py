"""Run every system on every model and GPU memory budget, one process each; append results as JSON lines.

    python -m bench.suite --models 1.36b,5.2b --budgets whole,40 --systems all --out docs/benchmarks/results.jsonl

Cells already in --out with a result (ran, or did not fit) are skipped unless --again, so a long suite can
be run in pieces (the GPU machine takes 10-minute commands); cells that errored or timed out run again, and
the report keeps each cell's latest row. After the runs, the report is rebuilt (``bench.report``): the
markdown table, the ratios and the figures, and the loss check of ours.

``--rounds N`` runs the whole list N times, alternating (A B A B ...), each row marked with its ``round`` and
the call's ``series``: runs of the same settings on one H200 moved 8-20% within a lease (overlap.md calls
66-70), so a lever is judged by paired rounds (``python -m bench.rounds``), not by one run of each.

``NAME@DIR`` runs system NAME (as that tree's bench names it) with the library and bench of another commit's
tree in DIR (``bench/tree.sh REV`` makes one under ``.ab/``), with a calibration cache of its own: in rounds
beside plain NAME it tells whether a change between two commits moved the iteration, on one machine rather
than across hosts that differ by more than the change (the CPU path's rate went 2.1-3.9 G elements/s between
H200 hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.run_system import RESULT
from bench.systems import SYSTEMS

NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_budgets(text: str) -> list[float | None]:
    """'whole,40,24' -> [None, 40.0, 24.0] (None: the whole device)."""
    budgets = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("whole", "all", "device"):
            budgets.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"budget {item!r} is not a number of GB or 'whole'") from None
        if value <= 0:
            raise ValueError(f"budget {value} GB must be > 0")
        budgets.append(value)
    return budgets


def split_tree(system: str) -> tuple[str, Path | None]:
    """``NAME@DIR`` -> (NAME, DIR): the system and the source tree it runs from (None: this one)."""
    name, at, tree = system.partition("@")
    return name, (Path(tree) if at else None)


def parse_systems(text: str) -> list[str]:
    names = sorted(SYSTEMS) if text == "all" else [s.strip() for s in text.split(",")]
    unknown = [s for s in names if split_tree(s)[1] is None and s not in SYSTEMS]  # a tree's bench checks its own
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {', '.join(sorted(SYSTEMS))}")
    for name in names:
        tree = split_tree(name)[1]
        if tree is not None and not (tree / "bench" / "run_system.py").is_file():
            raise ValueError(f"{name}: no bench/run_system.py under {tree}; make the tree with bench/tree.sh REV "
                             "(and carry it to the GPU machine)")
    return names


def parse_result(stdout: str, stderr: str, returncode: int | None) -> dict:
    """The row a run printed, or an error row that says what happened."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT):
            try:
                return json.loads(line[len(RESULT):])
            except json.JSONDecodeError as e:
                return {"status": "error", "error": f"unreadable result line: {e}"}
    if returncode is None:
        return {"status": "timeout", "error": "no result before the time limit"}
    return {"status": "error", "error": f"exit code {returncode}, no result line; stderr: {stderr[-800:]}"}


def done(out: Path) -> set[tuple]:
    """The cells with a result: ran, or did not fit. Errors and timeouts are run again on the next call."""
    if not out.exists():
        return set()
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {(r["model"], r["budget_gb"], r["system"]) for r in rows if r.get("status") in ("ok", "oom")}


def iterations(command: str) -> int | None:
    """How many iterations a run of ``bench.run_system`` with this command line trains: the warm-up, the
    synchronised phases' (unless ``--no-phases``), and the timed loop's with its uncounted first one; None
    for a command without ``--iters`` and ``--warmup``."""
    words = command.split()
    try:
        iters, warmup = (int(words[words.index(flag) + 1]) for flag in ("--iters", "--warmup"))
    except (ValueError, IndexError):
        return None
    return (warmup if "--no-phases" in words else warmup + iters) + iters + 1


def _scaled_wall(row: dict, command: str | None) -> float:
    """The row's wall time, its iterations' share rescaled (at its median iteration) to those ``command``
    trains: a run asked for more iterations than its last takes longer (H200 call 144: DeepSpeed at 5.2B
    with 12 after 5)."""
    was, now = iterations(row.get("command") or ""), iterations(command or "")
    if was is None or now is None or not row.get("iter_s"):
        return row["wall_s"]
    return row["wall_s"] + row["iter_s"] * (now - was)


def expected_wall(out: Path, model: str, budget: float | None, system: str,
                  command: str | None = None) -> float | None:
    """Seconds the newest finished run of this cell took (``wall_s``), rescaled to the iterations of
    ``command`` where given (``_scaled_wall``); for a system of ours never run at this model and budget,
    the slowest newest run of ours there; None when nothing is known."""
    if not out.exists():
        return None
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    cell = [r for r in rows if r.get("status") == "ok" and r.get("model") == model
            and r.get("budget_gb") == budget and r.get("wall_s") is not None]
    newest = {r["system"]: _scaled_wall(r, command) for r in cell}  # each system's newest run
    if system in newest:
        return newest[system]
    ours = [w for s, w in newest.items() if system.startswith("ours") and str(s).startswith("ours")]
    return max(ours) if ours else None


def timed_in_phases(system: str, phases: str) -> bool:
    """Whether ``system``'s run times synchronised phases before its loop (``--phases``): "all", "none",
    or "peers", where ours run free from the first step, as the phases' synchronisations teach our plan a
    rest that a loop without them never sees (at 1.36B on an H200 the timed loop's peak then rose from
    25.7-26.1 to 42.4-44.4 GB, overlap.md calls 142-145), and the peers keep their forward/backward/step
    breakdown."""
    return phases == "all" or (phases == "peers" and not system.startswith("ours"))


def command(system: str, model: str, budget: float | None, args: argparse.Namespace) -> list[str]:
    """The ``bench.run_system`` command line of one run."""
    iters = args.iters if system.startswith("ours") or args.peer_iters is None else args.peer_iters
    cmd = [sys.executable, "-m", "bench.run_system", "--system", split_tree(system)[0], "--model", model,
           "--iters", str(iters), "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch), "--seq",
           str(args.seq), "--data-seed", str(args.data_seed)]
    cmd += ["--budget-gb", str(budget)] if budget is not None else []
    return cmd + (["--no-phases"] if not timed_in_phases(system, args.phases) else [])


def run_one(system: str, model: str, budget: float | None, args: argparse.Namespace,
            timeout: float | None = None) -> dict:
    """One system's run in a process of its own, killed after ``timeout`` seconds (default ``--timeout``)."""
    cmd = command(system, model, budget, args)
    env = {**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1"}
    tree = split_tree(system)[1]
    if tree is not None:  # its library and bench first on the path; its own calibration cache
        tree = tree.resolve()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
        env["DOS_CACHE_DIR"] = str(Path(env.get("DOS_CACHE_DIR") or tree / ".cache") / f"tree-{tree.name}")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or args.timeout, env=env,
                              cwd=tree)
        row = parse_result(proc.stdout, proc.stderr, proc.returncode)
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        row = parse_result(stdout, "", None)
    row.update(system=system, model=model, budget_gb=budget, wall_s=round(time.perf_counter() - t0, 1),
               date=time.strftime("%Y-%m-%d"), command=" ".join(cmd[1:]))
    if tree is not None:
        commit = tree / "COMMIT"
        row.update(tree=commit.read_text().strip() if commit.is_file() else str(tree))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1.36b")
    parser.add_argument("--budgets", default="whole")
    parser.add_argument("--systems", default="all")
    parser.add_argument("--out", default="docs/benchmarks/results.jsonl")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--peer-iters", type=int, default=None,
                        help="timed iterations of the peers' runs (default --iters): DeepSpeed's 5.2B run of 5 "
                        "took 125 s on an H200, one of 12 did not end within 280 s (overlap.md calls 142-145)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--phases", choices=("all", "peers", "none"), default="all",
                        help="which systems time synchronised phases before their loop; the others "
                        "synchronise no iteration (bench.run_system --no-phases), as a loop that never does: "
                        "peers: all but ours")
    parser.add_argument("--timeout", type=float, default=280, help="seconds per system run")
    parser.add_argument("--data-seed", type=int, default=1000, help="seed of the training batch (another one "
                        "repeats the runs on fresh data; write those to another --out)")
    parser.add_argument("--again", action="store_true", help="run even if a row exists")
    parser.add_argument("--rounds", type=int, default=1, help="run the list this many times, alternating "
                        "(rows marked with their round; summarised by python -m bench.rounds)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="start no run that its last recorded run says would end after this many "
                        "seconds (it is left for the next call)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    start = time.perf_counter()
    series = time.strftime("%Y-%m-%dT%H:%M:%S")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    finished = set() if args.again else done(out)
    cells = [(m, b, s) for m in args.models.split(",") for b in parse_budgets(args.budgets)
             for s in parse_systems(args.systems) if (m, b, s) not in finished]
    jobs = [(r, *cell) for r in range(1, args.rounds + 1) for cell in cells]
    gpu = None
    for turn, model, budget, system in jobs:
        timeout = None
        if args.deadline is not None:
            left = args.deadline - (time.perf_counter() - start)
            line = " ".join(command(system, model, budget, args)[1:])
            need = expected_wall(out, model, budget, system, line) or 0.0
            if need > left:  # the device time it would spend before being killed would be lost
                print(f"deadline: {model} {budget or 'whole'} {system} left for the next call "
                      f"(about {need:.0f} s by its last run, {max(left, 0):.0f} s left)", flush=True)
                continue
            # a run longer than its last (more iterations asked) ends at the deadline as a timeout row, not
            # past it, where the device's limit would kill the call (H200 call 144: DeepSpeed at 5.2B)
            timeout = min(args.timeout, left)
        row = run_one(system, model, budget, args, timeout)
        if args.rounds > 1:
            row.update(round=turn, rounds=args.rounds, series=series)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        gpu = row.get("gpu") or gpu
        print(f"{model:6} {str(budget or 'whole'):>5} {system:24} {row['status']:8} "
              f"iter {row.get('iter_s', '-')} s  step {row.get('step_s') or '-'} s", flush=True)
    if not out.exists():
        return 0
    from bench.report import write_report

    return write_report(out, " ".join(["python -m bench.suite", *(argv if argv is not None else sys.argv[1:])]),
                        gpu)  # the report of the GPU run here, not of the file's most rows


if __name__ == "__main__":
    sys.exit(main())
