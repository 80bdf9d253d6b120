"""Lanes: named CUDA streams with event helpers, and their synchronous stand-in on the CPU.

Every cross-lane dependency in the engine is an event recorded on one lane and waited on by another;
on the CPU the work runs in program order, so the same engine code needs no events there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class _Done:
    """An event that has already happened (CPU lanes run synchronously)."""

    def synchronize(self) -> None:
        pass


class Lane:
    """One ordered queue of device work: a CUDA stream, or the program order on the CPU."""

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        self.stream = torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Enqueue the enclosed work on this lane."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def record(self):
        """An event that completes when all work enqueued on this lane so far has completed."""
        return _Done() if self.stream is None else self.stream.record_event()

    def wait(self, event) -> None:
        """Make later work on this lane wait for ``event`` (without blocking the host)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def current_point(device: torch.device):
    """An event at the current position of the caller's stream: work before it (backward) is visible."""
    return torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None
