"""The CPU path's params going up through a kernel (``mapped.py``): the copy is bit for bit, NaN payloads
included, and a buffer that is not pinned is refused with what it needs. The mapping itself needs a GPU
(tests/gpu/test_gpu_mapped.py)."""

import os

import pytest
import torch

from deep_optimizer_states.core.layout import Layout
from deep_optimizer_states.core.mapped import copy_by_kernel, mapped_view


def _bits(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype``: NaNs with payloads, infinities, subnormals and signed zeros among them."""
    as_int = {2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(as_int)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(as_int).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_copy_by_kernel_keeps_every_bit(dtype):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    src = _bits(dtype, 10_000, gen)
    assert src.isnan().any()  # payloads a multiply by one could change
    dst = torch.zeros_like(src)
    copy_by_kernel(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_copy_by_kernel_casts_as_torch_does():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    src = torch.randn(10_000, generator=gen) * 1e3
    dst, want = torch.empty(10_000, dtype=torch.bfloat16), torch.empty(10_000, dtype=torch.bfloat16)
    copy_by_kernel(dst, src)
    want.copy_(src)
    assert torch.equal(dst, want)


def test_scatter_params_through_a_copy_writes_what_copy_does():
    """A subgroup cut across params: through ``copy_by_kernel`` each param gets what ``copy_`` gives it."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (700, 1300, 500)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    src = torch.randn(2500, generator=gen)  # fp32 masters: rounded into the bf16 params
    for ps in (params, twins):
        layout = Layout([(ps, [f"p{i}" for i in range(len(ps))])], 900, torch.device("cpu"))
        assert len(layout.subgroups) > 1 and any(len(sg.pieces) > 1 for sg in layout.subgroups)
        for sg in layout.subgroups:
            sg.scatter_params(src[sg.start : sg.end], copy=copy_by_kernel if ps is params else None)
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
    assert any(p.abs().sum() > 0 for p in params)


def test_a_buffer_not_pinned_is_refused():
    with pytest.raises(ValueError, match="pinned"):
        mapped_view(torch.zeros(8), torch.device("cuda"))
