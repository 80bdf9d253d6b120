"""The comparison harness's own logic on the CPU: parsing, budgets, tables, the loss check, a smoke run."""

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import dist_estimate, host_load, rate_fit, report, rounds, run_system, suite, systems, walls
from bench.free_loop import PARTS, free_running
from bench.systems import CLIP, REFERENCE
from deep_optimizer_states.core import cpu_adamw
from deep_optimizer_states.tools.models import checkpoints_activations
from tests.harness import needs_compiler


def test_budgets_are_parsed_and_checked():
    assert suite.parse_budgets("whole, 40,24") == [None, 40.0, 24.0]
    for bad in ("forty", "0", "-5"):
        with pytest.raises(ValueError):
            suite.parse_budgets(bad)
    assert run_system.budget_fraction(None, 141e9) is None
    assert run_system.budget_fraction(40, 140e9) == pytest.approx(40 / 140)
    with pytest.raises(ValueError, match="more than the device"):
        run_system.budget_fraction(200, 141e9)
    with pytest.raises(ValueError, match="must be > 0"):
        run_system.budget_fraction(0, 141e9)


def test_unknown_system_is_refused():
    with pytest.raises(ValueError, match="unknown systems"):
        suite.parse_systems("ours_auto,zero_infinity")
    assert "ours_auto" in suite.parse_systems("all")


def test_result_lines_are_found_among_noise():
    row = {"system": "x", "status": "ok", "iter_s": 1.0}
    out = "deepspeed says hello\n" + run_system.RESULT + json.dumps(row) + "\nbye\n"
    assert suite.parse_result(out, "", 0) == row
    assert suite.parse_result("noise", "Traceback: boom", 1)["status"] == "error"
    assert "boom" in suite.parse_result("noise", "Traceback: boom", 1)["error"]
    assert suite.parse_result("", "", None)["status"] == "timeout"
    assert suite.parse_result(run_system.RESULT + "{broken", "", 0)["status"] == "error"


def _row(system, budget=None, status="ok", iter_s=1.0, losses=(10.0, 9.9, 9.8), model="1.36b", **extra):
    row = {"system": system, "model": model, "budget_gb": budget, "status": status}
    if status == "ok":
        row.update(fwd_s=0.1, bwd_s=0.2, step_s=iter_s - 0.3, iter_s=iter_s, update_Gparams_per_s=4.0,
                   peak_gpu_GB=10.0, host_peak_GB=30.0, losses=list(losses), **extra)
    else:
        row.update(error="OutOfMemoryError: CUDA out of memory")
    return row


def test_rows_recorded_with_their_first_wall_are_read_without_it(tmp_path):
    """An old row's iter_s counted the first timed iteration (shortened by an update left running): the
    report takes the median of the others; a new row (first_wall_s) is read as it is."""
    results = tmp_path / "results.jsonl"
    old = _row("ours_offload_overlap", iter_s=0.5, iter_walls_s=[0.1, 0.5, 0.6, 0.7])
    new = _row("ours_offload", iter_s=0.55, iter_walls_s=[0.5, 0.55, 0.6], first_wall_s=0.2)
    results.write_text("\n".join(json.dumps(r) for r in (old, new)) + "\n")
    rows = {r["system"]: r for r in report.load(results)}
    assert rows["ours_offload_overlap"]["iter_s"] == 0.6 and rows["ours_offload_overlap"]["first_wall_s"] == 0.1
    assert abs(rows["ours_offload_overlap"]["iter_mean_s"] - 0.6) < 1e-12
    assert rows["ours_offload"]["iter_s"] == 0.55 and rows["ours_offload"]["iter_walls_s"] == [0.5, 0.55, 0.6]


def test_loss_check_accepts_bf16_noise_and_catches_divergence():
    rows = [_row(REFERENCE), _row("ours_auto", losses=(10.0, 9.91, 9.79)),
            _row("ours_cpu", losses=(10.0, 9.9, 10.4)), _row(REFERENCE, budget=40, status="oom"),
            _row("ours_auto", budget=40, losses=(10.0, 9.9, 9.8))]
    failures = report.check_losses(rows)
    assert len(failures) == 1 and "ours_cpu" in failures[0]
    assert rows[4]["loss_vs_reference"] == 0.0  # compared with the whole-device reference


def test_table_and_ratios_show_every_system_including_failures():
    rows = [_row("ours_auto", iter_s=0.5, iter_mean_s=0.4, pcie_h2d_GB=10.0, pcie_d2h_GB=10.0, pinned_host_GB=21.8),
            _row("torchao_offload", iter_s=1.0), _row("deepspeed_zero3_offload", status="oom"),
            _row("ours_auto", budget=40, iter_s=0.6), _row("twinflow_0.5", budget=40, iter_s=1.8)]
    text = report.table(rows)
    assert "does not fit" in text and "| ours_auto | whole |" in text and "| 40 GB |" in text
    assert "| 20.0 |" in text  # PCIe in + out
    assert "| 0.500 | 0.400 |" in text  # the walls' median and mean (a loop whose walls alternate runs at the mean)
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    r = report.ratios(rows)
    assert "torchao_offload: iteration x2.00" in r and "twinflow_0.5: iteration x3.00" in r


def test_peers_measured_once_are_placed_under_each_budget_by_their_peak():
    """Ours runs at every budget; a peer runs once, under the tightest budget it fits (or the whole device):
    under a larger budget it shows as there, under a smaller one as fitting if its peak does, marked either
    way with where it was measured; a peer measured at a budget keeps its row."""
    rows = [_row("ours_auto", budget=b, iter_s=0.5) for b in (24, 32, 40, None)] + [
        _row("deepspeed_zero3_offload", iter_s=2.0, peak=31.7),
        _row("fsdp2_offload", iter_s=2.5, peak=20.8), _row("fsdp2_offload", budget=40, iter_s=2.6, peak=20.8),
        _row("torchao_offload", budget=32, iter_s=1.5, peak=30.0), _row("torchao_offload", budget=40, iter_s=1.6,
                                                                         peak=30.0)]
    for r in rows:
        r["peak_gpu_GB"] = r.pop("peak", r["peak_gpu_GB"])
    placed = {(r["budget_gb"], r["system"]): r for r in report.by_footprint(rows)}
    assert set(placed) == {(24, "deepspeed_zero3_offload"), (32, "deepspeed_zero3_offload"),
                           (40, "deepspeed_zero3_offload"), (24, "fsdp2_offload"), (32, "fsdp2_offload"),
                           (24, "torchao_offload"), (None, "torchao_offload")}
    assert placed[(24, "deepspeed_zero3_offload")]["status"] == "oom"
    assert placed[(32, "deepspeed_zero3_offload")]["status"] == "ok"
    assert placed[(24, "fsdp2_offload")]["iter_s"] == 2.6, "the run under the smallest budget stands for the rest"
    assert placed[(None, "torchao_offload")]["iter_s"] == 1.5 and placed[(24, "torchao_offload")]["status"] == "oom"
    assert all(r["by_footprint"] for r in placed.values())
    text = report.table(rows + list(placed.values()))
    assert "deepspeed_zero3_offload (run at whole, by its peak) | 24 GB | does not fit" in text
    assert "fsdp2_offload (run at 40 GB, by its peak) | 24 GB | 0.100" in text
    assert "torchao_offload (run at 32 GB, by its peak) | whole |" in text
    assert "fsdp2_offload: iteration x5.20" in report.ratios(rows + list(placed.values()))  # measured at 40 GB


def test_report_writes_markdown_figures_and_fails_loudly(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in [_row(REFERENCE), _row("gpu_adamw"),
                                                         _row("ours_auto", iter_s=0.5)]) + "\n")
    assert report.write_report(results, "python -m bench.suite --test") == 0
    readme = (tmp_path / "README.md").read_text()
    assert "python -m bench.suite --test" in readme and "gpu_adamw: iteration x2.00" in readme
    assert (tmp_path / "iteration_time.png").stat().st_size > 1000
    assert (tmp_path / "iteration_vs_budget.png").stat().st_size > 1000
    with results.open("a") as f:
        f.write(json.dumps(_row("ours_auto", iter_s=0.5, losses=(10.0, 11.0, 12.0))) + "\n")
    assert report.write_report(results, "again") == 1
    assert "FAILED" in (tmp_path / "README.md").read_text()


def test_report_keeps_one_gpus_rows_and_names_the_others(tmp_path):
    """A file holding an H100 call beside H200 calls: each cell's latest row would be the H100's under the
    H200's name. The report takes the GPU with the most rows (or ``gpu``), names the others it left out, and
    refuses a GPU the file does not hold."""
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    rows = [_row(REFERENCE, gpu=h200), _row("ours_auto", iter_s=0.45, gpu=h200),
            _row("ours_auto", iter_s=0.65, gpu=h100)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["iter_s"] for r in report.load(results) if r["system"] == "ours_auto"] == [0.65]
    assert report.write_report(results, "python -m bench.report") == 0
    readme = (tmp_path / "README.md").read_text()
    assert f"Machine: {h200}," in readme and f"Rows of other GPUs left out: {h100} (1)" in readme
    assert "| 0.450 |" in readme and "| 0.650 |" not in readme
    assert report.write_report(results, "python -m bench.report --gpu", h100) == 0
    readme = (tmp_path / "README.md").read_text()
    assert f"Machine: {h100}," in readme and "| 0.650 |" in readme and "| 0.450 |" not in readme
    with pytest.raises(SystemExit, match="no row of GPU 'NVIDIA A100'"):
        report.write_report(results, "python -m bench.report", "NVIDIA A100")


def test_report_takes_a_run_without_phases(tmp_path):
    """A row of ours run without phases (``--no-phases``) has no step time: the ratios give the iteration's
    alone for it, and the report still writes."""
    no_phases = {**_row("ours_auto", iter_s=0.5), "fwd_s": None, "bwd_s": None, "step_s": None, "phases": False}
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in (_row(REFERENCE), _row("gpu_adamw"), no_phases)))
    assert report.write_report(results, "python -m bench.suite --no-phases") == 0
    readme = (tmp_path / "README.md").read_text()
    assert "gpu_adamw: iteration x2.00;" in readme or "gpu_adamw: iteration x2.00\n" in readme
    assert "step x" not in readme.split("gpu_adamw: iteration x2.00")[1].split("\n")[0]


@pytest.mark.parametrize("system", ["ours_auto", "ours_gpu", "ours_offload_overlap", "gpu_adamw", REFERENCE])
def test_smoke_run_of_a_tiny_model_on_the_cpu(system):
    row = run_system.run(system, "tiny", None, iters=2, warmup=1, micro_batch=1, seq=16, device=torch.device("cpu"))
    assert row["status"] == "ok", row.get("traceback")
    assert len(row["losses"]) == 1 + 2 + (2 + 1) and row["step_s"] > 0 and len(row["iter_walls_s"]) == 2  # + first wall
    assert row["losses"][-1] < row["losses"][0]  # one batch, learnt: the loss check has something to see
    # each counted wall split into the host's seconds per call, adding up to it
    assert [sorted(split) for split in row["walls_split_s"]] == [sorted(PARTS)] * 2
    assert all(abs(sum(split.values()) - wall) < 1e-3 for split, wall in zip(row["walls_split_s"], row["iter_walls_s"]))
    # the mean wall beside the median: a loop whose walls alternate runs at the mean, not the median
    assert abs(row["iter_mean_s"] - sum(row["iter_walls_s"]) / 2) < 1e-3
    if system.startswith("ours"):
        assert row["pinned_host_GB"] > 0 and row["pcie_h2d_GB"] > 0
    assert row["openmp_runtimes"] is None or all(os.path.isfile(p) for p in row["openmp_runtimes"])
    assert row["allocator_calls"] is None and row["reserved_gpu_GB"] is None  # no GPU allocator here
    assert row["peak_gpu_GB"] is None and row["peak_so_far_gpu_GB"] is None and walls.loop_peak_came(row) is None
    assert row["phases"] is True
    # what the host gave the timed loop (Linux: /proc)
    load = row["host_load"]
    assert sorted(load) == ["busy", "copy_GBps", "preempted_per_s", "slowest_vcpu", "steal", "vcpu_speeds"]
    assert load["copy_GBps"] > 0
    assert load["slowest_vcpu"] is None or 0 < load["slowest_vcpu"] <= 1
    if load["vcpu_speeds"] is not None:  # each CPU the process may use, by number; the slowest is the one above
        assert sorted(map(int, load["vcpu_speeds"])) == sorted(os.sched_getaffinity(0))
        assert min(load["vcpu_speeds"].values()) == load["slowest_vcpu"] and max(load["vcpu_speeds"].values()) == 1.0
    assert 0 <= load["steal"] <= 1 and 0 <= load["busy"] <= 1 and load["preempted_per_s"] >= 0


def test_allocator_calls_are_each_counters_growth_and_leave_out_what_one_side_lacks():
    """Growth of each counter over the timed loop; a counter an older torch does not report is left out."""
    before = {"cudaMalloc": 10, "cudaFree": 4, "retries": 0}
    after = {"cudaMalloc": 13, "cudaFree": 6, "retries": 1, "sync_all_streams": 2}
    assert run_system.allocator_calls(before, after) == {"cudaMalloc": 3, "cudaFree": 2, "retries": 1}
    assert run_system.allocator_calls(None, after) is None and run_system.allocator_counts(torch.device("cpu")) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_openmp_runtimes_name_the_one_torch_runs_its_threads_on():
    """torch's CPU build on Linux runs its intra-op threads on libgomp: after a parallel op, the runtime is
    found by its path (a file that exists), and torch's own libraries are not taken for one."""
    from bench import host_load

    torch.ones(1 << 20).add_(1)  # a parallel region: the runtime is mapped (it is from torch's import on)
    found = host_load.openmp_runtimes()
    assert found and all(os.path.isfile(p) for p in found), found
    assert not any("libtorch" in p for p in found)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to bind to")
def test_vcpu_speeds_find_the_cpu_another_process_shares():
    """A process spinning on the first CPU takes most of it from a probe run at the lowest priority (so the
    scheduler cannot hand the probe its share back within the short timing): that CPU reads slowest, the
    fastest reads 1.0, and the probe's thread may run on every CPU again after. Up to three probes: other work
    on the other CPUs (another test run beside this one) slows them as well, and a probe then reads no CPU
    slowest by far; a probe that does not bind its thread never reads one."""
    from bench.cpu_kernel import spinning_on

    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    probe = ("import json, os\nfrom bench import host_load\nos.nice(19)\nallowed = os.sched_getaffinity(0)\n"
             "speeds = host_load.vcpu_speeds(count=300_000)\n"
             "print(json.dumps({'speeds': speeds, 'restored': os.sched_getaffinity(0) == allowed}))")
    readings = []
    for _ in range(3):
        with spinning_on(first):
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                 cwd=Path(__file__).resolve().parents[1]).stdout
        got = json.loads(out)
        speeds = {int(cpu): v for cpu, v in got["speeds"].items()}
        assert set(speeds) == allowed and max(speeds.values()) == 1.0 and got["restored"]
        readings.append(speeds)
        if speeds[first] < 0.5 and speeds[first] == min(speeds.values()):
            break
    else:
        raise AssertionError(f"the CPU another process spins on never read slowest by half: {readings}")


def test_host_load_reads_the_steal_and_busy_shares_and_the_preemptions_between_two_snapshots():
    """/proc/stat's cpu line as named counters (an old kernel's shorter line padded with 0), a thread's
    involuntary switches, and between two snapshots: steal 50 of 400 jiffies, busy (user, nice, system,
    irq, softirq) 200 of 400, 30 switches in 2 s; an unreadable counter gives None, not a wrong share."""
    stat = "cpu  100 0 50 200 10 5 5 30 0 0\ncpu0 50 0 25 100 5 2 3 15 0 0\nintr 1\n"
    assert host_load.parse_cpu_line(stat) == {"user": 100, "nice": 0, "system": 50, "idle": 200, "iowait": 10,
                                              "irq": 5, "softirq": 5, "steal": 30}
    assert host_load.parse_cpu_line("cpu 1 2 3 4\n")["steal"] == 0 and host_load.parse_cpu_line("intr 1") is None
    assert host_load.parse_nonvoluntary("Name:\tpython\nvoluntary_ctxt_switches:\t9\n"
                                        "nonvoluntary_ctxt_switches:\t42\n") == 42
    before = host_load.Snapshot({"user": 0, "nice": 0, "system": 0, "idle": 0, "iowait": 0, "irq": 0,
                                 "softirq": 0, "steal": 0}, 10, at=1.0)
    after = host_load.Snapshot({"user": 150, "nice": 10, "system": 30, "idle": 140, "iowait": 10, "irq": 5,
                                "softirq": 5, "steal": 50}, 40, at=3.0)
    assert host_load.between(before, after) == {"steal": 0.125, "busy": 0.5, "preempted_per_s": 15.0}
    assert host_load.between(host_load.Snapshot(None, None, 1.0), after) == \
        {"steal": None, "busy": None, "preempted_per_s": None}
    # on this machine: real counters, shares within [0, 1]
    live = host_load.between(host_load.Snapshot.take(), host_load.Snapshot.take())
    assert all(v is None or v >= 0 for v in live.values())
    assert all(live[k] is None or live[k] <= 1 for k in ("steal", "busy"))


def test_a_clipped_run_of_ours_records_each_steps_norm_and_the_steps_the_clip_scaled():
    """Whether clipping at 1.0 applied is the difference between an update run ahead kept and one undone: the
    row says, per step, without a sync in the timed loop (the norms are read at the end)."""
    row = run_system.run("ours_offload_overlap_clip_spec_prefetch_bf16", "tiny", None, iters=2, warmup=1,
                         micro_batch=1, seq=16, device=torch.device("cpu"))
    assert row["status"] == "ok", row.get("traceback")
    norms = row["grad_norms"]
    assert len(norms) == len(row["losses"]) == len(row["history"]) and all(n > 0 for n in norms)
    assert row["clipped_steps"] == sum(n + 1e-6 > CLIP for n in norms)
    # a fresh tiny model's norms exceed 1: its updates run ahead stood down (the norm landed first over 1) or
    # were undone
    assert row["clipped_steps"] and row["run_ahead"]["undone"] + row["run_ahead"]["stood_down"]
    # per step, the counts so far: never falling, the last step's the row's (which steps undid, which stood down)
    counts = [h["run_ahead"] for h in row["history"]]
    assert counts[-1] == row["run_ahead"]
    assert counts[0]["undone"] + counts[0]["stood_down"] > 0  # the first step's own, recorded at that step
    assert all(a[k] <= b[k] for a, b in zip(counts, counts[1:]) for k in a)


def test_the_loss_reference_trains_like_ours_step_for_step():
    """The reference keeps our numerics (bf16 params, fp32 masters), so ours follows it closely; fp32 params
    under autocast (gpu_adamw) take a visibly different path on the same batch."""
    def losses(system):
        row = run_system.run(system, "tiny", None, iters=6, warmup=1, micro_batch=2, seq=32,
                             device=torch.device("cpu"))
        return row["losses"]

    ours, ref = losses("ours_cpu"), losses(REFERENCE)
    assert max(abs(a - b) / b for a, b in zip(ours, ref)) < 1e-3
    assert report.check_losses([_row(REFERENCE, losses=ref), _row("ours_cpu", losses=ours)]) == []


def test_clipped_runs_of_ours_are_checked_against_the_clipped_reference():
    """Clipping at 1.0 changes this tiny model's losses (by ~2e-4: Adam is nearly scale-free, so it acts
    through eps and the moments' history): the clipped reference follows the clipped ours far closer than the
    unclipped one does."""
    def losses(system):
        return run_system.run(system, "tiny", None, iters=6, warmup=1, micro_batch=2, seq=32,
                              device=torch.device("cpu"))["losses"]

    ours, ref, plain = losses("ours_offload_overlap_clip"), losses(REFERENCE + "_clip"), losses(REFERENCE)
    to_ref, to_plain = (max(abs(a - b) / b for a, b in zip(ours, other)) for other in (ref, plain))
    assert to_plain > 0 and to_ref < to_plain / 10
    rows = [_row(REFERENCE, losses=plain), _row(REFERENCE + "_clip", losses=ref),
            _row("ours_offload_overlap_clip", losses=ours)]
    assert report.check_losses(rows) == []


def test_a_hovering_runs_norm_keeps_about_the_clip_and_its_reference_scales_alike():
    """``_hover``: each loss scaled by a power of 2 from the last step's unscaled norm and the next aim, so the
    norm keeps about the clip (some steps over it, some under, none far off); the factors each backward took
    are in the row, the reference took the same and follows ours, and the loss check picks it. Where the
    clip scales a step its updates run ahead stand down or are undone, where it does not they are kept: the
    per-step counts change on the right steps."""
    def run(system):
        return run_system.run(system, "tiny", None, iters=4, warmup=1, micro_batch=2, seq=32,
                              device=torch.device("cpu"))

    ours, ref = run("ours_offload_overlap_clip_spec_prefetch_bf16_hover"), run(REFERENCE + "_clip_hover")
    assert ours["status"] == ref["status"] == "ok", ours.get("traceback") or ref.get("traceback")
    norms, factors = ours["grad_norms"], ours["hover_factors"]
    assert len(factors) == len(norms) and factors[0] == 1.0 and factors == ref["hover_factors"]
    assert all(math.log2(f) == round(math.log2(f)) for f in factors)  # powers of 2: exact on the gradients
    draw, (low, high) = random.Random(0), systems.HOVER_AIMS
    for k in range(len(norms) - 1):  # the next factor brings this step's unscaled norm nearest the next aim
        aim = 2.0 ** draw.uniform(math.log2(low), math.log2(high))
        assert abs(math.log2(factors[k + 1]) - math.log2(aim * factors[k] / norms[k])) <= 0.5 + 1e-3, k
    later = norms[1:]  # the first step is unscaled
    assert any(n > CLIP for n in later) and any(n < CLIP for n in later)
    assert all(low / 4 < n < high * 4 for n in later), later
    assert report.reference_of(ours["system"]) == REFERENCE + "_clip_hover"
    assert max(abs(a - b) / b for a, b in zip(ours["losses"], ref["losses"])) < 1e-5
    before = {"kept": 0, "undone": 0, "stood_down": 0}
    for n, h in zip(norms, ours["history"]):
        now = h["run_ahead"]
        if n > CLIP:
            assert now["kept"] == before["kept"]
        else:
            assert (now["undone"], now["stood_down"]) == (before["undone"], before["stood_down"])
        before = now
    assert before["kept"] and before["undone"] + before["stood_down"]
    assert report.check_losses([_row(REFERENCE + "_clip_hover", losses=ref["losses"]),
                                _row(ours["system"], losses=ours["losses"])]) == []


def test_fresh_batches_are_new_each_step_and_the_same_for_ours_and_its_reference():
    """``_fresh``: each forward gets a new batch of the given one's shape, in the vocabulary, drawn from a seeded
    generator, so two systems draw the same batches in the same order; the loss check pairs ours with the
    reference trained on them."""
    seen = {}

    def built(name):
        def build(preset, device, batch):
            return systems.Trainer(None, lambda ids: seen.setdefault(name, []).append(ids), lambda loss: None,
                                   lambda: None, 0)
        return systems.fresh_batches(build)("tiny", torch.device("cpu"), 2)

    ours, ref, ids = built("ours"), built("ref"), torch.zeros(2, 32, dtype=torch.long)
    for _ in range(3):
        ours.forward(ids)
        ref.forward(ids)
    vocab = systems.PRESETS["tiny"][2]
    assert all(torch.equal(a, b) for a, b in zip(seen["ours"], seen["ref"]))
    assert not torch.equal(seen["ours"][0], seen["ours"][1]) and not torch.equal(seen["ours"][1], seen["ours"][2])
    assert all(b.shape == ids.shape and 0 <= int(b.min()) and int(b.max()) < vocab for b in seen["ours"])
    drawn = torch.cat(seen["ours"])
    assert len(torch.unique(drawn)) > 0.8 * drawn.numel()  # uniform over 1000 ids: 192 draws, ~175 distinct
    name = "ours_offload_overlap_clip_spec_prefetch_bf16_hover_fresh"
    assert report.reference_of(name) == report.reference_of(name + "_forecast") == REFERENCE + "_clip_hover_fresh"
    row = run_system.run(name, "tiny", None, iters=3, warmup=1, micro_batch=2, seq=32, device=torch.device("cpu"))
    refrow = run_system.run(REFERENCE + "_clip_hover_fresh", "tiny", None, iters=3, warmup=1, micro_batch=2, seq=32,
                            device=torch.device("cpu"))
    assert row["status"] == refrow["status"] == "ok", row.get("traceback") or refrow.get("traceback")
    assert row["hover_factors"] == refrow["hover_factors"]
    assert max(abs(a - b) / b for a, b in zip(row["losses"], refrow["losses"])) < 1e-5
    plain = run_system.run(REFERENCE + "_clip_hover", "tiny", None, iters=3, warmup=1, micro_batch=2, seq=32,
                           device=torch.device("cpu"))  # the bench's one batch: another loss from the first step
    assert plain["losses"][0] != refrow["losses"][0]


def test_a_peer_that_is_not_installed_is_reported_not_hidden():
    try:
        import deepspeed  # noqa: F401
        pytest.skip("DeepSpeed is installed here")
    except ImportError:
        pass
    row = run_system.run("deepspeed_zero3_offload", "tiny", None, 1, 1, 1, 16, torch.device("cpu"))
    assert row["status"] == "error" and "deepspeed" in row["error"]


def test_suite_end_to_end_on_the_cpu_and_skips_what_is_done(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    args = ["--models", "tiny", "--systems", f"ours_auto,{REFERENCE}", "--iters", "2", "--warmup", "1",
            "--micro-batch", "1", "--seq", "16", "--out", str(out)]
    assert suite.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["system"] for r in rows} == {"ours_auto", REFERENCE} and all(r["status"] == "ok" for r in rows)
    assert "Every run of ours stayed within" in (tmp_path / "README.md").read_text()
    assert suite.main(args) == 0
    assert len(out.read_text().splitlines()) == 2  # nothing run twice


def _fake_runs(monkeypatch, **result) -> list[str]:
    """The suite with each run replaced by a row of ``result`` and no report: the systems started, in order."""
    started = []

    def fake_run(system, model, budget, args, timeout=None):
        started.append(system)
        return {"system": system, "model": model, "budget_gb": budget, **result}

    monkeypatch.setattr(suite, "run_one", fake_run)
    monkeypatch.setattr(report, "write_report", lambda *a: 0)
    return started


def test_suite_passes_no_phases_to_each_run(tmp_path, monkeypatch):
    """``--phases none`` (and ``peers``, for ours only) reaches each run's command line as ``--no-phases``
    (and so its row), and only when asked for."""
    commands = []

    def fake_subprocess_run(cmd, **kwargs):
        commands.append(cmd)
        row = {"status": "ok", "phases": "--no-phases" not in cmd}
        return subprocess.CompletedProcess(cmd, 0, stdout=run_system.RESULT + json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(suite.subprocess, "run", fake_subprocess_run)
    monkeypatch.setattr(report, "write_report", lambda *a: 0)
    out = tmp_path / "results.jsonl"
    suite.main(["--models", "tiny", "--systems", "ours_auto", "--out", str(out), "--phases", "none"])
    suite.main(["--models", "tiny", "--systems", "gpu_adamw", "--out", str(out)])
    suite.main(["--models", "tiny", "--systems", "ours_auto,gpu_adamw", "--out", str(out), "--again",
                "--phases", "peers"])
    assert ["--no-phases" in cmd for cmd in commands] == [True, False, True, False]
    assert [json.loads(line)["phases"] for line in out.read_text().splitlines()] == [False, True, False, True]


def test_suite_deadline_leaves_the_rest_for_the_next_call(tmp_path, monkeypatch):
    out = tmp_path / "results.jsonl"
    started = _fake_runs(monkeypatch, status="error", error="fake")
    args = ["--models", "tiny", "--systems", "ours_auto,gpu_adamw", "--out", str(out)]
    suite.main(args + ["--deadline", "-1"])
    assert started == [] and not out.exists()
    suite.main(args)
    assert started == ["ours_auto", "gpu_adamw"] and len(out.read_text().splitlines()) == 2


def test_suite_starts_no_run_its_last_recorded_wall_says_the_deadline_would_kill(tmp_path, monkeypatch):
    """A cell whose newest finished run took longer than the time left is left for the next call, and the
    shorter ones after it still run; a system of ours never run there is expected to take as long as the
    slowest of ours that ran (the H200 call 18 lost its whole command to a 5.2B step that ran past it)."""
    out = tmp_path / "results.jsonl"
    old = [{"system": s, "model": "tiny", "budget_gb": None, "status": "ok", "wall_s": w}
           for s, w in (("ours_offload", 30.0), ("gpu_adamw", 900.0), ("torchao_offload", 5.0),
                        ("ours_auto", 400.0), ("ours_auto", 2.0))]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    assert suite.expected_wall(out, "tiny", None, "ours_auto") == 2.0  # its newest run
    assert suite.expected_wall(out, "tiny", None, "ours_offload_overlap") == 30.0  # slowest of ours: 2 and 30
    assert suite.expected_wall(out, "tiny", 40.0, "gpu_adamw") is None
    started = _fake_runs(monkeypatch, status="ok", wall_s=1.0)
    suite.main(["--models", "tiny", "--systems", "gpu_adamw,ours_offload_overlap,torchao_offload", "--again",
                "--out", str(out), "--deadline", "100"])
    assert started == ["ours_offload_overlap", "torchao_offload"]


def test_suite_expects_a_run_asked_for_more_iterations_than_its_last_to_take_longer(tmp_path):
    """The last run's wall is rescaled at its median iteration to the iterations asked now: DeepSpeed's 5.2B
    run of 5 timed iterations (2 warm-up, 5 phased, 5 + 1 timed: 13 iterations at 4.5 s, 250 s) asked for 12
    is expected to take 250 + 4.5 x 14 s; free from the first step (no phases), fewer; a row without its
    command or iteration keeps its wall."""
    assert suite.iterations("-m bench.run_system --iters 5 --warmup 2 --seq 16") == 13
    assert suite.iterations("-m bench.run_system --iters 12 --warmup 2 --no-phases") == 15
    assert suite.iterations("-m bench.run_system --iters x --warmup 2") is None
    assert suite.iterations("") is None
    out = tmp_path / "results.jsonl"
    row = {"system": "deepspeed_zero3_offload", "model": "5.2b", "budget_gb": None, "status": "ok", "wall_s": 250.0,
           "iter_s": 4.5, "command": "-m bench.run_system --system deepspeed_zero3_offload --iters 5 --warmup 2"}
    out.write_text(json.dumps(row) + "\n")
    twelve = "-m bench.run_system --system deepspeed_zero3_offload --iters 12 --warmup 2"
    assert suite.expected_wall(out, "5.2b", None, "deepspeed_zero3_offload", twelve) == pytest.approx(250 + 4.5 * 14)
    assert suite.expected_wall(out, "5.2b", None, "deepspeed_zero3_offload", twelve + " --no-phases") == \
        pytest.approx(250 + 4.5 * 2)
    assert suite.expected_wall(out, "5.2b", None, "deepspeed_zero3_offload") == 250.0
    out.write_text(json.dumps({**row, "command": None}) + "\n")
    assert suite.expected_wall(out, "5.2b", None, "deepspeed_zero3_offload", twelve) == 250.0


def test_suite_times_the_peers_for_peer_iters_and_ours_for_iters():
    """``--peer-iters`` sets the peers' timed iterations apart from ours' (``--iters``); without it both
    take ``--iters``."""
    args = argparse.Namespace(iters=12, peer_iters=5, warmup=2, micro_batch=4, seq=1024, data_seed=1000,
                              phases="all")
    def iters(system: str, namespace: argparse.Namespace) -> int:
        cmd = suite.command(system, "5.2b", None, namespace)
        return int(cmd[cmd.index("--iters") + 1])

    assert iters("ours_offload_overlap_spec_prefetch_bf16", args) == 12
    assert iters("deepspeed_zero3_offload", args) == 5
    assert iters("deepspeed_zero3_offload", argparse.Namespace(**{**vars(args), "peer_iters": None})) == 12


def test_suite_kills_a_run_at_the_deadline_not_past_it(tmp_path, monkeypatch):
    """Under --deadline each run's process is killed when the time left runs out (a run that takes longer than
    its last, as with more iterations, becomes a timeout row instead of outliving the call: H200 call 144);
    without one, after --timeout."""
    timeouts = []

    def fake_subprocess_run(cmd, **kwargs):
        timeouts.append(kwargs["timeout"])
        return subprocess.CompletedProcess(cmd, 0, stdout=run_system.RESULT + json.dumps({"status": "ok"}) + "\n",
                                           stderr="")

    monkeypatch.setattr(suite.subprocess, "run", fake_subprocess_run)
    monkeypatch.setattr(report, "write_report", lambda *a: 0)
    out = tmp_path / "results.jsonl"
    suite.main(["--models", "tiny", "--systems", "gpu_adamw", "--out", str(out), "--deadline", "100"])
    suite.main(["--models", "tiny", "--systems", "gpu_adamw", "--out", str(out), "--again"])
    suite.main(["--models", "tiny", "--systems", "gpu_adamw", "--out", str(out), "--again", "--deadline", "900"])
    assert 99 < timeouts[0] <= 100 and timeouts[1:] == [280, 280]


def test_suite_rounds_alternate_the_systems_and_mark_each_row(tmp_path, monkeypatch):
    """--rounds 3 runs A B A B A B (not A A A B B B: drift between rounds would fall on one side), each row
    with its round and the call's series; --rounds 0 is refused."""
    out = tmp_path / "results.jsonl"
    started = _fake_runs(monkeypatch, status="ok", iter_s=1.0)
    suite.main(["--models", "tiny", "--systems", "ours_auto,gpu_adamw", "--rounds", "3", "--out", str(out)])
    assert started == ["ours_auto", "gpu_adamw"] * 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 1, 2, 2, 3, 3] and len({r["series"] for r in rows}) == 1
    with pytest.raises(SystemExit):
        suite.main(["--models", "tiny", "--systems", "ours_auto", "--rounds", "0", "--out", str(out)])


def test_a_system_at_a_tree_runs_that_trees_library_and_bench_with_its_own_calibration_cache(tmp_path,
                                                                                             monkeypatch):
    """``NAME@DIR`` runs DIR's ``bench.run_system`` (and so its library) for NAME, as that tree names its systems,
    with DIR first on the path and a calibration cache of its own; the row keeps the whole name and the tree's
    commit, so rounds pair it with plain NAME; a DIR without a bench is refused before anything runs."""
    tree = tmp_path / "old"
    (tree / "bench").mkdir(parents=True)
    (tree / "bench" / "__init__.py").write_text("")
    (tree / "bench" / "run_system.py").write_text(
        "import json, os, sys\n"
        "print('RESULT ' + json.dumps({'status': 'ok', 'iter_s': 1.0,"
        " 'ran': sys.argv[sys.argv.index('--system') + 1], 'here': os.getcwd(),"
        " 'cache': os.environ['DOS_CACHE_DIR'], 'first': sys.path[0]}))\n")
    (tree / "COMMIT").write_text("0123abcd\n")
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path / "cache"))
    args = argparse.Namespace(iters=1, peer_iters=None, warmup=0, micro_batch=1, seq=8, data_seed=1000,
                              phases="none", timeout=60)
    row = suite.run_one(f"ours_auto@{tree}", "tiny", None, args)
    assert row["status"] == "ok" and row["system"] == f"ours_auto@{tree}" and row["ran"] == "ours_auto"
    assert Path(row["here"]) == tree.resolve() and Path(row["first"]).resolve() == tree.resolve()
    assert row["cache"] == str(tmp_path / "cache" / "tree-old") and row["tree"] == "0123abcd"
    with pytest.raises(ValueError, match="bench/tree.sh"):
        suite.parse_systems(f"ours_auto@{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="unknown systems"):
        suite.parse_systems("no_such_system")
    assert suite.parse_systems(f"ours_auto,ours_auto@{tree}") == ["ours_auto", f"ours_auto@{tree}"]


def test_rate_fit_recovers_the_law_and_shows_a_slower_librarys_residual(tmp_path, capsys):
    """``iteration = a + b / rate`` fitted over one date's runs; another date's run 0.02 s slower at its rate
    shows that residual; rows of other systems, budgets and failures, and a row seen twice, are left out."""
    def row(date, rate, iteration, **extra):
        # 10 subgroups of 1e9 elements, none staged: rate = 10 / cpu_adam_s G elements/s
        return {"system": rate_fit.SYSTEM, "model": "1.36b", "budget_gb": None, "status": "ok", "date": date,
                "iter_s": iteration, "subgroups": 10, "params": 10e9, "wall_s": iteration * 100,
                "history": [{"staged": 0, "cpu_adam_s": 10 / rate}], **extra}

    base = [row("d1", r, 0.1 + 0.6 / r) for r in (2.0, 2.5, 3.0, 3.5)]
    new = row("d2", 3.0, 0.1 + 0.6 / 3.0 + 0.02, host_load={"steal": 0.05})
    noise = [row("d1", 3.0, 9.0, status="error"), row("d1", 3.0, 9.0, budget_gb=16.0),
             row("d1", 3.0, 9.0, system="torchao_offload")]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*base, base[0], new, *noise]) + "\n")
    assert len(rate_fit.runs([path], rate_fit.SYSTEM, "1.36b")) == 5
    a, b, sd = rate_fit.fit([(r, 0.1 + 0.6 / r) for r in (2.0, 2.5, 3.0, 3.5)])
    assert a == pytest.approx(0.1) and b == pytest.approx(0.6) and sd == pytest.approx(0, abs=1e-12)
    assert rate_fit.main([str(path), "--fit-dates", "d1", "--show-dates", "d2"]) == 0
    assert "| d2 | 3.00 | 0.320 | 0.300 | +0.020 | 5.0% |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="too few"):
        rate_fit.fit([(3.0, 0.3), (3.0, 0.31)])


def test_rounds_pair_each_system_with_the_first_in_the_same_round():
    """A round where everything ran slow moves both sides: the per-round ratio keeps the lever (B 10%
    faster in every round) where the medians of the two sides alone overlap."""
    a = [0.30, 0.40, 0.33]
    rows = [{"system": name, "model": "1.36b", "budget_gb": None, "status": "ok", "iter_s": t, "round": k + 1,
             "series": "s1"} for k, base in enumerate(a) for name, t in (("A", base), ("B", base * 0.9))]
    rows.append({**rows[0], "series": "s0", "iter_s": 9.0})  # an older series, left out
    name, chosen = rounds.series_rows(rows)
    assert name == "s1" and len(chosen) == 6
    text = rounds.summarise(chosen)
    line_b = next(line for line in text.splitlines() if line.startswith("| B |"))
    assert "x0.900" in line_b and "3 of 3" in line_b and "0.297" in line_b  # median of B: 0.9 x 0.33
    assert rounds.summarise(rounds.series_rows(rows, "s0")[1]).count("| A |") == 1
    with pytest.raises(ValueError, match="--rounds"):
        rounds.series_rows([{k: v for k, v in r.items() if k != "series"} for r in rows])
    with pytest.raises(ValueError, match="series here"):
        rounds.series_rows(rows, "nope")


def test_report_gives_a_system_run_in_rounds_the_median_of_its_rounds(tmp_path):
    """The report's row for a --rounds series is the median of its rounds, not the last round, and its other
    columns are the median round's; a row run after the series, without rounds, is the latest again."""
    results = tmp_path / "results.jsonl"
    series = [{**_row("ours_auto", iter_s=t, iter_mean_s=t + 0.01, series="s1", round=k + 1), "peak_gpu_GB": g}
              for k, (t, g) in enumerate(((0.31, 20.0), (0.30, 30.0), (0.40, 40.0)))]
    results.write_text("".join(json.dumps(r) + "\n" for r in series))
    (row,) = report.load(results)
    assert row["iter_s"] == pytest.approx(0.31) and row["rounds_iter_s"] == [0.31, 0.30, 0.40]
    assert row["peak_gpu_GB"] == 20.0 and row["round"] == 1 and row["line"] == 2  # the median round's figures
    assert row["iter_mean_s"] == pytest.approx((0.32 + 0.31 + 0.41) / 3)
    with results.open("a") as f:
        f.write(json.dumps(_row("ours_auto", iter_s=0.5)) + "\n")
    (row,) = report.load(results)
    assert row["iter_s"] == 0.5 and "rounds_iter_s" not in row


def test_walls_count_the_loss_reads_that_waited_behind_the_update(tmp_path, capsys):
    """A loss read of 0.1 s (queued behind flushes) counts, one of 0.2 ms does not; the step records are the
    medians of the last steps'; the CPU path's rate counts the subgroups neither staged nor run ahead; the
    loss gap is to the reference of the same batch, also from --references; --last reads only the file's
    last rows, --distinct shows a run once; the peers are left out."""
    def split(read: float) -> dict:
        return {"forward": 0.2, "backward": 0.1, "step": 0.02, "loss_read": read}

    steady = _row("ours_a", iter_walls_s=[0.3, 0.3, 0.3], walls_split_s=[split(0.0002)] * 3)
    history = [{"update_s": 9.0, "params_done_s": 9.0, "forward_wait_s": None, "rest_s": 0.0}] + [
        {"update_s": u, "params_done_s": u - 0.01, "forward_wait_s": 0.1, "rest_s": u / 2, "staged": 4,
         "speculated": 1, "cpu_adam_s": 0.25} for u in [0.2] * 7 + [0.3] * 5]
    racing = _row("ours_b", iter_walls_s=[0.45, 0.2, 0.3], walls_split_s=[split(0.12), split(0.0001), split(0.011)],
                  history=history, losses=[10.0, 9.0, 8.1], subgroups=10, params=1_000_000_000)
    assert walls.step_records(racing) == pytest.approx({"update_s": 0.2, "params_done_s": 0.19,
                                                        "forward_wait_s": 0.1, "rest_s": 0.1,
                                                        "idle_tail_s": None, "prefetched": None,
                                                        "backward_s": None})  # the 13th
    # left out; no fills, and no idle tail (rows before it was recorded)
    assert walls.cpu_path_rate(racing) == pytest.approx(2.0)  # 5 subgroups of 1e8 elements in 0.25 s
    assert walls.cpu_path_rate(steady) is None
    assert walls.steadiness(steady)["waited"] == 0 and walls.steadiness(steady)["walls_sd_s"] == 0
    assert walls.steadiness(racing)["waited"] == 2 and walls.steadiness(racing)["walls_sd_s"] > 0.1
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in (steady, _row("gpu_adamw"), racing)))
    references = tmp_path / "references.jsonl"
    references.write_text(json.dumps(_row(REFERENCE, losses=[10.0, 9.0, 8.0])) + "\n"
                          + json.dumps(_row(REFERENCE, losses=[10.0, 9.0, 8.0], data_seed=7)) + "\n")
    walls.main([str(results), "--references", str(references)])
    out = capsys.readouterr().out
    assert "| ours_a | 1.000 | 0 of 3 |" in out and "gpu_adamw" not in out
    assert "| ours_b | 1.000 | 2 of 3 | 0.103 | 0.200 | 0.190 | 0.100 | 0.100 | - | 0.100 | 2.00 | - | - | - " \
        "| 10.0 | - | - (-, 0.150) | 1.00% |" in out  # the loop's first step: no fills recorded
    walls.main([str(results)])
    assert "| 2.00 | - |" in capsys.readouterr().out  # no reference for its batch
    walls.main(["--last", "1", str(results)])
    assert "ours_a" not in capsys.readouterr().out
    walls.main(["--distinct", str(results), str(results)])
    assert capsys.readouterr().out.count("| ours_b |") == 1


def test_walls_split_a_clipped_runs_walls_by_what_the_clip_did(tmp_path, capsys):
    """Norms over the clip in the first timed steps: their walls are the clip's; walls of steps under it after
    two more under it are the steady ones; the two between count in neither; a spike's step, scaled after one
    under the clip, is an onset too, and the two after it are counted apart; a run without a clip has no split
    and no table."""
    norms = [7.0, 6.0, 9.0, 3.0, 2.0, 0.9, 0.5, 0.4, 0.3, 0.2]  # 3 warm-up steps, then 7 timed
    walls_s = [0.40, 0.41, 0.35, 0.34, 0.30, 0.29, 0.31]
    row = _row("ours_clip", iter_walls_s=walls_s, grad_norms=norms, clipped_steps=5,
               walls_split_s=[{"forward": 0.1, "backward": 0.1, "step": 0.02, "loss_read": 0.0}] * 7)
    assert walls.clip_split(row) == {"clipped": [0.40, 0.41], "onset": [], "after_onset": [],
                                     "steady": [0.30, 0.29, 0.31]}
    assert walls.clip_split({**row, "grad_norms": [0.5] * 10})["steady"] == walls_s  # never scaled
    spikes = [7.0, 6.0, 0.5, 0.5, 4.0, 0.9, 0.5, 0.4, 3.0, 0.2]  # scaled after one under the clip: steps 4 and 8
    assert walls.clip_split({**row, "grad_norms": spikes}) == {"clipped": [0.41, 0.29], "onset": [0.41, 0.29],
                                                             "after_onset": [0.35, 0.34, 0.31], "steady": [0.30]}
    plain = {k: v for k, v in row.items() if k != "clipped_steps"}
    assert walls.clip_split(plain) is None
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(row) + "\n")
    walls.main([str(results)])
    assert "| ours_clip | 1.36b | 1.000 | 2, 0.405 | 0, - | 0, - | 3, 0.300 | - |" in capsys.readouterr().out
    results.write_text(json.dumps(plain) + "\n")
    walls.main([str(results)])
    assert "walls of steps the clip scaled" not in capsys.readouterr().out


def test_walls_count_the_updates_run_ahead_undone_and_stood_down_by_what_the_clip_did(tmp_path, capsys):
    """Each step's record carries the run-ahead counts so far: their differences over the timed walls' steps
    (the 3 warm-up steps left out, as the walls' columns leave them), summed over the clip's onsets, its other
    scaled steps and the steps under it, say where undos and stand-downs came from (the rows' totals cannot);
    a row whose steps do not carry them has none."""
    spikes = [7.0, 6.0, 0.5, 0.5, 4.0, 1.5, 0.5, 0.4, 3.0, 0.2]  # onsets: steps 4 and 8 (from 0); 5 scaled after 4
    per_step = [(9, 0), (0, 20), (0, 0), (1, 0), (0, 25), (3, 7), (0, 0), (0, 0), (2, 23), (0, 0)]
    history, undone, stood = [], 0, 0
    for u, s in per_step:
        undone, stood = undone + u, stood + s
        history.append({"run_ahead": {"kept": 0, "undone": undone, "called_off": 0, "stood_down": stood}})
    row = _row("ours_clip", iter_walls_s=[0.3] * 7, grad_norms=spikes, clipped_steps=4, history=history)
    assert walls.run_ahead_split(row) == {"onset": (2, 48), "scaled": (3, 7), "under": (1, 0)}
    assert walls.run_ahead_split({**row, "history": [{}] * 10}) is None
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(row) + "\n")
    walls.main([str(results)])
    assert "| 2 / 48; 3 / 7; 1 / 0 |" in capsys.readouterr().out


def test_walls_show_the_gpu_allocators_new_segments_and_what_it_held(tmp_path, capsys):
    """A row with the allocator's counts shows its new segments and the reserved GB at the timed loop's start
    and end; the count is correlated with the iteration over a model's runs (here r = 1). Under expandable
    segments the count leaves out the pages mapped into one segment: not shown, not correlated."""
    def run(segments: int, iteration: float, reserved: dict | None = None) -> dict:
        return _row("ours_a", iter_s=iteration, iter_walls_s=[iteration], reserved_gpu_GB=reserved,
                    allocator_calls={"cudaMalloc": segments, "cudaFree": 0, "retries": 0},
                    walls_split_s=[{"forward": 0.1, "backward": 0.1, "step": 0.01, "loss_read": 0.0}])

    results = tmp_path / "results.jsonl"
    expandable = {**run(0, 0.5), "settings": "..., CUDA allocator expandable_segments:True, bf16 params"}
    rows = [{**run(25, 0.32, {"start": 38.14, "end": 38.92}), "peak_gpu_GB": 44.35, "gpu_need_GB": 28.47},
            run(0, 0.30), run(50, 0.34), expandable]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    walls.main([str(results)])
    out = capsys.readouterr().out
    assert "| 44.4 (28.5) | 25 (38.1 -> 38.9) |" in out and "| 0 |" in out and "| 50 |" in out
    lines = {line.split(" | ")[2]: line for line in out.splitlines() if "| ours_a |" in line}
    assert lines["0.300"].endswith("| 0 | - | - |") and lines["0.500"].endswith("| - | - | - |")  # its count not shown
    assert walls.new_segments(expandable) is None
    assert "the GPU allocator's new segments against the iteration, r = 1.00 over 3 runs" in out


def test_free_running_calls_its_hook_after_each_iterations_loss_read():
    """The hook runs once per iteration, the uncounted first one included, after that iteration's loss read
    and before the next forward (where bench.run_system reads the allocator's peak so far)."""
    events = []

    def forward() -> torch.Tensor:
        events.append("forward")
        return torch.zeros(())

    walls_s = free_running(forward, lambda loss: events.append("backward"), lambda: events.append("step"), 2,
                           lambda: events.append("hook"))[1]
    assert len(walls_s) == 2 and events == ["forward", "backward", "step", "hook"] * 3


def test_a_run_without_phases_synchronises_no_iteration_and_keeps_every_loss():
    """``phases=False``: the warm-up runs free (untimed) instead of the synchronised phases, so the row has no
    breakdown; its losses are still one per step, in order (the loss check compares them step by step)."""
    row = run_system.run("ours_offload_overlap", "tiny", None, iters=2, warmup=2, micro_batch=1, seq=16,
                         device=torch.device("cpu"), phases=False)
    assert row["status"] == "ok", row.get("traceback")
    assert row["phases"] is False and row["fwd_s"] is None and row["iter_phases_s"] is None
    assert len(row["losses"]) == 2 + (2 + 1) and len(row["iter_walls_s"]) == 2 and row["update_Gparams_per_s"] > 0
    phased = run_system.run("ours_offload_overlap", "tiny", None, iters=2, warmup=2, micro_batch=1, seq=16,
                            device=torch.device("cpu"))
    assert row["losses"] == phased["losses"][:5]  # steps 1-5 either way, the same losses


def test_walls_say_in_which_iteration_the_timed_loops_peak_came(tmp_path, capsys):
    """A row with the loop's peak so far after each iteration shows the loop's peak and the iteration it came
    in (45.1 GB in the second of 5: carried over from the synchronised phases); rows without: as before."""
    split = [{"forward": 0.1, "backward": 0.1, "step": 0.01, "loss_read": 0.0}] * 4
    row = {**_row("ours_a", iter_s=0.3, iter_walls_s=[0.3] * 4, walls_split_s=split, gpu_need_GB=28.9,
                  peak_so_far_gpu_GB=[31.0, 45.14, 45.14, 45.14, 45.14]), "peak_gpu_GB": 45.14}
    assert walls.loop_peak_came(row) == (45.14, 2, 5)
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(row) + "\n" + json.dumps({**row, "peak_so_far_gpu_GB": None}) + "\n")
    walls.main([str(results)])
    out = capsys.readouterr().out
    assert "| 45.1 (28.9); loop 45.1 in 2 of 5 |" in out and "| 45.1 (28.9) |" in out
    results.write_text(json.dumps({**row, "gpu_ours_at_need_GB": 16.24}) + "\n")
    walls.main([str(results)])
    assert "| 45.1 (28.9 + 16.2); loop 45.1 in 2 of 5 |" in capsys.readouterr().out, "what we held at that peak"


def test_walls_show_what_the_timed_loop_started_from(tmp_path, capsys):
    """The loop's first update's fills and the plan and rest learnt before it: 3 synchronised steps that
    climbed to 39 planned and a rest of 0.35 s, then a loop of 2 counted iterations (3 records) whose first
    update filled 39; a history no longer than the loop's has nothing before it."""
    split = [{"forward": 0.1, "backward": 0.1, "step": 0.01, "loss_read": 0.0}] * 2
    phases = [{"planned_staged": 24, "rest_s": 0.1, "prefetched": 0},
              {"planned_staged": 31, "rest_s": 0.2, "prefetched": 12},
              {"planned_staged": 39, "rest_s": 0.35, "prefetched": 30}]
    loop = [{"planned_staged": 19, "rest_s": 0.05, "prefetched": 39},
            {"planned_staged": 24, "rest_s": 0.12, "prefetched": 13},
            {"planned_staged": 25, "rest_s": 0.12, "prefetched": 12}]
    row = _row("ours_a", iter_s=0.3, iter_walls_s=[0.3] * 2, walls_split_s=split, history=phases + loop)
    assert walls.carried_into_loop(row) == (39, 39, 0.35)
    assert walls.carried_into_loop({**row, "history": loop}) is None
    assert walls._rest({"rest_s": 0.12, "backward_s": 0.1}) == "0.120 (0.100)"
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(row) + "\n")
    walls.main([str(results)])
    assert "| 39 (39, 0.350) |" in capsys.readouterr().out


def test_walls_relate_the_cpu_paths_rate_to_the_iteration(tmp_path, capsys):
    """Over the runs of one model, the correlation of the CPU path's rate in the update with the iteration
    (rates 2.0, 2.5 and 1.6 G elements/s, each iteration 1 - 0.2 x its rate: r = -1)."""
    def run(seconds: float, iteration: float) -> dict:
        step = {"staged": 0, "speculated": 0, "cpu_adam_s": seconds}
        return _row("ours_a", iter_s=iteration, iter_walls_s=[iteration], history=[step],
                    walls_split_s=[{"forward": 0.1, "backward": 0.1, "step": 0.01, "loss_read": 0.0}],
                    subgroups=1, params=1_000_000_000)

    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(run(s, t)) + "\n" for s, t in ((0.5, 0.6), (0.4, 0.5), (0.625, 0.68))))
    walls.main([str(results)])
    assert "1.36b: the CPU path's rate in the update against the iteration, r = -1.00 over 3 runs" in \
        capsys.readouterr().out


def test_walls_relate_the_fills_during_backward_to_backwards_host_seconds(tmp_path, capsys):
    """5, 10 and 15 subgroups filled during backward with 0.08, 0.10 and 0.12 s of it on the host, and the
    iterations 0.28, 0.30, 0.32 s: both correlations r = 1."""
    def run(filled: int, backward: float) -> dict:
        return _row("ours_a", iter_s=backward + 0.2, iter_walls_s=[backward + 0.2], history=[{"prefetched": filled}],
                    walls_split_s=[{"forward": 0.1, "backward": backward, "step": 0.1, "loss_read": 0.0}])

    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(run(f, b)) + "\n" for f, b in ((5, 0.08), (10, 0.10), (15, 0.12))))
    walls.main([str(results)])
    out = capsys.readouterr().out
    assert "1.36b: the subgroups filled during backward against backward's host seconds, r = 1.00 over 3 runs" in out
    assert "1.36b: backward's host seconds against the iteration, r = 1.00 over 3 runs" in out
    assert "1.36b: the subgroups filled during backward against the iteration, r = 1.00 over 3 runs" in out


def test_host_bytes_count_each_paths_traffic_through_host_memory(tmp_path, capsys):
    """10 subgroups of 100 elements, 4 staged and 2 of the 6 on the CPU run ahead: 4 * 100 * 24 B by the
    copies, 6 * 100 * 32 B by the bf16 CPU path (36 with torch's kernel), 2 * 100 * 12 B into the spares;
    the medians of the timed steps, not the warm-up's; a row without counts is left out."""
    from bench import host_bytes

    steps = [{"staged": 9, "speculated": 0}] * 2 + [{"staged": 4, "speculated": 2}] * 12
    row = _row("ours_a", iter_s=0.5, params=1000, subgroups=10, bf16_kernel=True, history=steps)
    out = host_bytes.host_bytes(row)
    assert (out["staged"], out["ahead"]) == (4, 2)
    assert abs(out["total_GB"] * 1e9 - (9600 + 19200 + 2400)) < 1e-6
    assert abs(out["GBps"] * 1e9 - 31200 / 0.5) < 1e-3 and abs(out["floor_s"] - 0.5 * 24000 / 31200) < 1e-12
    fp32 = host_bytes.host_bytes({**row, "bf16_kernel": False})
    assert abs(fp32["cpu_GB"] * 1e9 - 6 * 100 * 36) < 1e-6
    assert host_bytes.host_bytes(_row("ours_b")) is None
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in (row, _row("ours_b"), _row("torchao_offload"))))
    host_bytes.main([str(results)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tmp") or "ours" in line]
    assert len(lines) == 1 and "| 0.500 | 4 | 2 | 0.0 | 0.0 | 0.0 | 0.0 | 0 | 0.385 |" in lines[0]


def test_walls_show_what_the_host_gave_each_run_and_relate_it_to_the_iteration(tmp_path, capsys):
    """Rows with ``host_load`` show its steal, preemptions and copy rate, and each is correlated with the
    iteration over the runs of a model (steal 1%, 5%, 9% and 104, 120, 136 preemptions per s for 0.30, 0.32,
    0.34 s: r = 1); a row without it shows dashes and is left out of those correlations."""
    def run(steal: float | None, iteration: float) -> dict:
        extra = {} if steal is None else {"host_load": {"steal": steal, "busy": 0.9,
                                                        "preempted_per_s": 100.4 + 400 * steal,
                                                        "copy_GBps": 40.0 - 100 * steal}}
        return _row("ours_a", iter_s=iteration, iter_walls_s=[iteration],
                    walls_split_s=[{"forward": 0.1, "backward": 0.1, "step": 0.01, "loss_read": 0.0}], **extra)

    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(run(s, t)) + "\n"
                               for s, t in ((0.01, 0.30), (0.05, 0.32), (0.09, 0.34), (None, 0.5))))
    walls.main([str(results)])
    out = capsys.readouterr().out
    assert "| 5.0% | 120 | 35.0 |" in out and "| - | - | - | - |" in out
    assert "1.36b: the host's steal against the iteration, r = 1.00 over 3 runs" in out
    assert "1.36b: the host copy's GB/s against the iteration, r = -1.00 over 3 runs" in out
    assert "1.36b: the threads preempted per s against the iteration, r = 1.00 over 3 runs" in out


def test_report_lists_the_cells_of_the_grid_that_did_not_run():
    rows = [_row("ours_auto", settings="ours"), _row("gpu_adamw", budget=40, status="oom")]
    missing = report.not_run(rows)
    assert "1.36b, whole, gpu_adamw" in missing and "1.36b, 40 GB, ours_auto" in missing
    assert "1.36b, whole, ours_auto" not in missing and "1.36b, 40 GB, gpu_adamw" not in missing
    assert report.settings(rows) == "- ours_auto: ours"


def test_replaying_run7_refines_every_schedule_but_the_first():
    from bench import replay_refinement

    path = Path(__file__).parent.parent / "docs/results/2026-11-29-update-5.2b-run7.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    *out, last = replay_refinement.replay(rows)
    assert set(out[0]["factors"].values()) == {1.0} and out[0]["refined_s"] == out[0]["calibrated_s"]
    assert all(x["factors"]["cpu_engine"] > 1.1 for x in out[1:])  # the real CPU was faster than calibrated
    cpu_bound = [x for x in out if x["schedule"] in (3, 4, 6, 8)]
    assert all(abs(x["refined_error"]) < abs(x["calibrated_error"]) for x in cpu_bound)
    assert out[-1]["factors"]["link_contended"] < 1  # k=2: the link slower beside the CPU than calibrated
    assert abs(out[-1]["refined_error"]) < 0.05
    assert 0 < last["auto_now_stages"] < rows[0]["subgroups"]


def test_suite_runs_again_what_errored_but_not_what_ran_or_did_not_fit(tmp_path):
    out = tmp_path / "results.jsonl"
    rows = [_row("ours_auto"), _row("gpu_adamw", status="oom"), _row("ours_cpu", status="error")]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert suite.done(out) == {("1.36b", None, "ours_auto"), ("1.36b", None, "gpu_adamw")}


def test_a_distributed_run_is_estimated_from_its_newest_finished_row(capsys, monkeypatch, tmp_path):
    """dist_call.sh starts no run its deadline would kill: the newest finished row of the same system, model
    and rank count gives setup + every iteration at the slower of its two timings + a fixed cost."""
    rows = [{"system": "deepspeed", "model": "10b", "ranks": 2, "status": "ok", "setup_s": 90.0, "iter_s": 6.0,
             "iter_phases_s": 5.0},
            {"system": "deepspeed", "model": "10b", "ranks": 2, "status": "ok", "setup_s": 75.0, "iter_s": 7.5,
             "iter_phases_s": 7.0},
            {"system": "deepspeed", "model": "10b", "ranks": 2, "status": "no result (rc 124)"},
            {"system": "deepspeed", "model": "10b", "ranks": 1, "status": "ok", "setup_s": 10.0, "iter_s": 1.0}]
    seconds = dist_estimate.estimate(rows, "deepspeed", "10b", 2, warmup=1, iters=3)
    assert seconds == 75.0 + (1 + 2 * 3 + 1) * 7.5 + dist_estimate.OVERHEAD_S
    assert dist_estimate.estimate(rows, "deepspeed", "10b", 2, 1, 3, sweep=2) == seconds + 2 * 3 * 7.5
    assert dist_estimate.estimate(rows, "deepspeed", "5.2b", 2, 1, 3) is None
    recorded = tmp_path / "rows.jsonl"
    recorded.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(dist_estimate, "ROWS", recorded)
    dist_estimate.main(["no_such_system", "10b", "2", "1", "5"])
    assert capsys.readouterr().out.strip() == "0", "unknown: the script starts it"
    dist_estimate.main(["deepspeed", "10b", "2", "1", "3", "cpu,gpu"])  # the sweep as dist_call.sh passes it
    assert int(capsys.readouterr().out) == round(seconds + 2 * 3 * 7.5)


def test_a_new_variant_of_ours_is_estimated_from_the_slowest_variant_that_ran():
    """A variant of ours never run (a new option) is not started blind: it gets the slowest estimate of the
    variants recorded at that model and rank count; ours_auto (states on the GPU) and the peers do not count."""
    rows = [{"system": "ours_overlap", "model": "10b", "ranks": 2, "status": "ok", "setup_s": 40.0, "iter_s": 2.0},
            {"system": "ours_spec", "model": "10b", "ranks": 2, "status": "ok", "setup_s": 30.0, "iter_s": 3.0},
            {"system": "ours_auto", "model": "10b", "ranks": 2, "status": "ok", "setup_s": 99.0, "iter_s": 9.0},
            {"system": "deepspeed", "model": "10b", "ranks": 2, "status": "ok", "setup_s": 99.0, "iter_s": 9.0},
            {"system": "ours_spec", "model": "10b", "ranks": 1, "status": "ok", "setup_s": 99.0, "iter_s": 9.0}]
    iterations = 1 + 2 * 5 + 1
    expected = max(40.0 + iterations * 2.0, 30.0 + iterations * 3.0) + dist_estimate.OVERHEAD_S
    assert dist_estimate.estimate(rows, "ours_spec32", "10b", 2, warmup=1, iters=5) == expected
    assert dist_estimate.estimate(rows, "ours_overlap", "10b", 2, 1, 5) == 40.0 + iterations * 2.0 + \
        dist_estimate.OVERHEAD_S, "a variant that ran is estimated from its own row"
    assert dist_estimate.estimate(rows, "ours_spec32", "5.2b", 2, 1, 5) is None
    assert dist_estimate.estimate(rows, "fsdp2_offload", "10b", 2, 1, 5) is None


@needs_compiler
def test_the_kernel_benchmark_times_both_kernels_in_turns_and_says_when_dma_cannot_run(capsys):
    from bench import cpu_kernel

    assert cpu_kernel.main(["--numel", "4096", "--threads", "1"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["equal_bit_for_bit"] and row["threads"] == 1
    assert all(row[f"{name}_G_per_s"] > 0 for name in ("torch_fp32_grads", "ours_bf16_grads",
                                                        "ours_bf16_grads_clip_bf16_params",
                                                        "ours_bf16_grads_clip_bf16_params_plain_stores",
                                                        "ours_bf16_grads_clip_bf16_params_fixed_shares"))
    if not torch.cuda.is_available():
        assert cpu_kernel.main(["--numel", "4096", "--dma"]) == 1
        assert "needs a GPU" in capsys.readouterr().out


@needs_compiler
@pytest.mark.parametrize("suffix, build", [("plainstores", "dos_plain_stores"), ("fixedshares", "dos_fixed_shares")])
def test_a_kernel_build_variant_of_ours_runs_that_build_in_the_librarys_form(suffix, build):
    """The A/B systems for the kernel's builds (plain stores, fixed shares per thread): same kernel form, the
    other build; it trains."""
    from bench.systems import SYSTEMS

    name = f"ours_offload_overlap_spec_prefetch_bf16_{suffix}"
    trainer = SYSTEMS[name]("tiny", torch.device("cpu"), 1)
    engine = trainer.optimizer.engine
    assert engine.bf16_kernel is not None and engine.bf16_kernel.variant == cpu_adamw.load().variant
    assert build in engine.bf16_kernel._module.__name__
    row = run_system.run(name, "tiny", None, iters=2, warmup=1,
                         micro_batch=1, seq=16, device=torch.device("cpu"))
    assert row["status"] == "ok", row.get("traceback")
    assert row["losses"][-1] < row["losses"][0]


@needs_compiler
def test_the_release_variant_of_ours_releases_the_slots_filled_ahead_at_their_flush():
    """`_release` builds the defaults with ``prefetch="release"``, says so in the row's settings, and trains;
    the defaults hold the slots filled ahead until the update's end."""
    from bench.systems import SYSTEMS

    plain = SYSTEMS["ours_offload_overlap_spec_prefetch_bf16"]("tiny", torch.device("cpu"), 1)
    assert not plain.optimizer.engine.release_at_flush and "released at their flush" not in plain.settings
    assert "prefetch=True" in plain.settings
    trainer = SYSTEMS["ours_offload_overlap_spec_prefetch_bf16_release"]("tiny", torch.device("cpu"), 1)
    assert trainer.optimizer.engine.release_at_flush
    assert "prefetch='release'" in trainer.settings and "slots filled ahead released at their flush" in trainer.settings
    row = run_system.run("ours_offload_overlap_spec_prefetch_bf16_release", "tiny", None, iters=2, warmup=1,
                         micro_batch=1, seq=16, device=torch.device("cpu"))
    assert row["status"] == "ok", row.get("traceback")
    assert row["losses"][-1] < row["losses"][0]


def test_the_defaults_bound_the_fills_by_backwards_span_and_restfills_does_not(monkeypatch):
    """The defaults (and `_bwdfills`, their name in calls 146-150) keep ``plan.FILLS_WITHIN_BACKWARD`` on and
    say so in the row's settings; `_restfills` turns it off for its process (the library before); either way
    the steps record the backward span the planner learnt, and it trains."""
    from bench.systems import SYSTEMS
    from deep_optimizer_states.planning import plan as plan_module

    monkeypatch.setattr(plan_module, "FILLS_WITHIN_BACKWARD", plan_module.FILLS_WITHIN_BACKWARD)  # restored after
    assert plan_module.FILLS_WITHIN_BACKWARD  # the library's default
    before = SYSTEMS["ours_offload_overlap_spec_prefetch_bf16_restfills"]("tiny", torch.device("cpu"), 1)
    assert not plan_module.FILLS_WITHIN_BACKWARD and "backward's span" not in before.settings
    monkeypatch.setattr(plan_module, "FILLS_WITHIN_BACKWARD", True)
    plain = SYSTEMS["ours_offload_overlap_spec_prefetch_bf16"]("tiny", torch.device("cpu"), 1)
    assert "fills ahead within what backward's span carries" in plain.settings
    monkeypatch.setattr(plan_module, "FILLS_WITHIN_BACKWARD", False)
    name = "ours_offload_overlap_spec_prefetch_bf16_bwdfills"
    trainer = SYSTEMS[name]("tiny", torch.device("cpu"), 1)
    assert plan_module.FILLS_WITHIN_BACKWARD and "fills ahead within what backward's span carries" in trainer.settings
    row = run_system.run(name, "tiny", None, iters=2, warmup=1, micro_batch=1, seq=16, device=torch.device("cpu"))
    assert row["status"] == "ok", row.get("traceback")
    assert row["losses"][-1] < row["losses"][0]
    assert all(step["backward_s"] is not None and step["backward_s"] >= 0 for step in row["history"])


@pytest.mark.parametrize("variant,setting", [("expandable", "expandable_segments:True"),
                                             ("maxsplit", "max_split_size_mb:256")])
def test_an_allocator_variant_of_ours_says_its_setting_and_sets_it_only_on_a_gpu(variant, setting, monkeypatch):
    """An allocator variant names its CUDA allocator setting in the row's settings; without a GPU it leaves the
    allocator alone (there is none) and trains as the defaults do."""
    from bench.systems import SYSTEMS

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    name = f"ours_offload_overlap_spec_prefetch_bf16_{variant}"
    trainer = SYSTEMS[name]("tiny", torch.device("cpu"), 1)
    assert f"CUDA allocator {setting}" in trainer.settings and calls == []
    row = run_system.run(name, "tiny", None, iters=2, warmup=1, micro_batch=1, seq=16, device=torch.device("cpu"))
    assert row["status"] == "ok", row.get("traceback")


def test_a_run_out_of_memory_says_how_far_it_got_and_what_the_optimizer_held(monkeypatch):
    """An OOM row keeps where the run stood (``oom_state``): the loss reads before the timed loop and, for ours,
    the optimizer's budget view and its last update; an error that is not an OOM gets none."""
    import dataclasses

    from bench.systems import SYSTEMS

    name = "ours_offload_overlap_spec_prefetch_bf16"

    def failing(message: str, after: int):
        def build(preset, device, batch):
            trainer = SYSTEMS[name](preset, device, batch)
            calls = []

            def backward(loss):
                calls.append(1)
                if len(calls) > after:
                    raise RuntimeError(message)
                trainer.backward(loss)
            return dataclasses.replace(trainer, backward=backward)
        return build

    monkeypatch.setitem(run_system.SYSTEMS, "failing_oom", failing("CUDA out of memory. Tried to allocate 500 MiB", 3))
    monkeypatch.setitem(run_system.SYSTEMS, "failing_other", failing("boom", 3))
    row = run_system.run("failing_oom", "tiny", None, iters=2, warmup=2, micro_batch=1, seq=16,
                         device=torch.device("cpu"))
    assert row["status"] == "oom"
    state = row["oom_state"]
    assert state["losses_read"] == 3 and state["loop_iterations"] == 0  # 2 warm-up and 1 phased step, no loop
    assert "allocated_GB" not in state  # no GPU: no allocator to read
    assert state["budget_GB"] is None and state["need_GB"] is None  # no GPU memory budget on the CPU
    assert state["ours_at_need_GB"] is None and state["slots_planned"] >= 1
    assert state["last_update"]["staged"] >= 0 and state["resident_GB"] == 0
    other = run_system.run("failing_other", "tiny", None, iters=2, warmup=2, micro_batch=1, seq=16,
                           device=torch.device("cpu"))
    assert other["status"] == "error" and "oom_state" not in other
    free = run_system.run("failing_oom", "tiny", None, iters=2, warmup=5, micro_batch=1, seq=16,
                          device=torch.device("cpu"), phases=False)  # a warm-up run as the loop runs, cut short
    assert free["status"] == "oom" and free["oom_state"]["losses_read"] == 3


def test_the_checkpointing_variant_of_the_defaults_turns_it_on_and_trains():
    """`_ckpt` is the defaults with the model's activation checkpointing (for budgets below what forward and
    backward need without it): the model says so, the row's settings too, and it trains as the defaults do."""
    from bench.systems import SYSTEMS

    name = "ours_offload_overlap_spec_prefetch_bf16_ckpt"
    trainer = SYSTEMS[name]("tiny", torch.device("cpu"), 1)
    assert checkpoints_activations(trainer.model) and "activation checkpointing" in trainer.settings
    plain = SYSTEMS["ours_offload_overlap_spec_prefetch_bf16"]("tiny", torch.device("cpu"), 1)
    assert not checkpoints_activations(plain.model)
    row = run_system.run(name, "tiny", None, iters=2, warmup=1, micro_batch=1, seq=16, device=torch.device("cpu"))
    assert row["status"] == "ok", row.get("traceback")
    assert row["losses"][-1] < row["losses"][0]


def test_trace_loop_names_the_lanes_and_finds_the_copies_that_waited():
    """bench/trace_loop.py's analysis of a hand-written trace: the marker copies name the streams, each
    iteration counts its streams' busy time and bytes, and a copy that started long after its enqueue call
    shows in the copy waits (the 150 ms loss read of H200 call 35)."""
    from bench import trace_loop

    def copy(stream, ts, dur, nbytes, corr, way="DtoH (Device -> Pinned)"):
        return {"cat": "gpu_memcpy", "name": f"Memcpy {way}", "ts": ts, "dur": dur,
                "args": {"stream": stream, "bytes": nbytes, "correlation": corr}}

    def call(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": ts, "dur": 1, "args": {"correlation": corr}}

    events = [copy(29, 0, 1, 4, 1), copy(7, 2, 1, 8, 2),  # the markers: lane k copies 4 * (k + 1) bytes
              {"cat": "user_annotation", "name": trace_loop.MARK, "ts": 10, "dur": 5},
              {"cat": "user_annotation", "name": trace_loop.MARK, "ts": 1010, "dur": 5},
              {"cat": "user_annotation", "name": trace_loop.MARK, "ts": 2010, "dur": 5},
              call(100, 10), copy(29, 101, 400, 10**9, 10),  # a flush, started at once
              call(102, 11), copy(29, 501, 400, 10**9, 11),  # another, behind the first
              call(110, 12), copy(7, 901, 1, 4, 12),  # the loss read, behind both
              call(1100, 13), copy(7, 1101, 1, 4, 13),
              call(1200, 14), copy(7, 1201, 1, 4, 14)]
    out = trace_loop.analyze(events, ["lane.stage_out", "default"])
    assert out["lanes"] == {"29": "lane.stage_out", "7": "default"}
    first, second = out["iterations"]
    assert first["wall_ms"] == 1.0 and first["streams"]["lane.stage_out"]["busy_ms"] == 0.8
    assert first["streams"]["lane.stage_out"]["d2h"] == 2.0 and "lane.stage_out" not in second["streams"]
    assert first["link_busy_ms"] == {"d2h": 0.8}  # 101-902 us: the two flushes and the loss read, one engine
    assert second["link_busy_ms"] == {"d2h": 0.0}  # two 1 us copies, under the 0.1 ms rounding
    waits = out["copy_waits"]
    assert waits["lane.stage_out d2h"]["max_ms"] == 0.4 and waits["default d2h"]["max_ms"] == 0.79
    assert waits["default d2h"]["median_ms"] == 0.0 and waits["default d2h"]["copies"] == 3


def test_spiked_systems_scale_the_loss_on_every_nth_backward_and_meet_their_own_reference(monkeypatch):
    """`_spikes` scales the loss by ``SPIKE`` in every ``SPIKE_EVERY``-th backward, counted from the first, for
    ours and its reference alike; `_nostanddown` turns ``optimizer.STAND_DOWN`` off for its process and says so,
    `_forecast` sets it to "forecast" and runs updates ahead after a clip too; the loss check holds a spiked run
    of ours to the spiked reference, and it passes."""
    from bench.systems import SPIKE, SPIKE_EVERY, SYSTEMS, Trainer, spiked
    import deep_optimizer_states.optimizer as optimizer_module

    seen = []
    fake = spiked(lambda preset, device, batch: Trainer(None, None, lambda loss: seen.append(float(loss)), None, 0,
                                                          settings="fake"), 3)("tiny", torch.device("cpu"), 1)
    for _ in range(6):
        fake.backward(torch.tensor(1.5))
    assert seen == [1.5, 1.5, 1.5 * SPIKE, 1.5, 1.5, 1.5 * SPIKE] and fake.settings.endswith(
        f"the loss x{SPIKE:g} in one backward of every 3")

    name = "ours_offload_overlap_clip_spec_prefetch_bf16_spikes"
    monkeypatch.setattr(optimizer_module, "STAND_DOWN", optimizer_module.STAND_DOWN)  # restored after
    assert optimizer_module.STAND_DOWN  # the library's default
    off = SYSTEMS[name + "_nostanddown"]("tiny", torch.device("cpu"), 1)
    assert not optimizer_module.STAND_DOWN and "updates run ahead never stand down" in off.settings
    monkeypatch.setattr(optimizer_module, "SIT_OUT_AFTER_CLIP", optimizer_module.SIT_OUT_AFTER_CLIP)
    forecast = SYSTEMS[name + "_forecast"]("tiny", torch.device("cpu"), 1)
    assert optimizer_module.STAND_DOWN == "forecast" and optimizer_module.SIT_OUT_AFTER_CLIP is False
    assert "by a forecast of the clip" in forecast.settings and "after a clipped step too" in forecast.settings
    monkeypatch.setattr(optimizer_module, "STAND_DOWN", True)
    monkeypatch.setattr(optimizer_module, "SIT_OUT_AFTER_CLIP", True)
    assert report.reference_of(name + "_nostanddown") == REFERENCE + "_clip_spikes"
    rows = [run_system.run(system, "tiny", None, iters=SPIKE_EVERY, warmup=1, micro_batch=1, seq=16,
                           device=torch.device("cpu")) for system in (name, REFERENCE + "_clip_spikes")]
    assert all(row["status"] == "ok" for row in rows), [row.get("traceback") for row in rows]
    assert "updates run ahead never stand down" not in rows[0]["settings"]
    assert report.check_losses(rows) == [] and "loss_vs_reference" in rows[0]
