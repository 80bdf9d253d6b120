"""Host memory for the optimizer states: the capacity check and page-locked (pinned) allocation.

Pinned buffers are allocated once, at construction, and reused every step. We allocate pageable memory
and register it with CUDA (cudaHostRegister) instead of going through torch's caching host allocator,
which rounds every request up to a power of two and would waste up to half of a large buffer.
"""

from __future__ import annotations

import os
import weakref

import torch

GB = 1e9
HOST_MEMORY_ENV = "DOS_HOST_MEMORY_GB"


def available_host_bytes() -> int | None:
    """Bytes of host memory this process may still allocate, or None when it cannot be known.

    ``DOS_HOST_MEMORY_GB`` overrides the reading, for machines whose memory grows on demand (their
    /proc/meminfo starts far below the real limit).
    """
    override = os.environ.get(HOST_MEMORY_ENV)
    if override:
        try:
            return int(float(override) * GB)
        except ValueError:
            raise ValueError(f"{HOST_MEMORY_ENV}={override!r} is not a number of gigabytes") from None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_host_capacity(needed_bytes: int, what: str) -> None:
    """Raise MemoryError before allocating when the host cannot hold ``needed_bytes``."""
    available = available_host_bytes()
    if available is not None and needed_bytes > available:
        raise MemoryError(
            f"not enough host memory for {what}: {needed_bytes / GB:.2f} GB needed, "
            f"{available / GB:.2f} GB available. Use fewer parameters per process (shard the model), "
            f"free host memory, or, if this machine grows its memory on demand, set "
            f"{HOST_MEMORY_ENV} to the real limit."
        )


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A flat host tensor; page-locked when ``pin`` (needs CUDA) so copies to and from the GPU are DMA."""
    t = torch.empty(numel, dtype=dtype)
    if pin and numel > 0:
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        weakref.finalize(t, _unregister, ptr)  # callers keep this base tensor for the buffer's life
    return t
