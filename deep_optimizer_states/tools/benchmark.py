"""The update-phase benchmark: gradients ready -> ``opt.step()`` -> every param updated, per schedule.

Each measured step runs on fresh random gradients, and one step per schedule is checked against torch's
fused AdamW run on the GPU over copies of a CPU-placed and a staged subgroup: fast and wrong is no result.
The schedules take turns (round-robin), so that a machine whose speed drifts moves them all alike, and each
is predicted by rates that never saw its own updates (leave-one-schedule-out).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..core.adam import AdamHyper, adam_update
from ..core.engine import UpdateStats
from ..core.host_memory import available_host_bytes
from ..core.layout import HOST_BYTES_PER_ELEMENT
from ..core.ranks import use_cpu_threads
from ..core.schedule import Placement, Schedule
from ..optimizer import DeepOptimizerStates
from ..planning.calibrate import calibrated_rates
from ..planning.perfmodel import Rates, lower_bound, predict
from ..planning.refine import Refiner
from .models import PRESETS, llama


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh_grads(opt: DeepOptimizerStates) -> None:
    for b in opt.layout.buckets:
        for p in b.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.normal_(0.0, 1e-3)


def expected_master(opt: DeepOptimizerStates, index: int, compute: torch.device) -> torch.Tensor:
    """What torch's fused AdamW on ``compute`` makes of subgroup ``index``'s master, from its state now."""
    sg = opt.layout.subgroups[index]
    p, m, v = (t.to(compute, torch.float32, copy=True) for t in (sg.master, sg.exp_avg, sg.exp_avg_sq))
    g = torch.empty(sg.numel, dtype=torch.float32, device=compute)
    sg.gather_grads(g)
    group = opt.param_groups[sg.group_index]
    adam_update(p, g, m, v, sg.bucket.steps[sg.pieces[0].i], AdamHyper.from_group(group, opt.adamw))
    return p


SMALLEST_SUBGROUP = 64  # elements: the default subgroup size never goes below this


def preset_params(preset: str) -> int:
    """Parameter count of a benchmark model (``models.PRESETS``), without building it."""
    hidden, layers, vocab = PRESETS[preset]
    inter = int(hidden * 2.75) // 256 * 256
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + hidden


def default_model(device: torch.device, host_bytes: int | None = None, gpu_bytes: int | None = None) -> str:
    """The benchmark model that suits this machine: "tiny" without a GPU (the update then runs on the CPU
    alone, and a 1.36B model takes minutes per schedule there); on a GPU the largest of 1.36b and 0.5b whose
    host states (16 B/param) fit in 80% of the free host memory and whose bf16 params and grads (4 B/param)
    plus 4 GB of headroom fit the GPU, else "tiny"."""
    if device.type != "cuda":
        return "tiny"
    if host_bytes is None:
        host_bytes = available_host_bytes()
    if gpu_bytes is None:
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    for preset in ("1.36b", "0.5b"):
        n = preset_params(preset)
        if (host_bytes is None or HOST_BYTES_PER_ELEMENT * n <= 0.8 * host_bytes) and 4 * n + 4e9 <= gpu_bytes:
            return preset
    return "tiny"


def probe_subgroups(opt: DeepOptimizerStates) -> list[int]:
    places = opt.placements
    return [places.index(kind) for kind in (Placement.CPU, Placement.STAGED) if kind in places]


@dataclass
class Record:
    """One update of the benchmark: what ran, what it showed, and whether it counts towards the medians."""

    schedule: Schedule
    places: list[Placement]
    slots: int
    stats: UpdateStats
    seconds: float
    timed: bool
    peak_gpu_bytes: int = 0


def update_phase(preset: str | None = "1.36b",
                 schedules: Sequence[Schedule] = ("cpu", 1, 2, 3, 4, 5, 6, 7, 8, "auto"),
                 subgroup_size: int | None = 25_000_000, warmup: int = 2, iters: int = 7, device: str | None = None,
                 out: str | None = None, probes: int = 3) -> list[dict]:
    """Time the update phase for each schedule; returns one result row per schedule (also as JSON lines).
    ``preset=None`` takes ``default_model`` for the device; ``subgroup_size=None`` an eighth of the model,
    at most 25M elements.

    The schedules take turns, one update each per round (``warmup`` untimed rounds, then ``iters`` timed),
    so a machine that drifts moves every schedule alike. ``probes`` untimed "auto" updates run first, as a
    training run's first steps would. Each schedule is predicted twice: from calibration alone, and from
    the calibrated rates refined on every *other* schedule's updates (never its own)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = preset or default_model(dev)
    opt, header = _setup(preset, subgroup_size, dev)
    header.update(probe_updates=probes, rounds=f"{warmup} warm-up + {iters} timed, schedules in turn",
                  prediction_basis="refined on the other schedules' updates")
    records, errors = _run(opt, ["auto"] * probes, timed=False)
    for round_ in range(warmup + iters):
        done, checked = _run(opt, schedules, timed=round_ >= warmup, check=round_ == warmup)
        records += done
        errors.update(checked)
    rows = [{**header, **summarise(opt, s, records, Rates(**header["rates"]), errors.get(str(s)))}
            for s in schedules]
    for row in rows:
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    for row in rows:
        if row["max_rel_err_vs_torch"] is not None and row["max_rel_err_vs_torch"] > 1e-6:
            raise AssertionError(f"schedule {row['schedule']}: differs from torch's fused AdamW by "
                                 f"{row['max_rel_err_vs_torch']:.2e}")
    return rows


def _setup(preset: str, subgroup_size: int | None, dev: torch.device) -> tuple[DeepOptimizerStates, dict]:
    """Calibrate (on the threads the optimizer will run), build the model and the optimizer (timed), and run
    one real backward."""
    use_cpu_threads(None, dev)
    t0 = time.perf_counter()
    rates = calibrated_rates(dev, force=True, log=print)
    calibrate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = llama(preset, torch.bfloat16, dev)
    _sync(dev)
    model_s = time.perf_counter() - t0
    if subgroup_size is None:
        numel = sum(p.numel() for p in model.parameters())
        subgroup_size = max(SMALLEST_SUBGROUP, min(25_000_000, -(-numel // 8)))
    t0 = time.perf_counter()
    opt = DeepOptimizerStates(model, lr=1e-4, weight_decay=0.01, subgroup_size=subgroup_size, schedule="cpu")
    _sync(dev)
    startup_s = time.perf_counter() - t0
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device=dev)
    model(input_ids=ids, labels=ids).loss.backward()  # one real backward: the grads land in our buffers
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.ndim > 1)
    numel = sum(p.numel() for p in model.parameters())
    bound_s, bound_f = lower_bound(numel, rates)
    header = {"model": preset, "params": numel, "subgroups": len(opt.layout.subgroups), "device": str(dev),
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "calibrate_s": round(calibrate_s, 2), "rates": rates.as_dict(),
              "lower_bound_s": round(bound_s, 4), "lower_bound_staged_fraction": bound_f,
              "model_build_s": round(model_s, 2), "startup_s": round(startup_s, 2),
              "pinned_host_GB": round(opt.layout.numel * HOST_BYTES_PER_ELEMENT / 1e9, 2),
              "pinned": dev.type == "cuda" and opt.layout.buckets[0].master.is_pinned()}
    print(json.dumps(header), flush=True)
    return opt, header


def _run(opt: DeepOptimizerStates, schedules: Sequence[Schedule], timed: bool,
         check: bool = False) -> tuple[list[Record], dict[str, float]]:
    """One update per schedule on fresh gradients, each timed with a device synchronize around it;
    with ``check``, a CPU-placed and a staged subgroup are compared with torch's fused AdamW."""
    dev = opt.device
    records, errors = [], {}
    for schedule in schedules:
        opt.schedule = schedule
        _fresh_grads(opt)
        expected = {i: expected_master(opt, i, dev) for i in (probe_subgroups(opt) if check else [])}
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        _sync(dev)
        t0 = time.perf_counter()
        opt.step()
        _sync(dev)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        records.append(Record(schedule, opt.placements, max(opt.plan.slots, 1), opt.last_update, seconds,
                              timed, peak))
        if expected:
            errors[str(schedule)] = max(((opt.layout.subgroups[i].master.to(dev) - want).norm()
                                         / want.norm()).item() for i, want in expected.items())
    return records, errors


def refined_without(schedule: Schedule, records: Sequence[Record], sizes: Sequence[int],
                    calibrated: Rates) -> Refiner:
    """The optimizer's refinement replayed on every update but ``schedule``'s own (the first update of the
    run skipped, as the optimizer does): what the other schedules taught the model."""
    refiner = Refiner()
    for rec in records[1:]:
        if rec.schedule != schedule:
            refiner.learn(sizes, rec.places, rec.slots, calibrated, rec.stats)
    return refiner


def summarise(opt: DeepOptimizerStates, schedule: Schedule, records: Sequence[Record], calibrated: Rates,
              max_rel_err: float | None) -> dict:
    """One schedule's row: medians of its timed updates beside the two predictions of them."""
    sizes = [sg.numel for sg in opt.layout.subgroups]
    mine = [r for r in records if r.schedule == schedule and r.timed]
    refiner = refined_without(schedule, records, sizes, calibrated)
    refined_rates = refiner.apply(calibrated)
    times = [r.seconds for r in mine]
    mid = statistics.median(times)

    def priced(rates: Rates) -> float:  # each update priced for the placement it ran ("auto" may re-plan)
        return statistics.median(predict(sizes, r.places, rates, r.slots).seconds for r in mine)

    pred_s, cal_s = priced(refined_rates), priced(calibrated)
    last = mine[-1]
    pred = predict(sizes, last.places, refined_rates, last.slots)
    stats = [r.stats for r in mine]
    staged = [s.staged_subgroups for s in stats]
    return {"schedule": schedule, "staged": statistics.median_low(staged), "staged_counts": sorted(set(staged)),
            "staged_predicted": pred.staged,
            "update_s": round(mid, 4), "predicted_s": round(pred_s, 4),
            "prediction_error": round(pred_s / mid - 1, 4),
            "factors": {k: round(v, 4) for k, v in refiner.factors().items()},
            "staged_window_s": round(statistics.median(s.staged_window_s for s in stats), 4),
            "predicted_calibrated_s": round(cal_s, 4),
            "calibrated_error": round(cal_s / mid - 1, 4),
            "bottleneck": pred.bottleneck, "min_s": round(min(times), 4),
            "Gparams_per_s": round(sum(sizes) / mid / 1e9, 3),
            "cpu_adam_s": round(statistics.median(s.cpu_adam_seconds for s in stats), 4),
            "h2d_GB": round(stats[0].h2d_bytes / 1e9, 2), "d2h_GB": round(stats[0].d2h_bytes / 1e9, 2),
            "peak_gpu_GB": round(max(r.peak_gpu_bytes for r in mine) / 1e9, 2),
            "lanes_s": {k: round(statistics.median(s.lane_seconds[k] for s in stats), 4)
                        for k in stats[0].lane_seconds},
            "max_rel_err_vs_torch": max_rel_err, "times": [round(t, 4) for t in times]}


def table(rows: list[dict]) -> str:
    """A markdown table of update-phase rows, measured beside predicted."""
    lines = ["| schedule | staged | update s (median) | predicted s, refined on the other schedules | error "
             "| predicted s, calibration only "
             "| error | G params/s | model's bottleneck | CPU AdamW s | H2D GB | D2H GB | peak GPU GB "
             "| max rel. err vs torch |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['max_rel_err_vs_torch']:.1e}" if r["max_rel_err_vs_torch"] is not None else "-"
        if "predicted_calibrated_s" in r:
            refined = f"{r['predicted_s']:.3f} | {r['prediction_error']:+.1%}"
            cal, cal_err = r["predicted_calibrated_s"], r["calibrated_error"]
        else:  # runs from before the refinement: their prediction came from calibration alone
            refined, cal, cal_err = "- | -", r["predicted_s"], r["prediction_error"]
        counts = r.get("staged_counts", [r["staged"]])
        staged = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else r["staged"]
        lines.append(f"| {r['schedule']} | {staged}/{r['subgroups']} | {r['update_s']:.3f} | {refined} | "
                     f"{cal:.3f} | {cal_err:+.1%} | {r['Gparams_per_s']:.2f} | "
                     f"{r['bottleneck']} | {r['cpu_adam_s']:.3f} | {r['h2d_GB']} | {r['d2h_GB']} | "
                     f"{r['peak_gpu_GB']} | {err} |")
    return "\n".join(lines)
