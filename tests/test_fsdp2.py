"""FSDP2 (fully_shard) with our optimizer on each rank's shards: CPU processes on gloo, launched by torchrun.

Each test starts tests/fsdp2_worker.py on 1, 2 or 3 ranks. The worker checks every step against a
single-process torch.optim.AdamW itself; checkpoints are compared here.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from deep_optimizer_states import DeepOptimizerStates
from tests.harness import needs_compiler

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed support")
WORKER = Path(__file__).with_name("fsdp2_worker.py")
# FSDP2 shards on the CPU (gloo) from torch 2.7: torch 2.5's needs CUDA ("FSDP requires CUDA for streams"),
# torch 2.6's records an event on a CPU stream, which has none (AttributeError)
CPU_FSDP2 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)


def torchrun(ranks: int, *args: str, target: list[str] | None = None) -> str:
    """Run ``target`` (the worker script by default) on ``ranks`` CPU processes; its stdout."""
    if not CPU_FSDP2:
        pytest.skip(f"FSDP2 on CPU processes needs torch >= 2.7 (torch {torch.__version__}'s needs CUDA streams)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           *(target or [str(WORKER)]), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return run.stdout


@pytest.mark.parametrize("ranks,schedule", [(2, "2"), (3, "auto"), (2, "cpu"), (2, "mixed")])
def test_fsdp2_matches_single_process_adamw_step_by_step(ranks, schedule):
    out = torchrun(ranks, "train", "--steps", "6", "--schedule", schedule)
    assert out.count("6 steps equal torch AdamW") == ranks
    sizes = set(re.findall(r"local shard sizes (\[[0-9, ]*\])", out))  # ranks' lines may interleave
    assert len(sizes) > 1, "the shards should be uneven"


@pytest.mark.parametrize("ranks,schedule", [(2, "cpu"), (3, "mixed")])
def test_streamed_gradients_under_fsdp2_match_adamw_and_the_unstreamed_run(ranks, schedule):
    """stream_grads under FSDP2: its reduce-scatter runs the post-accumulate-grad hooks on the sharded params,
    so CPU-placed subgroups go down as their shards land; clipping sums the landed norms over the ranks;
    accumulation over two micro-batches (the first under opt.accumulating())."""
    out = torchrun(ranks, "train", "--steps", "4", "--schedule", schedule, "--stream")
    assert out.count("4 steps equal torch AdamW") == ranks
    assert out.count("equal bit for bit") == ranks


@pytest.mark.parametrize("ranks,schedule", [(2, "cpu"), (3, "mixed")])
def test_bit_for_bit_fsdp2_with_torch_adamw_on_the_same_shards(ranks, schedule):
    """What an FSDP2 user runs today, torch's fused AdamW over the DTensor shards, and ours over the same
    uneven shards (cut into subgroups inside params): the same bits at every step (unclipped: the global
    norm's summation order is not torch's)."""
    out = torchrun(ranks, "train", "--steps", "4", "--schedule", schedule, "--peer", "--max-norm", "1e3")
    assert out.count("equal FSDP2 + torch AdamW bit for bit") == ranks


@pytest.mark.parametrize("ranks,schedule", [(2, "cpu"), (3, "mixed")])
def test_updates_run_ahead_under_fsdp2_equal_adamw_and_the_plain_run(ranks, schedule):
    """speculate=True under FSDP2 (uneven shards, accumulation, unclipped so the updates are kept): bit for
    bit the run that neither streams nor runs ahead, and torch AdamW."""
    out = torchrun(ranks, "train", "--steps", "4", "--schedule", schedule, "--stream", "--speculate",
                   "--max-norm", "1e3")
    assert out.count("4 steps equal torch AdamW") == ranks and out.count("equal bit for bit") == ranks
    kept = [int(n) for n in re.findall(r"(\d+) updates run ahead and kept", out)]
    assert len(kept) == ranks and all(n > 0 for n in kept)


def test_a_forecast_of_the_clip_under_fsdp2_changes_no_bit():
    """``optimizer.STAND_DOWN = "forecast"`` under FSDP2, clipped at every step, updates run ahead after a clip
    too: each rank forecasts from its own shards' norms, the clip from the global one. Bit for bit the run that
    neither streams nor runs ahead, torch AdamW's within rounding, and the updates ahead stand down."""
    out = torchrun(2, "train", "--steps", "4", "--schedule", "cpu", "--stream", "--speculate",
                   "--stand-down", "forecast")
    assert out.count("4 steps equal torch AdamW") == 2 and out.count("equal bit for bit") == 2
    stood = [int(n) for n in re.findall(r"(\d+) stood down", out)]
    assert len(stood) == 2 and all(n > 0 for n in stood)


def test_an_inf_on_one_rank_undoes_the_updates_run_ahead_on_every_rank():
    out = torchrun(2, "nonfinite", "--steps", "5", "--schedule", "cpu", "--stream", "--speculate",
                   "--max-norm", "1e3")
    assert out.count("skipped the poisoned step with the others") == 2


def test_states_filled_ahead_under_fsdp2_change_no_bit():
    """prefetch=True under FSDP2 (3 ranks, uneven shards, resident, staged and CPU subgroups): each rank fills
    its staged shards' slots from the hooks the reduce-scatter runs; bit for bit the run without."""
    out = torchrun(3, "train", "--steps", "4", "--schedule", "mixed", "--stream", "--fill-ahead")
    assert out.count("4 steps equal torch AdamW") == 3 and out.count("equal bit for bit") == 3
    assert out.count("staged subgroups filled during backward") == 3


@pytest.mark.parametrize("ranks,schedule,stream", [(2, "2", False), (3, "mixed", False), (2, "cpu", True)])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks, schedule, stream):
    """The inf/nan check reads the global norm: a rank whose own shard is finite must skip too, or the
    ranks' params would diverge."""
    out = torchrun(ranks, "nonfinite", "--steps", "5", "--schedule", schedule, *(["--stream"] if stream else []))
    assert out.count("skipped the poisoned step with the others, 4 steps equal torch AdamW") == ranks


@pytest.mark.parametrize("ranks,schedule,stream,prefetch", [(2, "cpu", False, False), (3, "mixed", False, False),
                                                         (2, "2", True, False), (2, "cpu", False, True)])
def test_overlap_under_fsdp2_equals_the_synchronous_run(ranks, schedule, stream, prefetch):
    """overlap=True under FSDP2: each fully_shard unit (a block of layers, and the root with a layer of its
    own) waits for its shards' writes before its all-gather, and for those of the units it prefetches
    (``set_modules_to_forward_prefetch``), so the next forward, started at once while a slowed AdamW still
    runs, computes the same losses; shards and states end bit for bit equal."""
    out = torchrun(ranks, "overlap", "--steps", "4", "--schedule", schedule, *(["--stream"] if stream else []),
                   *(["--prefetch"] if prefetch else []))
    assert out.count("overlapped, 4 steps equal the synchronous run bit for bit") == ranks


def test_a_schedule_of_the_wrong_length_on_one_rank_is_refused_on_every_rank():
    out = torchrun(2, "bad_schedule")
    assert "REFUSED rank 0" in out and "here, but not on another rank" in out
    assert re.search(r"REFUSED rank 1: the schedule gives (\d+) placements for (?!\1)\d+ subgroups", out), out


def test_mixed_precision_policy_shards_match_torch_adamw():
    """torchtitan's setting: fp32 sharded params, bf16 all-gather and compute, fp32 reduce-scatter."""
    out = torchrun(2, "mixed_precision", "--steps", "4", "--schedule", "mixed")
    assert out.count("4 mixed-precision steps equal torch AdamW") == 2


@pytest.mark.parametrize("schedule", ["2", "mixed"])
def test_dcp_checkpoint_from_2_ranks_resumes_on_1_2_and_3(tmp_path, schedule):
    """"mixed": resident subgroups too, whose states a checkpoint reads from the GPU copy (evicted first)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    common = ["--ckpt", str(ckpt), "--out", str(out), "--before", "3", "--after", "3", "--schedule", schedule]
    torchrun(2, "save", *common)
    for ranks in (1, 2, 3):
        torchrun(ranks, "load", *common)
    uninterrupted = torch.load(out / "uninterrupted_2.pt")
    resumed_2 = torch.load(out / "resumed_2.pt")
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed_2)), "same ranks: bit for bit"
    for ranks in (1, 3):  # another rank count sums gradients in another order: equal to rounding
        for a, b in zip(uninterrupted, torch.load(out / f"resumed_{ranks}.pt")):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_ranks_calibrate_together_in_lock_step_and_keep_one_result(tmp_path):
    """A calibration stored on rank 0 only must not split the ranks (one loading, the others measuring at a
    barrier forever): all measure, passing the same barriers, and keep the average of their rates; once
    every rank has the stored file, all load it and measure nothing. A CPU path read far too slow on one
    rank has every rank measure the engine again (else rank 0 would wait at rank 1's barriers)."""
    torchrun(2, "calibrate", "--out", str(tmp_path))
    rows = [json.loads((tmp_path / f"calibrate-{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert rows[0]["measured"] == rows[1]["measured"], "the ranks keep the same (averaged) rates"
    assert set(rows[0]["measured"].values()) != {7.0}, "rank 0's stored file was not used alone"
    assert rows[0]["barriers"] == rows[1]["barriers"] >= 11, "each rate measured after a barrier"
    assert rows[0]["stored"] == rows[1]["stored"] == rows[0]["measured"], "then loaded from the stored files"
    # a third attempt where a real reading came out low too (CI's 2 cores shared by 2 ranks measuring at once)
    runs = rows[1]["engine_runs"]
    assert len(rows[0]["engine_runs"]) == len(runs) in (2, 3), "rank 1's low reading: both again, in lock-step"
    assert rows[1]["again"]["cpu_engine"] == max(runs[1:]), "the fastest real attempt kept"


def test_the_benchmark_fsdp2_peer_built_from_the_meta_device_is_the_same_on_any_number_of_ranks(tmp_path):
    """bench's FSDP2 + CPUOffloadPolicy peer starts on the meta device (so that no rank holds the whole fp32
    model): every param and buffer is then made, the initial model is the same on 1 and 3 ranks (uneven
    shards), and the peer trains."""
    check_peer_built_the_same(tmp_path, (1, 3))


def check_peer_built_the_same(out, rank_counts, *device: str) -> None:
    """Run the peer on each rank count; the ranks' initial shards, concatenated, are one model every time."""
    models = []
    for ranks in rank_counts:
        torchrun(ranks, "peer_build", "--out", str(out), "--steps", "3", *device)
        runs = [torch.load(out / f"peer-{ranks}-{rank}.pt") for rank in range(ranks)]
        assert all(r["losses"][-1] < r["losses"][0] for r in runs), "the peer trains"
        models.append({name: torch.cat([r["initial"][name] for r in runs]) for name in runs[0]["initial"]})
    first = models[0]
    for name, value in first.items():
        assert torch.all(value == 1) if name.endswith("norm.weight") else 0.01 < float(value.std()) < 0.03, name
        assert all(torch.equal(value, other[name]) for other in models[1:]), name


def test_single_process_state_dict_from_sharded_ranks(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    torchrun(2, "save", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--before", "3", "--after", "0")
    saved = torch.load(out / "single_process.pt", weights_only=False)
    state, params = saved["optim"]["state"], saved["params"]
    assert len(state) == len(params)
    for (fqn, entry), p in zip(state.items(), params):
        assert type(entry["master_param"]) is torch.Tensor and entry["master_param"].shape == p.shape, fqn
        assert torch.equal(entry["master_param"], p), f"{fqn}: fp32 params are their masters"
        assert float(entry["step"]) == 3 and bool((entry["exp_avg_sq"] >= 0).all())


def test_dos_check_under_torchrun_shards_with_fsdp2_and_matches_adamw():
    out = torchrun(2, "check", "--steps", "3", "--schedule", "2", target=["-m", "deep_optimizer_states"])
    assert "FSDP2 over 2 ranks" in out
    assert "matches torch.optim.AdamW" in out and out.count("step ") == 3  # rank 0 alone prints


def _two_ranks_and_one_process(tmp_path, common: list[str]) -> tuple[str, list[float], list[float]]:
    """`dos` with ``common`` on 2 ranks (--accum 1) and in one process (--accum 2: the same micro-batches):
    the 2-rank run's output and both loss curves."""
    out = torchrun(2, *common, "--accum", "1", "--summary-json", str(tmp_path / "two.json"),
                   target=["-m", "deep_optimizer_states"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    one = subprocess.run([sys.executable, "-m", "deep_optimizer_states", *common, "--accum", "2", "--summary-json",
                          str(tmp_path / "one.json")], capture_output=True, text=True, env=env, timeout=240)
    assert one.returncode == 0, one.stderr[-4000:]
    two, single = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    assert two["world_size"] == 2 and single["world_size"] == 1
    return out, [loss for _, loss in two["losses"]], [loss for _, loss in single["losses"]]


def test_dos_train_under_torchrun_is_data_parallel_over_the_ranks(tmp_path):
    """`dos train` on 2 ranks (FSDP2, gloo): each rank its own micro-batch, the gradients averaged by the
    reduce-scatter. So the 2-rank run with --accum 1 follows the 1-process run with --accum 2 over the same
    micro-batches: the same loss curve, step by step (fp32 on the CPU, to reduction order)."""
    common = ["train", "--hidden", "64", "--layers", "2", "--seq", "32", "--micro-batch", "4", "--data-mb", "0.2",
              "--steps", "8", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "8", "--no-progress",
              "--schedule", "2", "--subgroup-size", "20000"]
    out, a, b = _two_ranks_and_one_process(tmp_path, common)
    assert "FSDP2 over 2 ranks" in out and out.count("done: steps 1-8") == 1, out[-2000:]
    assert a[-1] < 0.9 * a[0], "the loss falls"
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 1e-4 * abs(y), f"step {step}: 2 ranks {x}, 1 process with the same batches {y}"


def test_dos_train_under_torchrun_reads_a_model_directory_shard_by_shard(tmp_path):
    """`dos train --model DIR` on 2 ranks: the model is made on the meta device and each rank reads only its
    rows of each tensor from the safetensors files (here several, with an index); it follows the 1-process
    run that loads the directory whole (and accumulates the same micro-batches) step by step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=300)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model", max_shard_size="100KB")
    assert (tmp_path / "model" / "model.safetensors.index.json").exists(), "several files"
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 300)
    common = ["train", "--model", str(tmp_path / "model"), "--data", str(text), "--seq", "32", "--micro-batch", "4",
              "--steps", "4", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
              "--schedule", "2", "--subgroup-size", "20000"]
    _, a, b = _two_ranks_and_one_process(tmp_path, common)
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 1e-4 * abs(y), f"step {step}: 2 ranks {x}, 1 process {y}"


def test_dos_train_under_torchrun_with_overlap_trains_bit_for_bit_like_without(tmp_path):
    """The Llama model sharded per decoder layer plus the root (embeddings, final norm, head): --overlap
    leaves each update running beside the next forward's all-gathers and gives the same losses exactly."""
    common = ["train", "--hidden", "64", "--layers", "2", "--seq", "32", "--micro-batch", "4", "--data-mb", "0.2",
              "--steps", "5", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "8", "--no-progress",
              "--schedule", "2", "--subgroup-size", "5000", "--accum", "2"]
    losses = {}
    for flag in ([], ["--overlap"]):
        path = tmp_path / f"summary{len(flag)}.json"
        out = torchrun(2, *common, *flag, "--summary-json", str(path), target=["-m", "deep_optimizer_states"])
        assert out.count("done: steps 1-5") == 1, out[-2000:]
        losses[bool(flag)] = [loss for _, loss in json.loads(path.read_text())["losses"]]
    assert losses[True] == losses[False]


def test_dos_train_under_torchrun_checkpoints_with_dcp_and_resumes_on_2_ranks_and_1(tmp_path):
    """Sharded checkpoints (DCP) from `dos train` on 2 ranks: a resume on 2 ranks from the step-3 checkpoint
    repeats the uninterrupted run's steps 4-6 exactly; one in a single process (accumulating the same
    micro-batches) to rounding."""
    common = ["train", "--hidden", "64", "--layers", "2", "--seq", "32", "--micro-batch", "4", "--data-mb", "0.2",
              "--steps", "6", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "0", "--no-progress",
              "--schedule", "2", "--subgroup-size", "20000", "--warmup", "2"]
    dos = ["-m", "deep_optimizer_states"]
    full = tmp_path / "full"
    torchrun(2, *common, "--checkpoint-dir", str(full), "--checkpoint-every", "3", "--keep-checkpoints", "5",
             "--summary-json", str(tmp_path / "full.json"), target=dos)
    manifest = json.loads((full / "step-000000003" / "manifest.json").read_text())
    assert manifest["sharded"] and manifest["world_size"] == 2
    for name in ("two", "one"):  # the run "interrupted" after step 3: only its step-3 checkpoint exists
        (tmp_path / name).mkdir()
        shutil.copytree(full / "step-000000003", tmp_path / name / "step-000000003")
    torchrun(2, *common, "--checkpoint-dir", str(tmp_path / "two"), "--resume",
             "--summary-json", str(tmp_path / "two.json"), target=dos)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    one = subprocess.run([sys.executable, *dos, *common, "--accum", "2", "--checkpoint-dir", str(tmp_path / "one"),
                          "--resume", "--summary-json", str(tmp_path / "one.json")],
                         capture_output=True, text=True, env=env, timeout=240)
    assert one.returncode == 0, one.stderr[-4000:]
    curve = dict(json.loads((tmp_path / "full.json").read_text())["losses"])
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["start_step"] == 3 and [s for s, _ in two["losses"]] == [4, 5, 6]
    for s, loss in two["losses"]:
        assert loss == curve[s], f"step {s}: resumed on 2 ranks {loss}, uninterrupted {curve[s]}"
    single = json.loads((tmp_path / "one.json").read_text())
    assert single["start_step"] == 3 and [s for s, _ in single["losses"]] == [4, 5, 6]
    for s, loss in single["losses"]:
        assert abs(loss - curve[s]) <= 1e-4 * curve[s], f"step {s}: resumed in one process {loss}, 2 ranks {curve[s]}"


# ---- sharded checkpoints in one process (no process group): what DCP would otherwise change ----------------
def _small(dtype=torch.float32, unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    if unused:  # trainable, never in the forward: no state ever
        model.add_module("unused", nn.Linear(4, 4).to(dtype))
    return model


def _train_small(model: nn.Module, opt: DeepOptimizerStates, steps: range) -> None:
    for s in steps:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(s)).to(next(model.parameters()).dtype)
        loss = model[2](model[1](model[0](x))).float().pow(2).mean()
        opt.zero_grad()
        (opt.scale_loss(loss) if opt.scaler is not None else loss).backward()
        opt.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def test_a_sharded_save_before_the_first_step_changes_nothing(tmp_path):
    """DCP "initialises" an optimizer without state by a step with zero gradients, which would move every
    step count to 1: ours shows its step-0 states instead, so the run goes on exactly as without the save."""
    from deep_optimizer_states.integrations.fsdp2 import save_sharded_checkpoint

    runs = []
    for save in (False, True):
        model = _small()
        opt = DeepOptimizerStates(model, lr=1e-2, weight_decay=0.1, schedule="cpu")
        if save:
            save_sharded_checkpoint(tmp_path, model, opt, step=0)
        _train_small(model, opt, range(3))
        runs.append(_flat(model))
    assert torch.equal(*runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16_loss_scaler"])
def test_a_sharded_checkpoint_with_an_untrained_param_and_a_loss_scaler_resumes_exactly(dtype, tmp_path):
    """A param never trained yet has no state, yet the checkpoint must load into a fresh optimizer (which
    DCP would "initialise" with every param); the loss scaler and the skipped steps, which DCP's state dict
    leaves out, come back too."""
    from deep_optimizer_states.integrations.fsdp2 import load_sharded_checkpoint, save_sharded_checkpoint

    kwargs = dict(lr=1e-2, weight_decay=0.1, schedule="cpu", loss_scale=1024.0 if dtype == torch.float16 else None)
    model = _small(dtype, unused=True)
    opt = DeepOptimizerStates(model, **kwargs)
    _train_small(model, opt, range(3))
    if opt.scaler is not None:
        opt.scaler.update(found_inf=True)  # a scale of its own: 512
        opt.skipped_steps = 1
    path = save_sharded_checkpoint(tmp_path, model, opt, step=3)
    twin = _small(dtype, unused=True)
    again = DeepOptimizerStates(twin, **kwargs)
    load_sharded_checkpoint(path, twin, again)
    if opt.scaler is not None:
        assert again.scaler.state_dict() == opt.scaler.state_dict() and again.skipped_steps == 1
    _train_small(model, opt, range(3, 6))
    _train_small(twin, again, range(3, 6))
    assert torch.equal(_flat(model), _flat(twin))


def test_a_bad_extra_is_refused_before_a_sharded_save_starts(tmp_path):
    from deep_optimizer_states.integrations.fsdp2 import save_sharded_checkpoint

    model = _small()
    opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu")
    with pytest.raises(TypeError, match="extra key"):
        save_sharded_checkpoint(tmp_path, model, opt, extra={"f": lambda: 0})
    assert not any(tmp_path.iterdir())


@needs_compiler
@pytest.mark.parametrize("stream", [False, True], ids=["gathered", "streamed"])
def test_the_bf16_cpu_path_on_sharded_bf16_params(stream):
    out = torchrun(2, "bf16_path", "--steps", "5", "--schedule", "mixed", *(["--stream"] if stream else []))
    assert out.count("5 steps of the bf16 CPU path equal the fp32 path bit for bit") == 2


@needs_compiler
def test_a_kernel_missing_on_one_rank_is_used_on_none(monkeypatch):
    """Ranks calibrate and plan in lock-step: were the kernel to build on one rank only, none takes it."""
    monkeypatch.setenv("DOS_TEST_NO_KERNEL_ON_RANK", "1")
    out = torchrun(2, "bf16_path", "--steps", "2", "--schedule", "cpu")
    assert out.count("2 steps of the bf16 CPU path equal the fp32 path bit for bit") == 2
