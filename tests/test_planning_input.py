"""Planning at any model size, the dos command's input checks and budgets, and when "auto" calibrates."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deep_optimizer_states.core.engine import DEFAULT_STAGING_SLOTS
from deep_optimizer_states.core.schedule import Placement, placements, spread
from deep_optimizer_states.planning import calibrate, perfmodel
from deep_optimizer_states.planning.perfmodel import choose, predict
from deep_optimizer_states.planning.plan import Planner
from deep_optimizer_states.tools import benchmark, cli
from deep_optimizer_states.tools.cli import main
from tests.test_perfmodel import H200_LIKE, NO_CONTENTION

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path))


def near_equal(params, count):
    return [params // count + (i < params % count) for i in range(count)]


def brute_force(sizes, rates, slots):
    """The choice as it was: every count of staged subgroups priced on its placement list."""
    best = None
    for staged in range(len(sizes) + 1):
        pred = predict(sizes, spread(len(sizes), staged), rates, slots)
        if best is None or pred.seconds < best[1].seconds:
            best = (staged, pred)
    return best


# ---- 1. planning time flat in the model size ---------------------------------------------------------------
@pytest.mark.parametrize("sizes", [near_equal(10**9, 37), near_equal(5_200_000_000, 208), [25_000_000] * 55,
                                   [3_000_000] * 7 + [25_000_000] * 20 + [1_000] * 5, [7], [5, 9]])
@pytest.mark.parametrize("rates", [H200_LIKE, NO_CONTENTION])
@pytest.mark.parametrize("slots", [1, 2])
def test_choice_is_the_brute_force_one_exactly(sizes, rates, slots):
    staged, pred = brute_force(sizes, rates, slots)
    places, chosen = choose(sizes, rates, slots)
    assert places == spread(len(sizes), staged) and chosen == pred


def test_the_choice_prices_every_split_at_once_whatever_the_subgroup_count(monkeypatch):
    """Planning time must not grow with the model: ``choose`` prices every staged count in a few vector
    operations, and calls the scalar ``price`` the same few times for 40 subgroups as for 4000 (a wall-time
    bound here failed under a loaded 2-core machine; the count is what keeps it fast)."""
    calls = []
    real = perfmodel.price
    monkeypatch.setattr(perfmodel, "price", lambda *a, **k: calls.append(1) or real(*a, **k))
    counts = []
    for count in (40, 4000):
        calls.clear()
        sizes = near_equal(10**11, count)
        places, pred = choose(sizes, H200_LIKE)
        counts.append(len(calls))
        assert pred == predict(sizes, places, H200_LIKE) and 0 < pred.staged < count
    assert counts[0] == counts[1] <= 3


def _pretend_gpu(monkeypatch):
    monkeypatch.setattr(cli, "_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(calibrate, "calibrated_rates", lambda *a, **k: H200_LIKE)


def test_plan_for_a_trillion_params_answers(monkeypatch, capsys):
    _pretend_gpu(monkeypatch)
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "100000")
    assert main(["plan", "--params", "1e12", "--gpu-memory-gb", "10000", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["params"] == 10**12 and 0 < plan["staged"] < plan["subgroups"] \
        and plan["staging_slots"] == DEFAULT_STAGING_SLOTS
    assert plan["budget"]["gpu_budget_GB"] == 10000 and plan["lower_bound_s"] <= plan["predicted_update_s"]


# ---- 2. input checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["plan", "--params", "nan"], "argument --params: must be a finite number"),
    (["plan", "--params", "inf"], "argument --params: must be a finite number"),
    (["plan", "--params", "0.5"], "argument --params: must be a parameter count >= 1"),
    (["plan", "--params=-1e9"], "argument --params: must be a parameter count >= 1"),
    (["plan", "--params", "lots"], "argument --params: 'lots' is not a number"),
    (["plan", "--params", "1e9", "--gpu-memory-gb", "-5"], "argument --gpu-memory-gb: must be > 0"),
    (["plan", "--params", "1e9", "--gpu-memory-gb", "nan"], "argument --gpu-memory-gb: must be a finite number"),
    (["plan", "--params", "1e9", "--subgroup-size", "-3"], "argument --subgroup-size: must be an integer >= 1"),
    (["train", "--subgroup-size", "0"], "argument --subgroup-size: must be an integer >= 1"),
    (["train", "--schedule", "0"], "argument --schedule: schedule k must be >= 1"),
    (["bench", "--subgroup-size", "-3"], "argument --subgroup-size: must be an integer >= 1"),
    (["bench", "--probes", "-1"], "argument --probes: must be an integer >= 0"),
])
def test_bad_arguments_are_refused_by_argparse(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_params_give_a_usage_error_and_no_traceback_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "deep_optimizer_states", "plan", "--params", "nan"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "must be a finite number" in result.stderr
    assert "Traceback" not in result.stderr


# ---- 3. budgets --------------------------------------------------------------------------------------------
def test_plan_says_when_the_host_memory_is_too_small(monkeypatch, capsys):
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "100")
    assert main(["plan", "--params", "7e10"]) == 1
    out = capsys.readouterr().out
    assert "do not fit" in out and "1120.0 GB of pinned host memory" in out and "100.0 GB available" in out
    assert main(["plan", "--params", "7e10", "--json"]) == 1
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["fits"] is False and plan["budget"]["host_memory_GB"] == 100


def test_plan_says_when_the_gpu_budget_is_too_small(monkeypatch, capsys):
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "1000")
    assert main(["plan", "--params", "5.2e9", "--gpu-memory-gb", "16"]) == 1
    out = capsys.readouterr().out
    assert "bf16 params and grads need 20.8 GB" in out and "the budget is 16.0 GB" in out


def test_plan_echoes_its_budget_and_reports_the_cpu_path_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "64")
    monkeypatch.setattr(calibrate, "calibrated_rates", lambda *a, **k: H200_LIKE)
    assert main(["plan", "--params", "2e9"]) == 0
    out = capsys.readouterr().out
    assert "host memory 64 GB available" in out and "needs 32 GB" in out and "no GPU" in out
    assert "CPU path" in out and "staged" not in out
    assert main(["plan", "--params", "2e9", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["cpu_path_only"] and plan["staged"] == 0 and plan["staging_slots"] == 0
    assert plan["budget"] == {"host_memory_GB": 64, "host_needed_GB": 32, "gpu_budget_GB": None,
                              "gpu_budget_from": "no GPU", "gpu_needed_GB": 8}


def test_plan_on_a_gpu_plans_for_the_budget_it_was_given(monkeypatch, capsys):
    _pretend_gpu(monkeypatch)
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "1000")
    assert main(["plan", "--params", "5.2e9", "--gpu-memory-gb", "40"]) == 0
    out = capsys.readouterr().out
    assert "GPU 40 GB (--gpu-memory-gb)" in out and "staged to the GPU" in out


# ---- 4. the benchmark's default model ----------------------------------------------------------------------
def test_bench_defaults_to_a_model_that_fits_the_machine():
    assert benchmark.default_model(torch.device("cpu")) == "tiny"
    cuda = torch.device("cuda")
    assert benchmark.default_model(cuda, host_bytes=2000 * 10**9, gpu_bytes=141 * 10**9) == "1.36b"
    assert benchmark.default_model(cuda, host_bytes=16 * 10**9, gpu_bytes=141 * 10**9) == "0.5b"
    assert benchmark.default_model(cuda, host_bytes=4 * 10**9, gpu_bytes=141 * 10**9) == "tiny"
    assert benchmark.default_model(cuda, host_bytes=2000 * 10**9, gpu_bytes=6 * 10**9) == "0.5b"
    assert benchmark.preset_params("1.36b") == 1_364_297_728


def test_dos_bench_without_a_gpu_runs_the_tiny_model(monkeypatch, capsys):
    seen = {}

    def update_phase(model, schedules, subgroup_size, *args, **kwargs):
        seen.update(model=model, schedules=schedules, subgroup_size=subgroup_size)
        return []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(benchmark, "update_phase", update_phase)
    monkeypatch.setattr(benchmark, "table", lambda rows: "")
    assert main(["bench"]) == 0
    assert seen == {"model": "tiny", "schedules": ["cpu", 1, 2, 3, 4, 5, 6, 7, 8, "auto"], "subgroup_size": None}
    assert "model tiny (no GPU here" in capsys.readouterr().out


# ---- 5. "auto" calibrates at the first step, not at construction -------------------------------------------
@pytest.fixture
def gpu_planner(monkeypatch, tmp_path):
    """A planner for a pretend GPU with no stored calibration; ``measured`` counts measurements."""
    measured = []
    stored = {"rates": None}

    def calibrated_rates(device, force=False, log=None, sync=None, bf16=False):
        measured.append(force)
        stored["rates"] = H200_LIKE
        return H200_LIKE

    monkeypatch.setattr(calibrate, "calibrated_rates", calibrated_rates)
    monkeypatch.setattr(calibrate, "load_cached", lambda device, bf16=False: stored["rates"])
    monkeypatch.setattr(calibrate, "cache_path", lambda device, bf16=False: tmp_path / "calibration-gpu.json")
    sizes = [25_000_000] * 16
    planner = Planner(sizes, torch.device("cuda"), 2)
    monkeypatch.setattr(planner, "slots_that_fit", lambda: 2)
    return planner, measured, stored


def test_auto_plans_provisionally_and_calibrates_at_the_first_refresh(gpu_planner, caplog, tmp_path):
    planner, measured, _ = gpu_planner
    caplog.set_level(logging.INFO, logger="deep_optimizer_states.planning.plan")
    first = planner.plan("auto")
    assert measured == [] and first.prediction is None and first.placements == placements("auto", 16)
    assert planner.pending
    planner.refresh()
    assert len(measured) == 1
    assert planner.current.prediction is not None
    assert planner.current.placements == choose(planner.sizes, H200_LIKE, 2)[0]
    for _ in range(3):
        planner.refresh()
    assert len(measured) == 1
    notes = [r.getMessage() for r in caplog.records if "calibrating" in r.getMessage()]
    assert len(notes) == 1 and str(tmp_path / "calibration-gpu.json") in notes[0]


def test_explicit_calibrate_plans_at_once_and_a_stored_calibration_is_reused(gpu_planner, monkeypatch):
    planner, measured, stored = gpu_planner
    planner.plan("auto")
    assert planner.calibrate() == H200_LIKE and len(measured) == 1
    assert planner.current.prediction is not None
    planner.refresh()
    assert len(measured) == 1
    again = Planner(planner.sizes, torch.device("cuda"), 2)  # another optimizer on this machine
    monkeypatch.setattr(again, "slots_that_fit", lambda: 2)
    assert again.plan("auto").prediction is not None and len(measured) == 1
    assert again.calibrate() == H200_LIKE and len(measured) == 1


def test_fixed_schedules_and_cpu_devices_never_calibrate(gpu_planner):
    planner, measured, _ = gpu_planner
    planner.plan(2)
    planner.refresh()
    cpu = Planner([1000] * 8, torch.device("cpu"), 2)
    assert cpu.plan("auto").placements == placements("auto", 8)
    cpu.refresh()
    assert measured == []


# ---- 6. make run / make test: install once ------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_installs_once_and_again_when_pyproject_changes(tmp_path):
    for name in ("Makefile", "pyproject.toml", "scripts/install.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)

    def dry_run() -> str:
        return subprocess.run(["make", "-n", "run"], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    assert "scripts/install.sh" in dry_run()
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "python").write_text(sys.executable + "\n")
    (tmp_path / "build" / "install.stamp").touch()
    assert "scripts/install.sh" not in dry_run() and "deep_optimizer_states train" in dry_run()
    stamp = (tmp_path / "build" / "install.stamp").stat().st_mtime
    os.utime(tmp_path / "pyproject.toml", (stamp + 10, stamp + 10))
    assert "scripts/install.sh" in dry_run()



@pytest.mark.parametrize("content", ["[]", "null", "dir"])
def test_a_calibration_cache_that_is_no_record_is_ignored_with_a_warning(content, tmp_path, monkeypatch):
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path))
    path = calibrate.cache_path(torch.device("cpu"))
    if content == "dir":
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring the calibration cache"):
        assert calibrate.load_cached(torch.device("cpu")) is None


def test_a_cache_folder_that_cannot_be_written_warns_and_keeps_the_rates(tmp_path, monkeypatch):
    """A read-only home or a full disk must not fail every step that calibrates: the rates stay in memory."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DOS_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="cannot cache the calibration.*DOS_CACHE_DIR"):
        assert calibrate.save(H200_LIKE, torch.device("cpu")) is None
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.delenv("DOS_CACHE_DIR")
    assert calibrate.cache_path(torch.device("cpu")).is_absolute()  # empty XDG_CACHE_HOME: unset, not the cwd


def test_a_planner_with_nothing_to_place_on_a_gpu_plans_nothing():
    """Every local shard empty (small params over many FSDP2 ranks): every schedule plans zero subgroups."""
    from deep_optimizer_states.planning.budget import MemoryBudget
    from tests.test_residency import FakeProbe

    for schedule in ("auto", "offload", "cpu"):
        planner = Planner([], torch.device("cpu"), 2, rates=H200_LIKE, budget=MemoryBudget(None, FakeProbe()))
        assert planner.plan(schedule).placements == []
