"""Resident subgroups: fp32 master, exp_avg and exp_avg_sq kept in GPU memory across steps.

A resident subgroup is updated in place on the GPU with no PCIe traffic; while it is resident its GPU copy
is the truth and its host copy is stale. Anything that reads or writes the host copy (``opt.state``,
``state_dict``, ``master``, ``load_state_dict``, an edited weight) first *evicts* the subgroups it touches:
their states are copied back to the host and the GPU memory is freed. The next step admits them again
(one host-to-GPU copy) if the plan still wants them there. An admission that finds no GPU memory leaves the
subgroup on the CPU path for that step: training goes on, and the event is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .layout import Subgroup

RESIDENT_BYTES_PER_ELEMENT = 12  # fp32 master, exp_avg, exp_avg_sq


@dataclass
class ResidentCounters:
    """What residency did since the optimizer was built (telemetry)."""

    admitted: int = 0  # subgroups copied in
    evicted: int = 0  # subgroups copied back to the host
    failed: int = 0  # admissions that found no GPU memory (the subgroup took the CPU path)


class Residents:
    """The GPU copies of resident subgroups' states, keyed by subgroup index."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._states: dict[int, tuple[Subgroup, torch.Tensor]] = {}
        self.counters = ResidentCounters()
        self.before_evict: Callable[[int], None] | None = None  # told the bytes held before an eviction

    def __contains__(self, sg: Subgroup) -> bool:
        return sg.index in self._states

    def __len__(self) -> int:
        return len(self._states)

    def bytes(self) -> int:
        """GPU bytes the resident states hold now."""
        return sum(t.numel() * t.element_size() for _, t in self._states.values())

    def tensors(self, sg: Subgroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of a resident subgroup, on the GPU."""
        p, m, v = self._states[sg.index][1].unbind(0)
        return p, m, v

    def allocate(self, sg: Subgroup) -> bool:
        """Make room for ``sg`` (its states are copied in by ``copy_in``); False when the GPU has none."""
        if sg.index in self._states:
            return True
        try:
            buf = _empty_states(sg.numel, self.device)
        except (torch.cuda.OutOfMemoryError, MemoryError):
            self.counters.failed += 1
            return False
        self._states[sg.index] = (sg, buf)
        self.counters.admitted += 1
        return True

    def copy_in(self, sg: Subgroup) -> None:
        """GPU states of ``sg`` := its host states (enqueue on the caller's stream)."""
        for dst, src in zip(self.tensors(sg), (sg.master, sg.exp_avg, sg.exp_avg_sq)):
            dst.copy_(src, non_blocking=True)

    @torch.no_grad()
    def evict(self, keep: set[int] | None = None, only: set[int] | None = None) -> int:
        """Copy back to the host and free every resident subgroup not in ``keep`` (and, if given, in
        ``only``); returns how many. Synchronous: the host copies are current when it returns."""
        out = [i for i in self._states if (keep is None or i not in keep) and (only is None or i in only)]
        if not out:
            return 0
        if self.before_evict is not None:
            self.before_evict(self.bytes())
        if self.device.type == "cuda":  # the last update (or admission) must have finished writing them
            torch.cuda.current_stream(self.device).synchronize()
        for i in out:
            sg, _ = self._states[i]
            for dst, src in zip((sg.master, sg.exp_avg, sg.exp_avg_sq), self.tensors(sg)):
                dst.copy_(src)
            del self._states[i]
        self.counters.evicted += len(out)
        return len(out)


def _empty_states(numel: int, device: torch.device) -> torch.Tensor:
    """One allocation for a subgroup's three fp32 states (a separate function: tests inject failures here)."""
    return torch.empty(3, numel, dtype=torch.float32, device=device)
