"""Staged subgroups' states copied into GPU slots during backward, ahead of the update that reads them.

Under ``stream_grads`` the host-to-GPU direction of the link idles through backward: only the CPU path's
gradients move, GPU to host. A staged subgroup's master, exp_avg and exp_avg_sq do not depend on this
step's gradients, so they can come in then, into slots of their own (within the GPU memory the planner
allows, beside what forward and backward were measured to need); the update then finds them there and
only computes and flushes them, and its window carries that much less of the heavier direction.

The last update may still be flushing staged subgroups when backward begins (``overlap``): a slot's copy
then waits for that subgroup's own flush (``UpdateInFlight.host_final``), not for the whole update, so the
link carries this step's way in beside the last step's way out.

Exactness: the host copy is the truth throughout (nothing is written before the update), so a copy taken
ahead is simply dropped whenever the host copy may change before the step (a write through ``opt.state``,
a master re-read from an edited weight, a loaded checkpoint, a step that is skipped) and the update stages
that subgroup the usual way.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .lanes import Done, Event, Lane, current_point
from .layout import Subgroup
from .slots import FILL_BYTES_PER_ELEMENT, Ahead, slot_tensors


class Prefetch:
    """The slots filled ahead of the next update, keyed by subgroup index."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lane = Lane(device)
        self.ready: dict[int, Ahead] = {}
        self.filled = 0  # subgroups filled ahead since the optimizer was built (telemetry)
        self.step_bytes = 0  # bytes allocated for fills this step, dropped ones included
        self._bytes = 0
        self._next = 0  # this step: how far down the update's order the fills have come
        self._full = False  # this step: the next fill found no room (the room only shrinks until the step)

    def bytes(self) -> int:
        """GPU bytes the slots filled ahead hold now."""
        return self._bytes

    def pending(self, order: Sequence[Subgroup]) -> bool:
        """Whether subgroups of ``order`` (this step's) are still to fill and may still fit: a final gradient's
        hook asks at every gradient, and once the room ran out nothing more fits until the step."""
        return self._next < len(order) and not self._full

    @torch.no_grad()
    def top_up(self, order: Sequence[Subgroup], room: int, before_fill: Callable[[int], None] | None = None,
               host_final: Callable[[Subgroup], Event | None] = lambda sg: Done()) -> int:
        """Fill slots for the next subgroups of ``order`` (the same list all step), in that order, while
        their slots fit in ``room`` bytes (the first that does not fit ends it: the update takes them in
        this order) and ``host_final(sg)`` gives the event after which their host states are final (the
        last update's flush of that subgroup, which may still be running: the copy waits for it; None, not
        known yet, ends it until the next call); ``before_fill(step_bytes)`` is told before the first slot
        of this call is allocated (within one call only these allocations can move the allocator's peak).
        Returns how many were added. A slot comes from the caller's stream (backward's), whose queued
        kernels may still use the block the allocator hands out: the copies wait for them."""
        added = 0
        while self._next < len(order):
            sg = order[self._next]
            need = FILL_BYTES_PER_ELEMENT * sg.numel
            if need > room:
                self._full = True
                break
            after = host_final(sg)
            if after is None:
                break
            if before_fill is not None and not added:
                before_fill(self.step_bytes)
            try:
                p, m, v = slot_tensors(sg.numel, self.device, rows=3)
            except torch.cuda.OutOfMemoryError:
                self._full = True
                break
            self.lane.wait(current_point(self.device))
            if isinstance(after, torch.cuda.Event):
                self.lane.wait(after)
            with self.lane.run(timed=False):
                for dst, src in ((p, sg.master), (m, sg.exp_avg), (v, sg.exp_avg_sq)):
                    dst.copy_(src, non_blocking=True)
            self.ready[sg.index] = Ahead(p, m, v, self.lane.record(), self.lane.stream)
            room -= need
            added += 1
            self._next += 1
            self._bytes += need
            self.step_bytes += need
        self.filled += added
        return added

    def take(self) -> dict[int, Ahead]:
        """Hand the filled slots to an update (which holds them until its streams are done)."""
        ready, self.ready, self._next, self._bytes, self._full = self.ready, {}, 0, 0, False
        return ready

    def restart(self) -> None:
        """A new step: fills start again from the top of its order (none may be left: see ``drop``)."""
        self._next = self.step_bytes = 0
        self._full = False

    def drop(self, only: set[int] | None = None) -> bool:
        """Forget the slots filled ahead (of the subgroups ``only``, else all): their host copy may change, or
        the step does not take them. Once their copies have run, so that their memory is not reused under
        them. Returns whether any was dropped."""
        out = [i for i in self.ready if only is None or i in only]
        if not out:
            return False
        self.lane.synchronize()
        for i in out:
            self._bytes -= FILL_BYTES_PER_ELEMENT * self.ready.pop(i).p.numel()
        return True
