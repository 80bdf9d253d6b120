"""`dos train` on GPUs: the model built on the meta device and made on the GPU (each rank its own shards)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_fsdp2 import torchrun
from tests.test_train import ROOT, dos

pytestmark = pytest.mark.gpu
COMMON = ["train", "--hidden", "64", "--layers", "2", "--seq", "32", "--micro-batch", "4", "--data-mb", "0.2",
          "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "8", "--no-progress"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dos_train_on_one_gpu_learns(tmp_path):
    path = tmp_path / "summary.json"
    dos(*COMMON, "--steps", "30", "--lr", "1e-2", "--summary-json", str(path), cache=tmp_path)
    summary = json.loads(path.read_text())
    losses = [loss for _, loss in summary["losses"]]
    assert summary["device"].startswith("cuda") and len(losses) == 30
    assert 5.0 < losses[0] < 6.0, "an untrained byte-level model starts near ln(256) = 5.55"
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dos_train_on_two_gpus_starts_from_the_one_process_model(tmp_path):
    """2 ranks with --accum 1 and 1 process with --accum 2 see the same micro-batches from the same model
    (drawn shard by shard on each rank): the same first loss; later ones apart by bf16 reduction order."""
    args = [*COMMON, "--steps", "8", "--schedule", "2", "--subgroup-size", "20000"]
    torchrun(2, *args, "--accum", "1", "--summary-json", str(tmp_path / "two.json"),
             target=["-m", "deep_optimizer_states"])
    dos(*args, "--accum", "2", "--summary-json", str(tmp_path / "one.json"), cache=tmp_path)
    two, one = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    assert two["world_size"] == 2 and two["device"].startswith("cuda") and one["device"].startswith("cuda")
    a, b = [loss for _, loss in two["losses"]], [loss for _, loss in one["losses"]]
    assert abs(a[0] - b[0]) <= 1e-3 * b[0], f"first loss: 2 ranks {a[0]}, 1 process {b[0]}"
    assert all(abs(x - y) <= 0.05 * y for x, y in zip(a, b)), (a, b)
    assert a[-1] < a[0] and b[-1] < b[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("flags", [[], ["--bf16-cpu-path"]], ids=["fp32", "bf16"])
def test_dos_calibrate_on_a_gpu_measures_and_caches(tmp_path, flags):
    """The engine is built on the bare "cuda" device here (H200 call 77: its CPU worker refused it). An
    optimizer built after it, in a fresh process of the same environment as a user's next run, finds its rates
    (until 2026-12-03 they were measured and cached for every core, the optimizer ran on one fewer and
    calibrated again at its first step). Both run in their own processes: this one holds whatever the tests
    before it left (H200 call 108: the check built in this process missed the cache in the whole suite and
    found it alone)."""
    out = dos("calibrate", *flags, "--json", cache=tmp_path, threads=None).stdout
    rates = json.loads(out.strip().splitlines()[-1])
    assert rates["cpu_engine"] > 0 and rates["link_contended"] > 0, rates
    assert list(tmp_path.glob("calibration-*.json"))
    check = ("import torch\n"
             "from deep_optimizer_states import DeepOptimizerStates\n"
             "from deep_optimizer_states.planning.calibrate import load_cached\n"
             "model = torch.nn.Linear(64, 64, device='cuda', dtype=torch.bfloat16)\n"
             f"with DeepOptimizerStates(model.parameters(), bf16_cpu_path={bool(flags)}) as opt:\n"
             "    print(load_cached(opt.device, opt.planner.bf16) is not None, torch.get_num_threads())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DOS_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    found, threads = run.stdout.split()
    assert found == "True", f"the optimizer on {threads} threads did not find the rates cached: {out[-1500:]}"
