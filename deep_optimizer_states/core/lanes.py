"""Lanes: named CUDA streams with event helpers, and their synchronous stand-in on the CPU.

Every cross-lane dependency in the engine is an event recorded on one lane and waited on by another;
on the CPU the work runs in program order, so the same engine code needs no events there.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Union

import torch


class Done:
    """An event that has already happened (CPU lanes run synchronously)."""

    def synchronize(self) -> None:
        pass


Event = Union[torch.cuda.Event, Done, None]  # a point in a lane's work (None: nothing to wait for)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare "cuda" is the current GPU. Worker threads set it as theirs (a new
    thread starts on GPU 0), and ``torch.cuda.set_device`` refuses a device without an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Lane:
    """One ordered queue of device work: a CUDA stream, or the program order on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._spans: list = []

    @contextlib.contextmanager
    def run(self, label: str = "", timed: bool = True) -> Iterator[None]:
        """Enqueue the enclosed work on this lane, timing it unless ``timed`` is False (a lane whose busy
        time nobody reads must not keep its events); waits belong before, outside the block."""
        if not timed:
            with contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream):
                yield
            return
        if self.stream is None:
            t0 = time.perf_counter()
            yield
            self._spans.append((t0, time.perf_counter(), label))
            return
        with torch.cuda.stream(self.stream):
            begin = self.record(timing=True)
            yield
            self._spans.append((begin, self.record(timing=True), label))

    def _elapsed(self, begin, end) -> float:
        return end - begin if self.stream is None else begin.elapsed_time(end) / 1e3

    def busy_seconds(self) -> float:
        """Time this lane's work took since the last call (after the work has completed); resets."""
        spans, self._spans = self._spans, []
        return sum(self._elapsed(b, e) for b, e, _ in spans)

    def timeline(self, origin: float | torch.cuda.Event) -> list[tuple[float, float, str]]:
        """(start, end, label) of each block since the last ``busy_seconds``, in seconds after ``origin``
        (a ``time.perf_counter()`` value on the CPU, a timing event on the GPU); after the work completed."""
        return [(self._elapsed(origin, b), self._elapsed(origin, e), label) for b, e, label in self._spans]

    @staticmethod
    def window_seconds(first: "Lane", last: "Lane") -> float:
        """From the start of ``first``'s first block to the end of ``last``'s last block (0 if either is idle)."""
        if not first._spans or not last._spans:
            return 0.0
        return first._elapsed(first._spans[0][0], last._spans[-1][1])

    def record(self, timing: bool = False, blocking: bool = False) -> Event:
        """An event that completes when all work enqueued on this lane so far has completed. A host waiting on
        a ``blocking`` one sleeps (CUDA's blocking sync) instead of spinning on a core, which the CPU path's
        AdamW threads and backward's launching thread need while an update runs beside them."""
        if self.stream is None:
            return Done()
        return self.stream.record_event(torch.cuda.Event(enable_timing=timing, blocking=blocking))

    def wait(self, event: Event) -> None:
        """Make later work on this lane wait for ``event`` (without blocking the host)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def synchronize(self) -> None:
        """Block the host until this lane's work has run, sleeping meanwhile (a ``blocking`` event)."""
        if self.stream is not None:
            self.record(blocking=True).synchronize()


def current_point(device: torch.device) -> Event:
    """An event at the current position of the caller's stream: work before it (backward) is visible."""
    return torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None
