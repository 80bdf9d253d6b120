"""The dos command: the main job, calibrate and plan, run as a user would on a CPU machine."""

import json

import pytest
import torch

from deep_optimizer_states.tools.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DOS_CACHE_DIR", str(tmp_path))


def test_check_runs_checked_against_torch(capsys):
    assert main(["check", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "step   3" in out and "matches torch.optim.AdamW on fp32 masters" in out


def test_calibrate_prints_each_rate_with_its_unit(capsys):
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "measured now" in out and "G elements/s" in out and "GB/s" in out
    assert main(["calibrate"]) == 0
    assert "from the cache" in capsys.readouterr().out


def test_calibrate_bf16_cpu_path_keeps_its_own_cache(capsys):
    from deep_optimizer_states.planning.calibrate import cache_path

    assert main(["calibrate"]) == 0
    plain = capsys.readouterr().out
    assert main(["calibrate", "--bf16-cpu-path"]) == 0
    out = capsys.readouterr().out
    assert "measured now" in out and str(cache_path(torch.device("cpu"), bf16=True)) in out
    assert str(cache_path(torch.device("cpu"))) in plain and cache_path(torch.device("cpu"), bf16=True).exists()
    assert main(["calibrate", "--bf16-cpu-path"]) == 0
    assert "from the cache" in capsys.readouterr().out


@pytest.fixture
def threads():
    """torch's thread count, put back after the test (the commands set it as the optimizer would)."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_calibrate_caches_what_an_optimizer_on_those_threads_finds(capsys, threads):
    from deep_optimizer_states import DeepOptimizerStates
    from deep_optimizer_states.planning.calibrate import cache_path, load_cached

    assert main(["calibrate", "--cpu-threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "(1 CPU threads)" in out
    written = out.strip().splitlines()[-1].removeprefix("cache: ")
    torch.set_num_threads(threads)  # as a new process starts
    with DeepOptimizerStates(torch.nn.Linear(8, 8).parameters(), cpu_threads=1) as opt:
        assert str(cache_path(opt.device)) == written and load_cached(opt.device) is not None


def test_calibrate_on_a_gpu_host_measures_on_the_optimizers_default_threads(monkeypatch, capsys, threads):
    """With a GPU the optimizer leaves one core to the GPU's thread; ``dos calibrate`` measured on every core,
    and cached the rates under that count, where the optimizer never looked (it calibrated again)."""
    from deep_optimizer_states.core import ranks
    from deep_optimizer_states.planning import calibrate
    from deep_optimizer_states.tools import cli

    monkeypatch.setattr(ranks, "host_cores", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(cli, "_device", lambda: torch.device("cuda"))  # measuring itself is a GPU test's job
    seen = []
    rates = calibrate.Rates(**dict.fromkeys(calibrate.Rates.__dataclass_fields__, 1e9))
    monkeypatch.setattr(calibrate, "load_cached", lambda device, bf16=False: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(calibrate, "calibrated_rates", lambda device, **kw: seen.append(torch.get_num_threads())
                        or rates)
    monkeypatch.setattr(calibrate, "cache_path", lambda device, bf16=False: f"threads-{torch.get_num_threads()}")
    torch.set_num_threads(4)  # torch's default: one thread per core
    assert main(["calibrate"]) == 0
    assert seen == [3, 3] and "cache: threads-3" in capsys.readouterr().out
    torch.set_num_threads(4)
    assert ranks.use_cpu_threads(None, torch.device("cuda")) == 3  # what the optimizer then runs on
    torch.set_num_threads(4)
    assert main(["calibrate", "--cpu-threads", "2"]) == 0 and seen[-1] == 2


def test_plan_json_is_consistent(capsys, monkeypatch):
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "1000")
    assert main(["plan", "--params", "2e8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["params"] == 200_000_000 and plan["staged"] + plan["on_cpu"] == plan["subgroups"]
    assert len(plan["placements"]) == plan["subgroups"]
    assert plan["lower_bound_s"] <= plan["predicted_update_s"]
    assert plan["bottleneck"] in ("cpu", "link", "gpu")


def test_plan_under_a_small_gpu_budget_stages_nothing(capsys, monkeypatch):
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "1000")
    assert main(["plan", "--params", "2e9", "--gpu-memory-gb", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["staging_slots"] == 0 and plan["staged"] == 0


def test_bench_smoke_on_cpu(capsys, tmp_path):
    out_file = tmp_path / "rows.jsonl"
    assert main(["bench", "--model", "tiny", "--subgroup-size", "100000", "--schedules", "cpu,2", "--iters", "2",
                 "--warmup", "1", "--probes", "1", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "| cpu |" in out and "| 2 |" in out
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["schedule"] for r in rows] == ["cpu", 2] and all(r["probe_updates"] == 1 for r in rows)
    assert all(r["max_rel_err_vs_torch"] < 1e-6 for r in rows)


def test_bench_refuses_a_negative_probe_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--probes", "-1"])
    assert exit_info.value.code == 2 and "argument --probes: must be an integer >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--device", "foo"], "argument --device: invalid choice"),
    (["--model", "huge"], "argument --model: invalid choice"),
    (["--device", "cuda"], "--device cuda: no CUDA device here"),
])
def test_check_option_errors_are_usage_errors(args, message, capsys):
    import torch

    if args == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_info:
        main(["check", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
