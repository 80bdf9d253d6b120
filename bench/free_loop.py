"""The timed loop as a training loop runs it: no synchronize but the loss read, and where the host waited.

Both harnesses (bench/run_system.py on one GPU, bench/dist_run.py per rank) time their iterations here. One
iteration more than counted is run: the first starts after a synchronize, which lets an update left running
past ``step()`` (overlap) get ahead before the clock starts, so it is shorter than the others (rows before
2026-11-30's thirteenth session counted it in the median). Besides each wall, the host seconds spent in
each call: forward (its waits for an overlapped update are host waits), backward (its hooks' waits),
step, and the loss read (the GPU catching up); a wall far above the others says in which call it went.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

PARTS = ("forward", "backward", "step", "loss_read")


def free_running(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
                 step: Callable[[], None], iters: int,
                 after_each: Callable[[], None] | None = None) -> tuple[float, list[float], list[dict], list[float]]:
    """``iters`` + 1 iterations; returns the first wall apart, the counted walls, each counted iteration's
    host seconds per call (``PARTS``), and every iteration's loss. The caller synchronizes before.
    ``after_each`` runs after each iteration's loss read, the first included (its time counts in the next
    wall: reading the allocator's peak, a few microseconds on the host)."""
    walls, splits, losses = [], [], []
    last = time.perf_counter()
    for _ in range(iters + 1):
        loss = forward()
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        losses.append(loss.item())
        now = time.perf_counter()
        walls.append(now - last)
        splits.append(dict(zip(PARTS, (round(t1 - last, 4), round(t2 - t1, 4), round(t3 - t2, 4),
                                       round(now - t3, 4)))))
        last = now
        if after_each is not None:
            after_each()
    return walls[0], walls[1:], splits[1:], losses
