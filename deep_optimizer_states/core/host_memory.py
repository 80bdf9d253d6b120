"""Host memory for the optimizer states: the capacity check and fast page-locked (pinned) allocation.

Pinned buffers are allocated once, at construction, and reused every step. We allocate pageable memory
and register it with CUDA (cudaHostRegister) instead of going through torch's caching host allocator,
which rounds every request up to a power of two and would waste up to half of a large buffer.

Start-up speed: a fresh buffer's pages do not exist until first touched, and one thread faulting them in
(or cudaHostRegister doing it, single-threaded, inside the driver) runs at a few GB/s, so 80 GB of states
took tens of seconds. We cut each buffer into page-aligned chunks and let a pool of threads fault the
chunks in (torch ops release the GIL), then register each whole buffer once, the buffers in parallel. One
registration per buffer, not per chunk: a copy that spans two separately registered ranges fails on the
GPU ("invalid argument"), and subgroups cut buffers anywhere. The same chunks serve callers that fill
buffers in parallel (``parallel_chunks``), e.g. copying the fp32 masters in.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, NamedTuple, Sequence

import torch

GB = 1e9
HOST_MEMORY_ENV = "DOS_HOST_MEMORY_GB"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIN_CHUNK_BYTES = 2 << 20  # below this, per-chunk overheads (a task, a registration) start to show
MAX_CHUNK_BYTES = 256 << 20  # above this, the pool balances badly and the progress bar moves in jumps
INLINE_BYTES = 64 << 20  # below this, fault-in and copy-in run in the calling thread
PROGRESS_MIN_BYTES = 4 * GB  # smaller allocations never show a progress bar
PROGRESS_DELAY_S = 2.0  # and larger ones only once they have taken this long

log = logging.getLogger(__name__)


class HostSpec(NamedTuple):
    """One flat host buffer to allocate: ``numel`` elements of ``dtype``; ``zero``: fill it with zeros.

    Without ``zero`` the contents are undefined (like torch.empty), but the pages are still faulted in
    (one write per page), so the first real write does not pay for them single-threaded.
    """

    numel: int
    dtype: torch.dtype
    zero: bool = True


def workers() -> int:
    """Threads in the pool: enough to fault pages in at memory speed, few enough not to crowd the host."""
    return min(8, os.cpu_count() or 1)


def format_bytes(n: float) -> str:
    """``12.34 GB`` (decimal gigabytes, as in every message of this module)."""
    return f"{n / GB:.2f} GB"


def host_bytes(specs: Sequence[HostSpec]) -> int:
    """Bytes the buffers of ``specs`` take: what a capacity check for them must count."""
    return sum(s.numel * s.dtype.itemsize for s in (HostSpec(*s) for s in specs))


def available_host_bytes() -> int | None:
    """Bytes of host memory this process may still allocate, or None when it cannot be known.

    ``DOS_HOST_MEMORY_GB`` overrides the reading, for machines whose memory grows on demand (their
    /proc/meminfo starts far below the real limit).
    """
    override = os.environ.get(HOST_MEMORY_ENV)
    if override:
        try:
            gigabytes = float(override)
        except ValueError:
            raise ValueError(f"{HOST_MEMORY_ENV}={override!r} is not a number of gigabytes") from None
        if gigabytes == float("inf"):  # no limit: the check is off
            return None
        if not gigabytes >= 0:
            raise ValueError(f"{HOST_MEMORY_ENV}={override!r}: give a number of gigabytes >= 0 (inf: no check)")
        return int(gigabytes * GB)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_host_capacity(needed_bytes: int, what: str) -> int | None:
    """Raise MemoryError before allocating when the host cannot hold ``needed_bytes``.

    Returns the available bytes (None when unknown), so callers can report both numbers. When short, a
    garbage collection runs first and the reading is taken again: an optimizer dropped inside a reference
    cycle (a user's object that holds it and is held by it; torch keeps a process's first optimizer so too)
    keeps its pinned buffers until the collector runs, and a new one built in its place must not fail for
    memory that is no longer used.
    """
    available = available_host_bytes()
    if available is not None and needed_bytes > available:
        gc.collect()
        available = available_host_bytes()
    if available is not None and needed_bytes > available:
        raise MemoryError(
            f"not enough host memory for {what}: {format_bytes(needed_bytes)} needed, "
            f"{format_bytes(available)} available. Use fewer parameters per process (shard the model), "
            f"free host memory, or, if this machine grows its memory on demand, set "
            f"{HOST_MEMORY_ENV} to the real limit."
        )
    return available


def chunk_bytes_for(nbytes: int) -> int:
    """Chunk size for a buffer of ``nbytes``: about two chunks per worker, a whole number of pages."""
    target = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, nbytes // (2 * workers())))
    return max(PAGE_BYTES, target // PAGE_BYTES * PAGE_BYTES)


def page_chunks(ptr: int, numel: int, element_size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Cut elements [0, numel) of a buffer at address ``ptr`` into [start, end) pieces of about
    ``chunk_bytes``, every inner cut at a page-aligned address.

    Page alignment is what lets each piece be registered with cudaHostRegister on its own: the driver
    widens a range to whole pages, so a cut inside a page would make two registrations overlap.
    """
    if numel <= 0:
        return []
    if PAGE_BYTES % element_size or ptr % element_size:
        raise ValueError(f"element size {element_size} does not tile pages at address {ptr:#x}")
    step = max(PAGE_BYTES, chunk_bytes // PAGE_BYTES * PAGE_BYTES) // element_size
    first = (-ptr) % PAGE_BYTES // element_size  # elements before the first page boundary
    cuts = [0, *range(first + step, numel, step), numel]
    return list(zip(cuts[:-1], cuts[1:]))


def buffer_chunks(t: torch.Tensor) -> list[tuple[int, int]]:
    """The chunks of flat tensor ``t``: those ``host_empty_many`` faulted in and registered it by."""
    return page_chunks(t.data_ptr(), t.numel(), t.element_size(), chunk_bytes_for(t.numel() * t.element_size()))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_enabled(total_bytes: int, desc: str | None) -> bool:
    """Whether a progress bar may show: asked for, and big enough to take more than a moment."""
    return desc is not None and total_bytes >= PROGRESS_MIN_BYTES


def _progress_bar(total_bytes: int, desc: str | None):
    """A tqdm bar in bytes that shows only after PROGRESS_DELAY_S; a silent stand-in without tqdm."""
    if not progress_enabled(total_bytes, desc):
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, delay=PROGRESS_DELAY_S, leave=False)


def _pool() -> ThreadPoolExecutor:
    """The worker pool; its threads use the caller's CUDA device (a fresh thread would use device 0)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        return ThreadPoolExecutor(workers(), initializer=torch.cuda.set_device, initargs=(device,))
    return ThreadPoolExecutor(workers())


def _run(tasks: list[tuple[int, Callable[[], object]]], desc: str | None, inline_small: bool = True) -> list[object]:
    """Run each (bytes, fn) task in the pool with one progress bar over all their bytes; fn's results.
    Tasks of a small total run inline (a pool costs more than it saves there) unless ``inline_small`` is off."""
    if not tasks:
        return []
    if inline_small and sum(n for n, _ in tasks) < INLINE_BYTES:
        return [fn() for _, fn in tasks]
    bar = _progress_bar(sum(n for n, _ in tasks), desc)
    try:
        with _pool() as pool:
            futures = {pool.submit(fn): (i, n) for i, (n, fn) in enumerate(tasks)}
            results: list[object] = [None] * len(tasks)
            for future in as_completed(futures):
                i, n = futures[future]
                results[i] = future.result()
                bar.update(n)
    finally:
        bar.close()
    return results


def parallel_chunks(t: torch.Tensor, fn: Callable[[int, int], None], progress: str | None = None) -> None:
    """Run ``fn(start, end)`` over the chunks of flat tensor ``t`` in the worker pool.

    For filling a buffer from host-side torch ops (they release the GIL), e.g. copying the fp32 masters
    in. The chunks are the ones ``t`` was registered in, so a copy of one chunk never spans two
    registrations. ``fn`` should touch only elements [start, end) of ``t`` (and the same range of other
    buffers of its length).
    """
    size = t.element_size()
    _run([((e - s) * size, lambda s=s, e=e: fn(s, e)) for s, e in buffer_chunks(t)], progress)


def _fault_in(t: torch.Tensor, start: int, end: int, zero: bool) -> None:
    """Make elements [start, end) of ``t`` resident: zero them, or write once per page when not ``zero``."""
    if zero:
        t[start:end].zero_()
    else:  # one element every page from start, then the last one: every page of the range is written
        t[start:end : max(1, PAGE_BYTES // t.element_size())].zero_()
        t[end - 1 : end].zero_()


def _register(ptr: int, nbytes: int) -> bool:
    """cudaHostRegister one range. Runs in a pool thread, so a failure's last-error state stays in that
    thread instead of surfacing later in torch's error check of some unrelated call."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def _unregister_all(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)


def host_empty_many(specs: Sequence[HostSpec], pin: bool, progress: str | None = None) -> list[torch.Tensor]:
    """Flat host tensors for ``specs`` (zero-filled where asked), page-locked when ``pin`` (needs CUDA).

    One pool faults in every chunk of every buffer in parallel, then registers the buffers (one whole
    registration each, in parallel); ``progress`` names a
    progress bar over all their bytes (shown only for big, slow allocations; None: never). A buffer whose
    registration fails falls back to torch's pinned allocator. Checks host capacity for the total first.
    Keep each returned tensor for the buffer's life: when it is freed, its chunks are unregistered.
    """
    specs = [HostSpec(*s) for s in specs]
    total = host_bytes(specs)
    available = check_host_capacity(total, progress or "host buffers")
    started = time.perf_counter()
    if pin:
        torch.cuda.init()
    tensors = [torch.empty(s.numel, dtype=s.dtype) for s in specs]

    tasks = [((e - s) * t.element_size(), lambda i=i, s=s, e=e: _fault_in(tensors[i], s, e, specs[i].zero))
             for i, t in enumerate(tensors) for s, e in buffer_chunks(t)]
    _run(tasks, progress)
    nonempty = [i for i, t in enumerate(tensors) if t.numel() > 0] if pin else []
    done = _run([(tensors[i].numel() * tensors[i].element_size(),
                  lambda t=tensors[i]: _register(t.data_ptr(), t.numel() * t.element_size())) for i in nonempty], None,
                inline_small=False)  # in pool threads, always: see _register
    for i, ok in zip(nonempty, done):  # every registration's undo first: a failed fallback must not leak them
        if ok:
            weakref.finalize(tensors[i], _unregister_all, [tensors[i].data_ptr()])
    for i, ok in zip(nonempty, done):
        if not ok:  # use torch's allocator as before
            log.warning("cudaHostRegister failed for a %s buffer; using torch's pinned allocator",
                        format_bytes(tensors[i].numel() * tensors[i].element_size()))
            tensors[i] = torch.empty(0)  # free the pageable buffer before taking the pinned one
            try:
                tensors[i] = torch.empty(specs[i].numel, dtype=specs[i].dtype, pin_memory=True)
            except RuntimeError as e:
                raise MemoryError(f"cannot pin {format_bytes(specs[i].numel * specs[i].dtype.itemsize)} of host "
                                  f"memory ({e}): the host's lockable memory is exhausted. Free host memory, "
                                  "raise the locked-memory limit (ulimit -l), or shard the model over more "
                                  "processes") from e
            if specs[i].zero:
                tensors[i].zero_()
    seconds = time.perf_counter() - started
    log.info("host buffers: %s in %d (%s), %s available before, %.2f s, %.1f GB/s", format_bytes(total),
             len(specs), "pinned" if pin else "pageable", "?" if available is None else format_bytes(available),
             seconds, total / GB / max(seconds, 1e-9))
    return tensors


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A flat host tensor; page-locked when ``pin`` (needs CUDA) so copies to and from the GPU are DMA.

    Contents undefined, as torch.empty; see ``host_empty_many`` for several at once, zeroed, with progress.
    """
    return host_empty_many([HostSpec(numel, dtype, zero=False)], pin)[0]
