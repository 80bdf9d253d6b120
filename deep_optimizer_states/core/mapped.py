"""Pinned host memory seen from the GPU: a CUDA tensor over its device mapping.

Pinned memory (cudaHostAlloc, or cudaHostRegister with default flags) is mapped into the GPU's address space
on every system with unified addressing. A kernel that reads such a tensor pulls the bytes over PCIe itself,
on the SMs, instead of through a copy engine. That matters because each direction of the link runs one
copy-engine copy at a time, in the order they were enqueued, whatever their streams: a small copy that the
next forward waits for would queue behind the big staged fills enqueued before it (overlap.md, call 60).
"""

from __future__ import annotations

import ctypes
import functools

import torch

_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _device_pointer(host_ptr: int) -> int:
    """The GPU's address of a pinned host address (equal to it where the device can use host pointers)."""
    out = ctypes.c_uint64()
    rc = _driver().cuPointerGetAttribute(ctypes.byref(out), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                         ctypes.c_uint64(host_ptr))
    if rc != 0:
        raise RuntimeError(f"host memory at {host_ptr:#x} has no device mapping (cuPointerGetAttribute: error {rc}); "
                           "it must be pinned (pin_memory() or cudaHostRegister)")
    return out.value


class _Interface:
    """What torch.as_tensor reads (__cuda_array_interface__ v2: no stream, the caller orders the reads)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` over the memory of the pinned, contiguous CPU tensor ``host`` (which it keeps
    alive). Copy from it with a kernel (an elementwise op), not ``copy_`` between equal dtypes, which torch
    hands to the copy engine."""
    if host.device.type != "cpu" or not host.is_contiguous() or not host.is_pinned():
        raise ValueError("mapped_view needs a contiguous, pinned CPU tensor")
    nbytes = host.numel() * host.element_size()
    with torch.cuda.device(device):
        raw = torch.as_tensor(_Interface(_device_pointer(host.data_ptr()), nbytes), device=device)
    view = raw.view(host.dtype).view(host.shape)
    view._dos_host = host  # the view does not own the memory
    return view


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_by_kernel(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst = src`` (cast to dst's dtype) by an elementwise kernel, never the copy engine: for equal dtypes a
    bitwise or with 0 over integer views of both (bit for bit, NaN payloads included), else torch's cast."""
    if dst.dtype == src.dtype:
        as_int = _INT_OF_SIZE[dst.element_size()]
        torch.bitwise_or(src.view(as_int), 0, out=dst.view(as_int))
    else:
        dst.copy_(src)
