"""On a GPU: pinned host memory read by a kernel through its device mapping (``mapped.py``), the way the CPU
path's params go up."""

import os

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
