"""``lanes.Queued``: bulk copies held back on the host so that at most ``depth`` are queued on the GPU."""

from __future__ import annotations

import threading

import pytest

from deep_optimizer_states.core.lanes import Done, Queued, happened


class Copy:
    """A stand-in for a CUDA event: it has happened once ``run()`` was called."""

    def __init__(self) -> None:
        self._ran = threading.Event()

    @property
    def ran(self) -> bool:
        return self._ran.is_set()

    def query(self) -> bool:
        return self.ran

    def synchronize(self) -> None:
        self._ran.wait()

    def run(self) -> None:
        self._ran.set()


def test_room_counts_the_copies_that_have_not_run_in_the_order_they_were_queued():
    q = Queued(2)
    a, b, c = Copy(), Copy(), Copy()
    assert q.room() == 2
    q.add(a)
    q.add(b)
    assert q.room() == 0
    b.run()  # one direction's copies run in order: b having run says nothing of a
    assert q.room() == 0
    a.run()
    assert q.room() == 2, "a and b have both run"
    q.add(c)
    assert q.room() == 1


def test_events_that_have_happened_are_not_counted():
    q = Queued(1)
    for done in (Done(), None):
        q.add(done)
    assert q.room() == 1 and happened(Done()) and happened(None)


def test_admit_blocks_until_the_oldest_copy_has_run():
    q = Queued(1)
    first = Copy()
    q.add(first)
    admitted = threading.Event()

    def admit():
        q.admit()
        admitted.set()

    t = threading.Thread(target=admit)
    t.start()
    assert not admitted.wait(0.05), "admitted while the copy queued before had not run"
    first.run()
    assert admitted.wait(5), "still blocked after the copy ran"
    t.join()


def test_a_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Queued(0)
