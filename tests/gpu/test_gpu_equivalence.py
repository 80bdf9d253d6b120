"""On a GPU, with real streams and a CPU worker: every schedule equals torch's AdamW, on fresh random data.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``. Seeds come from the OS each run and are
printed, so a race (results that move between runs) shows up as a failure that names its seed.
"""

import os

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates, Placement
from deep_optimizer_states.reference import ReferenceAdamW
from tests.harness import SCHEDULES, loss_of, mlp, tiny_llama, train_and_compare

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


@pytest.mark.parametrize("repeat", range(int(os.environ.get("DOS_GPU_REPEATS", "3"))))  # 3: with clipping
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_every_schedule_matches_adamw_with_real_streams(kind, schedule, dtype, repeat):
    seed = _seed()
    model = (mlp if kind == "mlp" else tiny_llama)(dtype, "cuda", seed=seed)
    size = sum(p.numel() for p in model.parameters()) // 10
    opt = DeepOptimizerStates(model, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=size,
                              schedule=schedule, max_grad_norm=1.0 if repeat == 2 else None)
    assert opt.layout.buckets[0].master.is_pinned()
    train_and_compare(model, opt, steps=30, seed=seed, max_norm=0.5 if repeat == 1 else None)


@pytest.mark.parametrize("schedule", [2, 3, "auto"], ids=str)
def test_large_subgroups_many_slots_reuse(schedule):
    """Subgroups of a million elements, more staged subgroups than slots: slot reuse waits for flushes."""
    seed = _seed()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)]).to("cuda", torch.bfloat16)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=1_000_000, schedule=schedule)
    staged = opt.placements.count(Placement.STAGED)
    assert staged > opt.planner.max_slots
    ref = ReferenceAdamW(opt)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(5):
        opt.zero_grad()
        x = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        ref.step()
        opt.step()
        ref.assert_matches()
    # "auto" may plan again from what the updates measured; the engine must run the plan it holds
    assert opt.last_update.staged_subgroups == opt.placements.count(Placement.STAGED)
    if schedule != "auto":
        assert opt.last_update.staged_subgroups == staged


# Schedule "gpu" runs the reference's own CUDA kernel: held to 1e-6. Schedule 2 updates half the subgroups
# with torch's CPU fused kernel, which rounds differently from the CUDA one; on fp16 models the small-norm
# bias tensors showed 1.5e-6 once (seed 2753514291), so that mix is held to 1e-5.
@pytest.mark.parametrize("schedule, rtol", [("gpu", 1e-6), (2, 1e-5)], ids=["gpu", "k2"])
def test_fp16_on_gpu_skips_overflow_and_matches(schedule, rtol):
    seed = _seed()
    model = mlp(torch.float16, "cuda", seed=seed)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000, schedule=schedule)
    ref = ReferenceAdamW(opt)
    gen = torch.Generator().manual_seed(seed)
    for step in range(10):
        opt.zero_grad()
        scale = opt.scaler.scale
        opt.scale_loss(loss_of(model, gen)).backward()
        if step == 4:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            assert opt.scaler.scale == scale / 2
            continue
        ref.step(unscale=1.0 / scale)
        opt.step()
        ref.assert_matches(rtol)


def test_gpu_checkpoint_resume_is_bit_identical(tmp_path):
    seed = _seed()

    def run(steps, load=None, save=None):
        model = tiny_llama(torch.bfloat16, "cuda", seed=seed)
        opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=8000, schedule=3)
        gen = torch.Generator().manual_seed(seed)
        if load:
            ckpt = torch.load(load, weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            gen.set_state(ckpt["rng"])
        for i in range(steps):
            opt.zero_grad()
            loss_of(model, gen).backward()
            opt.step()
            if save and i == 4:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": gen.get_state()}, save)
        return model

    path = tmp_path / "ckpt.pt"
    straight = run(10, save=path)
    resumed = run(5, load=path)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))



def test_cpu_path_threads_are_the_workers_own_and_do_not_change_a_bit():
    """set_cpu_threads changes the worker's thread count only (the caller's stays), and the CPU path on one
    thread gives the same masters, bit for bit, as on the default count (torch's fused CPU AdamW rounds
    the same whatever its threads; the default is held to torch's AdamW by the tests above)."""
    seed = _seed()
    runs = []
    for threads in (None, 1):
        model = mlp(torch.bfloat16, "cuda", seed=seed)
        size = sum(p.numel() for p in model.parameters()) // 6
        opt = DeepOptimizerStates(model, lr=3e-3, weight_decay=0.1, subgroup_size=size, schedule=2)
        caller = torch.get_num_threads()
        if threads:
            opt.engine.set_cpu_threads(threads)
            assert opt.engine.cpu_threads() == threads
        assert torch.get_num_threads() == caller
        gen = torch.Generator().manual_seed(seed)
        for _ in range(10):  # the same gradients for both (a backward's could differ in its last bits)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype).cuda()
            opt.step()
        runs.append([opt.master(p).clone() for p in model.parameters()])
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_new_optimizers_cpu_path_runs_on_its_creators_threads_after_another_set_one():
    """Torch starts a new thread on the count any thread set last: after one optimizer's CPU path was set to
    one thread, the next optimizer's worker (and calibration's engine) must still run on the caller's count
    (``engine.start_worker``; the GPU suite's calibration warning of H200 call 126 came after such a test)."""
    first = DeepOptimizerStates(mlp(torch.bfloat16, "cuda", seed=1), schedule=2)
    caller = torch.get_num_threads()
    assert caller > 1, "this test needs a host of three cores or more (the CPU path leaves one to the GPU thread)"
    first.engine.set_cpu_threads(1)
    second = DeepOptimizerStates(mlp(torch.bfloat16, "cuda", seed=2), schedule=2)
    assert second.engine.cpu_threads() == torch.get_num_threads() == caller
    first.close()
    second.close()


@pytest.mark.parametrize("mode", ["sync", "overlap", "stream", "stream+overlap"])
@pytest.mark.parametrize("schedule", ["cpu", 3], ids=str)
def test_the_bf16_cpu_path_with_real_streams(schedule, mode):
    """bf16 gradients down (at the update, or streamed during backward), the bf16 kernel on the CPU worker,
    bf16 params up: torch's AdamW on fp32 masters, with clipping (its factor applied in the kernel), and
    half the CPU path's bytes each way. Streamed gradients leave the GPU during backward (``p.grad`` is
    given back), so the reference cannot read them: a twin that gathers them at the step is held to the
    reference, and the streamed run to the twin, bit for bit."""
    seed = _seed()
    stream = "stream" in mode
    runs = {}
    for streamed in sorted({False, stream}):
        model = tiny_llama(torch.bfloat16, "cuda", seed=seed)
        size = sum(p.numel() for p in model.parameters()) // 10
        opt = DeepOptimizerStates(model, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=size,
                                  schedule=schedule, max_grad_norm=0.5, overlap="overlap" in mode,
                                  stream_grads=streamed, bf16_cpu_path=True)
        assert opt.engine.bf16_kernel is not None
        runs[streamed] = model, opt, torch.Generator().manual_seed(seed)
    model, opt, _ = runs[stream]
    ref = ReferenceAdamW(runs[False][1])
    for step in range(20):
        for streamed, (m, o, gen) in runs.items():
            o.zero_grad()
            loss_of(m, gen).backward()
            if not streamed:
                ref_norm = ref.step(o.max_grad_norm)
            o.step()
            torch.testing.assert_close(o.last_grad_norm.cpu(), ref_norm.cpu(), rtol=1e-6, atol=0)
        ref.assert_matches()
        if stream:
            assert any(p.grad is None for p in model.parameters()), "the CPU path's gradients left the GPU"
            for p, q in zip(model.parameters(), runs[False][0].parameters()):
                assert torch.equal(opt.master(p), runs[False][1].master(q)), f"step {step}"
    opt.synchronize()
    stats, cpu = opt.last_update, [sg for sg, p in zip(opt.layout.subgroups, opt.placements) if p is Placement.CPU]
    staged = sum(sg.numel for sg, p in zip(opt.layout.subgroups, opt.placements) if p is Placement.STAGED)
    assert stats.h2d_bytes == 2 * sum(sg.numel for sg in cpu) + 12 * staged


@pytest.mark.parametrize("stream", [False, True], ids=["gathered", "streamed"])
def test_the_bf16_cpu_path_equals_the_fp32_path_bit_for_bit_on_a_gpu(stream, device="cuda"):
    """The same gradients into two optimizers, one with bf16_cpu_path: the GPU's up-cast, multiply and
    rounding on one side, the kernel's on the host on the other; every param and master equal, bit for bit."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1000,), (37, 13), (517,), (64, 64), (5,), (300, 7)]
    init = [(torch.randn(s, generator=gen) * 0.1).bfloat16() for s in shapes]
    params = {lean: [torch.nn.Parameter(t.to(device, copy=True)) for t in init] for lean in (False, True)}
    opts = {lean: DeepOptimizerStates(params[lean], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=700,
                                      schedule="cpu", max_grad_norm=0.05, stream_grads=stream, bf16_cpu_path=lean)
            for lean in (False, True)}
    assert opts[True].engine.bf16_kernel is not None
    for step in range(6):
        grads = [(torch.randn(s, generator=gen) * 0.1).bfloat16().to(device) for s in shapes]
        for lean in (False, True):  # a real backward (the hooks of stream_grads run): each param's gradient is g
            opts[lean].zero_grad()
            sum((p.float() * g.float()).sum() for p, g in zip(params[lean], grads)).backward()
            opts[lean].step()
            opts[lean].synchronize()
        for a, b in zip(params[False], params[True]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"step {step}"
            assert torch.equal(opts[False].master(a), opts[True].master(b)), f"step {step}"
