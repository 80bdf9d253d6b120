"""On a GPU: pinned host memory read by a kernel through its device mapping (``mapped.py``), the way the CPU
path's params go up."""

import os
import warnings

import pytest
import torch

from deep_optimizer_states.core.host_memory import HostSpec, host_empty_many
from deep_optimizer_states.core.mapped import copy_by_kernel, mapped_view

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("alloc", ["torch", "registered"])
def test_a_kernel_reads_the_host_memory_as_it_is_now(dtype, alloc):
    """Through the view a kernel copies the host bits (torch's pinned allocator, and our registered buffers,
    at an offset as a subgroup's slice is), and a later write on the host is what the next copy reads."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n = 3_000_001
    if alloc == "torch":
        host = torch.empty(n, dtype=dtype).pin_memory()
    else:
        host = host_empty_many([HostSpec(n + 1000, dtype, zero=False)], pin=True)[0][1000:]
    host.copy_(torch.randn(n, generator=gen).to(dtype))
    view = mapped_view(host, torch.device("cuda"))
    assert view.is_cuda and view.dtype == dtype and view.shape == host.shape
    dst = torch.empty(n, dtype=dtype, device="cuda")
    copy_by_kernel(dst, view)
    assert torch.equal(dst.cpu(), host)
    host.mul_(-2)
    copy_by_kernel(dst, view)
    assert torch.equal(dst.cpu(), host)
    to_bf16 = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    copy_by_kernel(to_bf16, view)
    assert torch.equal(to_bf16.cpu(), host.to(torch.bfloat16))


def test_without_a_mapping_the_params_go_up_by_the_copy_engine_and_say_so(monkeypatch):
    """Where the host memory cannot be mapped (no libcuda, as on ROCm), the update warns once and takes the
    copy engine: the same params as with the mapping."""
    from deep_optimizer_states import DeepOptimizerStates
    from deep_optimizer_states.core import engine

    def no_mapping(host, device):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(engine, "PARAMS_UP_MAPPED", True)
    seed = int.from_bytes(os.urandom(4), "little")
    runs = []
    for broken in (False, True):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to("cuda", torch.bfloat16)
        opt = DeepOptimizerStates(model, lr=1e-3, schedule="cpu", subgroup_size=50_000)
        if broken:
            monkeypatch.setattr(engine, "mapped_view", no_mapping)
        gen = torch.Generator().manual_seed(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 256, generator=gen).to("cuda", torch.bfloat16)).float().pow(2).mean().backward()
                opt.step()
        assert len([w for w in caught if "copy engine" in str(w.message)]) == broken, "told once, when it is"
        assert opt.engine._mapped and all((view is None) == broken for _, view in opt.engine._mapped.values())
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
