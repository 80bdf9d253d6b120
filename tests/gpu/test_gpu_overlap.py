"""On a GPU: ``overlap=True`` with real streams and the update on its own thread, bit for bit against the
same optimizer without overlap (each forward's loss, then masters, states and params).

A stack of bf16 linear layers (cuBLAS GEMMs and elementwise kernels: deterministic run to run), 12 M
params in subgroups of 1 M, so the next forward reaches layers whose subgroups are still being updated.
"""

import copy
import os

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates, Placement

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
R, S, C = Placement.RESIDENT, Placement.STAGED, Placement.CPU


def _stack(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)]).to("cuda", torch.bfloat16)


def _losses(model, opt, seed: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        out.append(loss.detach().clone())
        loss.backward()
        opt.step()
    return out


@pytest.mark.parametrize("schedule", ["cpu", 3, "gpu", "mixed", "resident"], ids=str)
@pytest.mark.parametrize("stream", [False, True], ids=["gathered", "streamed"])
def test_overlap_equals_the_synchronous_update_bit_for_bit(schedule, stream):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    model = _stack(seed)
    twin = copy.deepcopy(model)
    kwargs = dict(lr=1e-3, subgroup_size=1_000_000, max_grad_norm=1.0, stream_grads=stream)
    ours = DeepOptimizerStates(model, overlap=True, **kwargs)
    ref = DeepOptimizerStates(twin, **kwargs)
    count = len(ours.layout.subgroups)
    for opt in (ours, ref):
        if schedule == "mixed":
            opt.schedule = [(R, S, C)[i % 3] for i in range(count)]
        elif schedule == "resident":
            opt.schedule = [R] * count
        else:
            opt.schedule = schedule
    got, want = _losses(model, ours, seed, 6), _losses(twin, ref, seed, 6)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: the forward read params the update had not written yet"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(ours.master(p), ref.master(q))
        assert torch.equal(p, q)
        assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
