"""The GPU memory budget: how much of the GPU the optimizer may fill with resident states and staging slots.

The budget is the most this process should have allocated on the GPU at any moment: the model's params,
grads and activations, plus what the optimizer keeps there. Its default is the memory the process may use
(the device, or less under ``torch.cuda.set_per_process_memory_fraction``) less a margin for fragmentation
and other libraries. What forward and backward need is measured, not guessed: at each step the peak of the
caching allocator since the last step, less what the optimizer held when it was reached (resident states,
slots filled ahead, and, where the last update ran beside this forward and backward under ``overlap``, that
update's own buffers), is what the model needed beside them. torch's peak statistics are never reset (users
read them too): a rise of the peak is what tells us the model needed more, and so, once a step as backward
begins, does the memory allocated then less what we hold (``sample``: a rise the peak hides). Residents may
fill what is left of the budget after that need and a headroom; the planner decides which subgroups.
"""

from __future__ import annotations

from typing import Protocol

import torch

DEFAULT_MARGIN_FRACTION = 0.05  # of what the process may use, kept free by the default budget
MIN_MARGIN_BYTES = 1 << 30
HEADROOM_FRACTION = 0.03  # of the budget, kept free beside the measured need (the need moves a little)
MIN_HEADROOM_BYTES = 512 << 20


class MemoryProbe(Protocol):
    """Where the budget reads the device's memory (torch.cuda on a GPU; a fake one in tests)."""

    def total(self) -> int: ...  # the device's memory

    def limit(self) -> int: ...  # the most this process may allocate (the per-process fraction applied)

    def allocated(self) -> int: ...

    def peak(self) -> int: ...  # the caching allocator's peak of allocated bytes

    def free(self) -> int: ...  # what could still be allocated now (free on the device plus our cache)


class CudaProbe:
    """The memory of one CUDA device, read from torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def limit(self) -> int:
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
        if get_fraction is None:
            return self.total()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return int(get_fraction(index) * self.total())

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def free(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = self.allocated()
        free += torch.cuda.memory_reserved(self.device) - allocated
        return max(0, min(free, self.limit() - allocated))


def validate_budget(spec: int | float | None) -> int | float | None:
    """``spec`` if it is None, a fraction in (0, 1] of the device, or a byte count > 1; else a ValueError."""
    if spec is None:
        return None
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise ValueError(f"gpu_memory_budget must be bytes (an int), a fraction of the device in (0, 1], or None "
                         f"(the device less a margin); got {spec!r}")
    if isinstance(spec, float) and not 0 < spec <= 1:
        raise ValueError(f"gpu_memory_budget={spec!r}: a float is a fraction of the device and must lie in (0, 1]; "
                         "give bytes as an int (e.g. 40 * 2**30)")
    if isinstance(spec, int) and spec < 1 << 20:
        raise ValueError(f"gpu_memory_budget={spec} bytes is less than 1 MiB: give bytes (e.g. 40 * 2**30), or a "
                         "float fraction of the device (e.g. 1.0 for all of it)")
    return spec


class MemoryBudget:
    """The budget of one optimizer and the need of forward + backward it has measured."""

    def __init__(self, spec: int | float | None, probe: MemoryProbe | None) -> None:
        self.spec = validate_budget(spec)
        self.probe = probe
        self.need: int | None = None  # bytes forward + backward needed beside our residents (None: not seen)
        self.ours_at_need: int | None = None  # ... and what the optimizer held at the peak that set it
        self._peak_seen = 0
        self._evictions: list[tuple[int, int]] = []  # since the last step: (allocator peak, resident bytes before)
        self._fills: list[tuple[int, int]] = []  # since the last step: (allocator peak, bytes filled ahead before)
        self._updates: list[tuple[int, int]] = []  # since the last observe: (allocator peak, update's bytes before)
        self._update_held = 0  # GPU bytes the update holds of its own now

    @property
    def active(self) -> bool:
        """Whether there is a device memory to budget (not on a CPU-only run)."""
        return self.probe is not None

    def bytes(self) -> int:
        """The budget in bytes: what was asked for, never more than the process may allocate."""
        limit = self.probe.limit()
        if self.spec is None:
            return limit - max(MIN_MARGIN_BYTES, int(DEFAULT_MARGIN_FRACTION * limit))
        asked = int(self.spec * self.probe.total()) if isinstance(self.spec, float) else self.spec
        return min(asked, limit)

    def headroom(self) -> int:
        return max(MIN_HEADROOM_BYTES, int(HEADROOM_FRACTION * self.bytes()))

    def observe(self, resident_bytes: int) -> None:
        """At a step, before the update allocates: learn what forward + backward needed beside the
        ``resident_bytes`` held through them and what the last update held then (``note_update``). Only a
        moved peak says something new (a reset by the user makes it fall: it is read again from there); the
        need only grows."""
        peak = self.probe.peak()
        if peak != self._peak_seen or self.need is None:
            ours = resident_bytes + self._at_peak(self._updates, self._update_held)
            seen = max(0, peak - ours)
            if self.need is None or seen >= self.need:
                self.need, self.ours_at_need = seen, ours
        self._peak_seen = peak
        self._updates.clear()

    def note_eviction(self, held: int) -> None:
        """Residents are about to leave between steps, ``held`` bytes of them held until now."""
        if self.active:
            self._evictions.append((self.probe.peak(), held))

    def held_at_peak(self, held_now: int) -> int:
        """The resident bytes held when the allocator reached its peak since the last step: those held
        before the first eviction after which the peak has not moved (an eviction after backward, by an edit
        or a state read, must not count the evicted states as the model's), else ``held_now`` (the peak came
        after every eviction, or there was none)."""
        return self._at_peak(self._evictions, held_now)

    def note_fill(self, filled: int) -> None:
        """Slots are about to be filled ahead of the update, ``filled`` bytes of them allocated this step so
        far (told once per batch of fills: within a batch only their allocations move the peak, and the
        batch's last one reaches it, with all of them held)."""
        if self.active:
            self._fills.append((self.probe.peak(), filled))

    def filled_at_peak(self, filled_now: int) -> int:
        """The bytes filled ahead (this step's, dropped ones too) held when the allocator reached its peak:
        those allocated before the first batch of fills after which the peak has not moved (the peak came
        before that batch, with the earlier ones held), else ``filled_now`` (it came after every batch). Counted
        out of the need, as the residents held then are: what forward and backward reached on top of them
        is still measured."""
        return self._at_peak(self._fills, filled_now)

    def _at_peak(self, notes: list[tuple[int, int]], now: int) -> int:
        """The bytes noted just before the first event (eviction, batch of fills, update) after which the
        allocator's peak has not moved: they were held when it was reached; else ``now``."""
        peak = self.probe.peak() if self.active else None
        return next((held for at, held in notes if at == peak), now)

    def note_update(self, held: int) -> None:
        """The update holds ``held`` GPU bytes of its own from now on (``core.update_memory``: told once its
        buffers are allocated, before it lets a slot filled ahead go, and before its end, 0; from its own
        thread under ``overlap``). Run beside the next forward and backward, those bytes raise the peak
        ``observe`` reads: the ones held when it was reached are not the model's need. Without this, the need
        would count the update's slots, and the room for them (``Planner.slots_that_fit``) would count them
        once more. Told after an allocation, a peak reached before it counts what was held before (never
        more than was there), unless the peak is what is allocated now, ``held`` with it."""
        if self.active:
            peak, before = self.probe.peak(), self._update_held
            if held > before and peak == self.probe.allocated():
                before = held
            self._updates.append((peak, before))
        self._update_held = held

    def sample(self, ours: int) -> None:
        """Once a step, as backward begins: the memory allocated now less ``ours`` (the residents and slots
        filled ahead held now) and what the update holds now (read before and after, the sample dropped if
        it moved between) is the model's, a floor of its need. The peak alone can miss a rise: a model's peak
        below one it reached beside the update's buffers (which ``observe`` takes out) never moves the
        allocator's counter (a longer batch after the update ended). It raises a need measured already, never
        sets the first one (the first peak does: a sample taken early in backward is below it)."""
        if not self.active or self.need is None:
            return
        held = self._update_held
        allocated = self.probe.allocated()
        if self._update_held != held:  # the update allocated or let go meanwhile (its own thread)
            return
        seen = max(0, allocated - ours - held)
        if seen > self.need:
            self.need, self.ours_at_need = seen, ours + held

    def new_step(self) -> None:
        """A step is over (taken or skipped): evictions and fills from here on belong to the next one."""
        self._evictions.clear()
        self._fills.clear()

    def after_update(self) -> None:
        """The update's own transients (slots, scratch) may have raised the peak: that is not the model's."""
        self._peak_seen = self.probe.peak()

    def resident_room(self) -> int:
        """Bytes residents (and the update's transients) may take: the budget less the measured need and
        the headroom; 0 before anything was measured."""
        if not self.active or self.need is None:
            return 0
        return max(0, self.bytes() - self.need - self.headroom())

    def free(self) -> int:
        """What may still be allocated now within the budget."""
        return max(0, min(self.probe.free(), self.bytes() - self.probe.allocated()))
