"""On a GPU: resident subgroups with real streams equal torch's AdamW, and the memory budget holds.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``. Seeds come from the OS and are printed.
"""

import contextlib
import gc
import os

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates, Placement
from deep_optimizer_states.core.engine import DEFAULT_STAGING_SLOTS
from deep_optimizer_states.planning.budget import MIN_HEADROOM_BYTES
from deep_optimizer_states.reference import ReferenceAdamW
from tests.harness import loss_of, tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
R, S, C = Placement.RESIDENT, Placement.STAGED, Placement.CPU


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


def _stack(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)]).to("cuda", torch.bfloat16)


def _train(model, opt, ref, seed: int, steps: int, check_every: int | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        ref.step(1.0)
        opt.clip_grad_norm_(1.0)
        opt.step()
        if check_every and step % check_every == 0:
            ref.assert_matches()


@pytest.mark.parametrize("repeat", range(int(os.environ.get("DOS_GPU_REPEATS", "3"))))
def test_mixed_placements_changing_between_steps_match_adamw(repeat):
    seed = _seed()
    model = tiny_llama(torch.bfloat16, "cuda", seed=seed)
    opt = DeepOptimizerStates(model, lr=3e-3, subgroup_size=sum(p.numel() for p in model.parameters()) // 10,
                              schedule="cpu")
    count = len(opt.layout.subgroups)
    gen = torch.Generator().manual_seed(seed)
    ref = ReferenceAdamW(opt)
    data = torch.Generator().manual_seed(seed + 1)
    for step in range(12):
        opt.schedule = [(R, S, C)[int(i)] for i in torch.randint(0, 3, (count,), generator=gen)]
        opt.zero_grad()
        loss_of(model, data).backward()
        ref.step()
        opt.step()
        if step % 4 == 3:  # reading evicts; the others stay resident across steps
            ref.assert_matches(rtol=2e-6)  # a subgroup alternates between the CPU's and the GPU's kernels
    assert opt.residents.counters.admitted > 0 and opt.residents.counters.evicted > 0


def test_auto_on_a_roomy_gpu_keeps_everything_resident_and_matches():
    seed = _seed()
    model = _stack(seed)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=1_000_000)
    ref = ReferenceAdamW(opt)
    _train(model, opt, ref, seed, steps=6)
    assert opt.placements == [R] * len(opt.layout.subgroups)
    assert opt.last_update.resident_subgroups == len(opt.layout.subgroups) and opt.last_update.h2d_bytes == 0
    assert opt.memory()["device_resident_bytes"] == 12 * opt.layout.numel
    ref.assert_matches()


def test_a_tight_budget_is_never_exceeded_and_the_result_is_exact():
    """Under a budget that leaves room for about a quarter of the states beside the update's buffers (all
    of them would need 40 MB more, none would fit with 25 MB less: the outcome does not hang on the last MB
    of the measured need): the
    peak stays within it, and the result equals torch's AdamW fed the same gradients (two separate bf16
    runs would drift apart at the first bf16 rounding that a 1-ulp fp32 difference flips, so the reference
    rides along in both runs)."""
    seed = _seed()
    model = _stack(seed)
    numel = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # every state on the host here ("offload"): the need is measured without residents to subtract
    with DeepOptimizerStates(model, lr=1e-3, subgroup_size=1_000_000, schedule="offload", max_grad_norm=1.0) as opt:
        ref = ReferenceAdamW(opt)
        _train(model, opt, ref, seed, steps=3)  # what forward + backward + the reference take
        need = opt.memory()["gpu_need_bytes"]  # as the optimizer measures it (the update's transients apart)
    assert need, "the optimizer measured no need for forward + backward"
    del model, opt, ref
    gc.collect()  # the first optimizer and its model, held by reference cycles: not the second run's need
    model = _stack(seed)
    update_buffers = (16 * DEFAULT_STAGING_SLOTS + 8 + 4) * 1_000_000  # slots, the CPU path's and residents' scratch
    budget = need + MIN_HEADROOM_BYTES + update_buffers + 3 * numel  # a quarter of the states' 12 B/param
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=1_000_000, gpu_memory_budget=budget, max_grad_norm=1.0)
    opt.calibrate()  # once per machine, before training (its own buffers are not the budget's business)
    ref = ReferenceAdamW(opt)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _train(model, opt, ref, seed + 1, steps=8)
    places = opt.placements
    assert 0 < places.count(R) < len(places), (places.count(R), len(places), need, opt.memory())
    assert torch.cuda.max_memory_allocated() <= budget
    ref.assert_matches(rtol=2e-6)


def test_an_overlapped_update_keeps_the_next_forward_within_a_tight_budget():
    """With ``overlap`` the update holds its staging slots into the next forward. Under a budget with room
    for 1.5 of them beside the need measured in a first run, the headroom and the CPU path's scratch (which
    the planner sets aside for the biggest subgroup, though this all-staged run allocates none), the update
    gets one slot, not the four that the memory free at the step (2 GiB of activations gone) would give:
    four would take the next forward 384 MiB past the budget. The half slot to spare lets the second run's
    need differ from the first's by up to 256 MiB either way. The peak stays within the budget, the result
    equals torch's AdamW."""
    seed = _seed()
    width, layers, rows, subgroup = 2048, 32, 16384, 32 * 2**20  # four subgroups; a slot 512 MiB

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(
            "cuda", torch.bfloat16)

    def train(model, opt, ref, steps: int) -> None:
        gen = torch.Generator("cuda").manual_seed(seed)  # made on the GPU: the next forward meets the update
        for _ in range(steps):
            opt.zero_grad()
            x = torch.randn(rows, width, generator=gen, device="cuda", dtype=torch.bfloat16)
            model(x).float().pow(2).mean().backward()
            ref.step(1.0)
            opt.clip_grad_norm_(1.0)
            opt.step()
        opt.synchronize()

    kwargs = {"lr": 1e-3, "subgroup_size": subgroup, "schedule": "gpu", "overlap": True}
    model = build()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with DeepOptimizerStates(model, **kwargs) as opt:
        ref = ReferenceAdamW(opt)
        train(model, opt, ref, steps=3)
        need = opt.memory()["gpu_need_bytes"]  # the update's own buffers apart (``MemoryBudget.note_update``)
    assert need
    del model, opt, ref
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # else the second run's first step would read the first run's peak
    model = build()
    slot = 16 * subgroup
    budget = need + MIN_HEADROOM_BYTES + (8 + 4) * subgroup + slot * 3 // 2
    opt = DeepOptimizerStates(model, gpu_memory_budget=budget, **kwargs)
    ref = ReferenceAdamW(opt)
    train(model, opt, ref, steps=1)  # the reference's own states come at its first step (run 1's need has them)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train(model, opt, ref, steps=6)
    peak = torch.cuda.max_memory_allocated()
    assert opt.plan.slots == 1, (opt.plan.slots, need, budget, opt.memory())  # memory(): the need of this run
    assert peak <= budget, (peak, budget, need, opt.memory())
    ref.assert_matches(rtol=2e-6)


@pytest.mark.parametrize("schedule", ["cpu", 3, "mixed"], ids=str)
def test_streamed_gradients_equal_the_gathered_ones_bit_for_bit(schedule):
    """stream_grads sends the CPU path's gradients down during backward on a side stream and multiplies
    them on the host: the same fp32 operations as gathering them at the step, so the runs agree exactly.
    (Under "auto" the two runs would plan differently, and a subgroup's kernel, the CPU's or the GPU's,
    decides its last ulp: fixed placements here, with residents in the mix.)"""
    seed = _seed()
    runs = []
    for stream in (True, False):
        model = _stack(seed)
        opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=1_000_000, schedule="cpu" if schedule == "mixed"
                                  else schedule, max_grad_norm=0.01, stream_grads=stream)
        if schedule == "mixed":
            opt.schedule = [(R, S, C)[i % 3] for i in range(len(opt.layout.subgroups))]
        gen = torch.Generator().manual_seed(seed)
        for step in range(6):
            opt.zero_grad()
            for k in range(2):
                x = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
                with opt.accumulating() if k == 0 else contextlib.nullcontext():
                    (model(x).float().pow(2).mean() / 2).backward()
            if stream and R not in opt.placements:
                assert any(p.grad is None for p in model.parameters()), "the CPU path's gradients left the GPU"
            opt.step()
        runs.append([opt.master(p).clone() for p in model.parameters()])
        opt.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
