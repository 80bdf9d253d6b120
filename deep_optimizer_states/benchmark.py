"""The update-phase benchmark: gradients ready -> ``opt.step()`` -> every param updated, per schedule.

Each measured step runs on fresh random gradients, and one step per schedule is checked against torch's
fused AdamW run on the GPU over copies of a CPU-placed and a staged subgroup: fast and wrong is no result.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Sequence

import torch

from .adam import AdamHyper, adam_update
from .calibrate import calibrated_rates
from .layout import HOST_BYTES_PER_ELEMENT
from .models import llama
from .optimizer import DeepOptimizerStates
from .perfmodel import Rates, lower_bound, predict
from .schedule import Placement, Schedule


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh_grads(opt: DeepOptimizerStates) -> None:
    for b in opt.layout.buckets:
        b.grad_flat.normal_(0.0, 1e-3)


def expected_master(opt: DeepOptimizerStates, index: int, compute: torch.device) -> torch.Tensor:
    """What torch's fused AdamW on ``compute`` makes of subgroup ``index``'s master, from its state now."""
    sg = opt.layout.subgroups[index]
    p, g, m, v = (t.to(compute, torch.float32, copy=True) for t in (sg.master, sg.grad, sg.exp_avg, sg.exp_avg_sq))
    group = opt.param_groups[sg.group_index]
    adam_update(p, g, m, v, opt._steps[sg.group_index], AdamHyper.from_group(group, opt.adamw))
    return p


def probe_subgroups(opt: DeepOptimizerStates) -> list[int]:
    places = opt.placements
    return [places.index(kind) for kind in (Placement.CPU, Placement.STAGED) if kind in places]


def update_phase(preset: str = "1.36b", schedules: Sequence[Schedule] = ("cpu", 1, 2, 3, 4, 5, 6, 7, 8, "auto"),
                 subgroup_size: int = 25_000_000, warmup: int = 2, iters: int = 5, device: str | None = None,
                 out: str | None = None, probes: int = 3) -> list[dict]:
    """Time the update phase for each schedule; returns one result row per schedule (also as JSON lines).

    ``probes`` untimed "auto" updates run first, as a training run's first steps would: the optimizer
    refines its rates from them, so the first schedule is not predicted from calibration alone."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    opt, header = _setup(preset, subgroup_size, dev)
    _probe(opt, probes)
    header["probe_updates"] = probes
    rows = []
    for schedule in schedules:
        row = {**header, **_measure(opt, schedule, warmup, iters, header["rates"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if row["max_rel_err_vs_torch"] is not None and row["max_rel_err_vs_torch"] > 1e-6:
            raise AssertionError(f"schedule {schedule}: differs from torch's fused AdamW by "
                                 f"{row['max_rel_err_vs_torch']:.2e}")
    if out:
        with open(out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


def _setup(preset: str, subgroup_size: int, dev: torch.device) -> tuple[DeepOptimizerStates, dict]:
    """Calibrate, build the model and the optimizer (timed), and run one real backward."""
    t0 = time.perf_counter()
    rates = calibrated_rates(dev, force=True, log=print)
    calibrate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = llama(preset, torch.bfloat16, dev)
    _sync(dev)
    model_s = time.perf_counter() - t0
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


def _probe(opt: DeepOptimizerStates, updates: int) -> None:
    """Untimed "auto" updates on fresh gradients, whose telemetry the optimizer learns from."""
    opt.schedule = "auto"
    for _ in range(updates):
        _fresh_grads(opt)
        opt.step()
    _sync(opt.device)


def _measure(opt: DeepOptimizerStates, schedule: Schedule, warmup: int, iters: int, rates: dict) -> dict:
    """Median update time of one schedule on fresh gradients, and the check against torch. Predicted twice
    with rates known before it ran: from calibration alone, and refined by the optimizer on the updates
    so far (of other schedules and the probes)."""
    dev = opt.device
    opt.schedule = schedule
    sizes = [sg.numel for sg in opt.layout.subgroups]
    refined_rates = opt.planner.known_rates()  # refined by the earlier updates, not this schedule's own
    factors = opt.planner.factors
    times, stats, errors = [], [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for it in range(warmup + iters):
        _fresh_grads(opt)
        expected = {i: expected_master(opt, i, dev) for i in (probe_subgroups(opt) if it == warmup else [])}
        _sync(dev)
        t0 = time.perf_counter()
        opt.step()
        _sync(dev)
        if it >= warmup:
            times.append(time.perf_counter() - t0)
            stats.append(opt.last_update)
        for i, want in expected.items():
            got = opt.layout.subgroups[i].master.to(dev)
            errors.append(((got - want).norm() / want.norm()).item())
    mid = statistics.median(times)
    numel = sum(sizes)
    slots = max(opt.plan.slots, 1)  # priced for the placement that ran ("auto" may have planned again)
    calibrated = predict(sizes, opt.placements, Rates(**rates), slots)
    pred = predict(sizes, opt.placements, refined_rates, slots) if refined_rates else calibrated
    return {"schedule": schedule, "staged": stats[-1].staged_subgroups, "staged_predicted": pred.staged,
            "update_s": round(mid, 4), "predicted_s": round(pred.seconds, 4),
            "prediction_error": round(pred.seconds / mid - 1, 4),
            "factors": {k: round(v, 4) for k, v in factors.items()},
            "staged_window_s": round(stats[-1].staged_window_s, 4),
            "predicted_calibrated_s": round(calibrated.seconds, 4),
            "calibrated_error": round(calibrated.seconds / mid - 1, 4),
            "bottleneck": pred.bottleneck, "min_s": round(min(times), 4),
            "Gparams_per_s": round(numel / mid / 1e9, 3),
            "cpu_adam_s": round(statistics.median(s.cpu_adam_seconds for s in stats), 4),
            "h2d_GB": round(stats[0].h2d_bytes / 1e9, 2), "d2h_GB": round(stats[0].d2h_bytes / 1e9, 2),
            "peak_gpu_GB": round(torch.cuda.max_memory_allocated(dev) / 1e9, 2) if dev.type == "cuda" else 0.0,
            "lanes_s": {k: round(statistics.median(s.lane_seconds[k] for s in stats), 4)
                        for k in stats[0].lane_seconds},
            "max_rel_err_vs_torch": max(errors) if errors else None, "times": [round(t, 4) for t in times]}


def table(rows: list[dict]) -> str:
    """A markdown table of update-phase rows, measured beside predicted."""
    lines = ["| schedule | staged | update s (median) | predicted s, refined rates | error "
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
        lines.append(f"| {r['schedule']} | {r['staged']}/{r['subgroups']} | {r['update_s']:.3f} | {refined} | "
                     f"{cal:.3f} | {cal_err:+.1%} | {r['Gparams_per_s']:.2f} | "
                     f"{r['bottleneck']} | {r['cpu_adam_s']:.3f} | {r['h2d_GB']} | {r['d2h_GB']} | "
                     f"{r['peak_gpu_GB']} | {err} |")
    return "\n".join(lines)
