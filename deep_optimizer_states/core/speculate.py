"""The CPU path's AdamW started during backward, before the step's global checks are known (``speculate``).

With ``stream_grads`` a CPU-placed subgroup's gradients are final and on the host while backward goes on,
and host memory idles meanwhile. But until ``step()`` the update may still be skipped (an inf/nan gradient
yet to come, on this rank or another), clipped (the global norm needs every gradient), or changed (a new
lr, an edited step count or weight). So a subgroup runs ahead on a copy kept aside: its master, exp_avg and
exp_avg_sq are copied into a spare host buffer, then updated in place with the hyper-parameters and step
counts of that moment, by the same call the update makes (``Job.adam``). ``step()`` keeps the result when
nothing it decides differs (the step is not skipped, every gradient multiplier is exactly 1, the same
hyper-parameters and spans), and otherwise copies the spare back, bit for bit the states before, and the
update takes the subgroup the usual way. A subgroup whose gradients landed after the norm measured so far
already passed the clip's (``over``) stands down before its copy aside: that step will scale its gradients,
and the update takes it the usual way (``step()`` then never keeps it; should it have, the engine updates it
the usual way too). With ``optimizer.STAND_DOWN = "forecast"`` it stands down once that norm, over the share
of the last step's norm measured by the same point, passes the clip's (``GradStream.clip_check``): a clip that
lasts is then seen from the first subgroup, and a wrong forecast costs an undo or a head start. Whatever reads or writes the host states in between
(``opt.state``, ``state_dict``, a weight edit, ``zero_grad``) undoes first. The cost: the copy aside through
host memory, at a time when host memory idles: 24 B per element more with torch's kernel (a copy pass), 12 B
with the bf16 kernel (``bf16_cpu_path``), which writes the copy in its own pass over states it reads anyway;
at most ``count`` subgroups run ahead per step (a spare each, 12 B per element of host memory, allocated
once).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .engine import Engine, Job, bf16_update
from .host_memory import HostSpec, check_host_capacity, format_bytes, host_empty_many
from .layout import Subgroup

SPARE_BYTES_PER_ELEMENT = 12  # fp32 master, exp_avg, exp_avg_sq kept aside
DEFAULT_SPECULATIVE_SUBGROUPS = 16
ROW_ALIGN = 16  # elements: a spare's rows start 64-byte aligned
LAUNCH_SHARE = 1 / 16  # of the CPU path's threads (at least one) left to backward's launching thread while an
# update runs ahead. A quarter instead (4 of 16 on the H200) cut a streamed 1.36B backward from 80.9 to 70.3 ms
# and its step from 277 to 271 ms in bench/stream_backward.py (H200 call 24), but in the iteration of the
# overlapped loop (call 25, one run each) it took 0.369 s against 0.350 s with one core left: fewer updates ran
# ahead (60 kept against 71) and the forward waited longer. Not settled; the earlier default stays.


@dataclass
class _Ahead:
    job: Job
    spare: torch.Tensor  # [3, numel]: the states before
    done: Future | None = None
    copied: int = 0  # elements, from the first, whose states before are in the spare: undo puts those back


class Speculation:
    """At most ``count`` CPU subgroups updated ahead of ``step()``, each undoable from its spare."""

    def __init__(self, count: int, largest: int, local_ranks: int, engine: Engine, launch_share: float = 0.0) -> None:
        """Subgroups run ahead on ``engine``'s CPU worker, each on the kernel its update would take
        (``Engine.takes_bf16``). ``launch_share``: the share of its threads left to backward's launching thread
        (with a GPU) while an update runs ahead."""
        needed = SPARE_BYTES_PER_ELEMENT * largest * count
        check_host_capacity(needed * local_ranks, f"speculate={count}: {count} spare subgroups of "
                            f"{format_bytes(SPARE_BYTES_PER_ELEMENT * largest)} (pass a smaller count)")
        row = -(-largest // ROW_ALIGN) * ROW_ALIGN  # each row aligned for the bf16 kernel's streaming stores
        self._free = [t.view(3, row) for t in host_empty_many(
            [HostSpec(3 * row, torch.float32, zero=False) for _ in range(count)], pin=False)] if largest else []
        self._engine, self._launch_share = engine, launch_share
        self._ahead: dict[int, _Ahead] = {}
        self.kept = 0  # subgroups whose update ran ahead and was kept, since the optimizer was built
        self.undone = 0  # ... and was undone
        self.called_off = 0  # ... was called off before it started
        self.stood_down = 0  # ... stood down, the norm of the gradients landed before it over the clip's

    def __len__(self) -> int:
        return len(self._ahead)

    def start(self, job: Job, landed: object, after: object = None, over: Callable[[], bool] | None = None) -> bool:
        """Update ``job``'s subgroup ahead once its gradients have landed (``landed``: their event or None)
        and its host states are final (``after``: the last update's flush of it, an event, or None), unless
        ``over()`` says then that the step's clip will scale its gradients; False when no spare is free."""
        if not self._free or job.subgroup.index in self._ahead:
            return False
        ahead = self._ahead[job.subgroup.index] = _Ahead(job, self._free.pop())
        ahead.done = self._engine.on_cpu(_run_ahead, ahead, (landed, after), self._launch_share, self._engine, over)
        return True

    def settle(self, jobs: list[Job], keep: bool) -> list[Job]:
        """The step's jobs, each whose same job ran ahead marked so (when ``keep``: the step applies no
        multiplier); every other subgroup ahead is undone. One not started yet (backward ended first) is
        called off, not waited for: it would cost the copy aside for nothing, ahead of the subgroups the next
        forward needs first. Those started are not waited for: the engine's CPU worker, which runs them,
        takes the update's work after them."""
        out = []
        for job in jobs:
            ahead = self._ahead.get(job.subgroup.index)
            if (keep and ahead is not None and ahead.job.hyper == job.hyper and ahead.job.spans() == job.spans()
                    and not ahead.done.cancel() and not _failed(ahead.done) and not _stood_down(ahead.done)):
                self._release(job.subgroup.index)  # its spare is written before anything queued after it runs
                self.kept += 1
                job = dataclasses.replace(job, ran_ahead=ahead.done)
            out.append(job)
        self.undo()
        return out

    def undo(self, subgroups: Iterable[Subgroup] | None = None) -> None:
        """Put back the states before of the subgroups ahead (of ``subgroups``, else all); call off those
        not started."""
        indices = list(self._ahead) if subgroups is None else [sg.index for sg in subgroups if sg.index in self._ahead]
        for i in indices:
            ahead = self._ahead[i]
            if ahead.done is not None and not ahead.done.cancel():
                try:
                    ahead.done.result()
                except BaseException:  # its error is not the caller's: the states before are put back all the same
                    pass
            sg = ahead.job.subgroup
            if ahead.copied:
                with torch.no_grad():
                    for dst, src in zip((sg.master, sg.exp_avg, sg.exp_avg_sq), ahead.spare[:, : ahead.copied]):
                        dst[: ahead.copied].copy_(src)
                self.undone += 1
            elif _stood_down(ahead.done):
                self.stood_down += 1
            else:
                self.called_off += 1
            self._release(i)

    def _release(self, index: int) -> None:
        self._free.append(self._ahead.pop(index).spare)


def _failed(done: Future) -> bool:
    """Whether the task ended with an error (one still running is checked by the engine, which waits for it)."""
    return done.done() and done.exception() is not None


def _stood_down(done: Future | None) -> bool:
    """Whether the task ended without updating (``over``); one still running is not known yet: the engine,
    which waits for it, updates the subgroup itself if it did."""
    return done is not None and done.done() and not done.cancelled() and done.exception() is None \
        and done.result() is False


@torch.no_grad()  # runs on the engine's CPU worker, where the caller's no_grad does not reach
def _run_ahead(ahead: _Ahead, events: tuple, launch_share: float, engine: Engine,
               over: Callable[[], bool] | None = None) -> bool:
    """After ``events`` (each None or an event to synchronize with), on ``launch_share`` of the CPU path's
    threads fewer (at least one fewer, at least one left): backward launches its kernels from a thread that
    must find a core (elementwise work: the results do not depend on the thread count). False, touching
    nothing, where ``over()`` says the clip will scale this step's gradients."""
    sg = ahead.job.subgroup
    for event in events:
        if event is not None:
            event.synchronize()
    if over is not None and over():
        return False
    threads = torch.get_num_threads()
    fewer = max(1, threads - max(1, round(threads * launch_share))) if launch_share else threads
    if fewer != threads:
        torch.set_num_threads(fewer)
    try:
        if engine.takes_bf16(sg):  # its gradients landed in bf16; the params it rounds go up if kept. The
            # kernel copies the states before aside in its own pass (a pass of their own reads them once more)
            bf16_update(engine.bf16_kernel, ahead.job, (), save=ahead.spare[:, : sg.numel],
                        saved=lambda k: setattr(ahead, "copied", k))
        else:
            for dst, src in zip(ahead.spare[:, : sg.numel], (sg.master, sg.exp_avg, sg.exp_avg_sq)):
                dst.copy_(src)
            ahead.copied = sg.numel
            ahead.job.adam(sg.master, sg.grad32, sg.exp_avg, sg.exp_avg_sq)
    finally:
        if fewer != threads:
            torch.set_num_threads(threads)
    return True
