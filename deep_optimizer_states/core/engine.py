"""Executes one optimizer update over all subgroups, interleaving the CPU, the PCIe link and the GPU.

The pipeline, per subgroup in order (every arrow between lanes is an event):

  CPU-placed:  [grads_down] grad -> fp32 (x multipliers) -> pinned host grad32
               [cpu worker] wait for it, fused AdamW on the host master/exp_avg/exp_avg_sq
               [params_up]  fp32 master -> GPU scratch -> cast into the model's param
               (``bf16_cpu_path``, bf16 params: grad -> bf16 grad32 half, also when streamed; AdamW reading it,
               applying the multipliers and rounding the params into the other half, ``bf16_update``;
               those go up)
  staged:      [stage_in]   wait for a free slot, master/exp_avg/exp_avg_sq -> GPU slot (or nothing: the
                            states came in during backward, ``prefetch.py``)
               [gpu]        grad -> fp32 (x multipliers) in the slot (filled ahead: in one buffer they share),
                            fused AdamW, cast into the model's param
               [stage_out]  slot -> host master/exp_avg/exp_avg_sq, then the slot is free again
  resident:    [stage_in]   only when just admitted: host states -> its GPU states (kept across steps)
               [resident]   grad -> fp32 (x multipliers), fused AdamW on its GPU states, cast into the param

The main thread enqueues the residents, then the updates of the staged subgroups filled ahead (their params
are what the next forward waits for), then the staged pipeline with its flushes in order (slots bound how far
it runs ahead), then the flushes of those filled ahead (``FLUSH_AHEAD_LAST``); the residents have a stream
of their own, so a staged subgroup's kernels never queue behind them (the link would idle meanwhile). The
CPU worker takes CPU subgroups in order and keeps the gradients of the next GRAD_LOOKAHEAD ones on their way
down, so grads trickle at the CPU's pace instead of crowding the link and host memory at the start (with
``stream_grads`` they went down during backward: ``landed``).
While the CPU updates subgroup i, the link moves staged subgroups in and out. Without a GPU every lane runs
in program order and the worker runs inline: the same code, synchronous.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import cpu_adamw
from .adam import AdamHyper, adam_update
from .lanes import Done, Event, Lane, current_point, indexed
from .layout import Subgroup
from .residency import RESIDENT_BYTES_PER_ELEMENT, Residents
from .schedule import Placement
from .slots import FILL_BYTES_PER_ELEMENT, Ahead, Slot
from .update_memory import BufferSizes, filled_bytes


FP32 = torch.float32
STAGED_BYTES = 12  # PCIe bytes per element, each direction: fp32 master, exp_avg, exp_avg_sq
CPU_PATH_BYTES = 4  # PCIe bytes per element, each direction: fp32 grad down, fp32 master up
BF16_CPU_PATH_BYTES = 2  # the same with ``bf16_cpu_path``: bf16 grad down, bf16 param up
GRAD_LOOKAHEAD = 2  # CPU subgroups whose gradients are on their way down ahead of the one being updated
# With two slots, a subgroup's way in waits for the flush of the one two places ahead: a gap per subgroup.
# Four closed it on 2 H200s sharing one host: a 5.2B step with every subgroup staged took 1.085 s with 2
# slots and 0.903-0.921 s with 4 (docs/benchmarks/fsdp2.md). Fewer are used when GPU memory is short.
DEFAULT_STAGING_SLOTS = 4
# The flushes of the staged subgroups filled ahead (``prefetch``) go after those of the subgroups cycling
# through the slots, whose next fills wait for them. Enqueued first, they held up any copy to the host that a
# training loop makes right after step() (its loss read: a direction of the link runs one copy at a time in
# the order enqueued): in 12 of 17 runs in order the loop's loss read waited ~0.1 s in some iterations (39 of
# 204), in none of 12 runs with this order (0 of 144), the walls' spread 0.051 against 0.019 s (median sd;
# H200 calls 63-70, bench/walls.py), the iteration's median within the runs' spread. False: the update's order.
FLUSH_AHEAD_LAST = True


@dataclass
class Job:
    """One subgroup's share of an update."""

    subgroup: Subgroup
    placement: Placement
    hyper: AdamHyper
    steps_done: int = 0
    runs: list[tuple[int, int, int]] | None = None  # (start, end, steps done); None: the whole subgroup
    ran_ahead: Future | None = None  # the CPU path's AdamW, run during backward (``speculate.py``): params up only

    def spans(self) -> list[tuple[int, int, int]]:
        """The spans to update: params without a gradient are left out, as torch leaves them alone."""
        return self.runs if self.runs is not None else [(0, self.subgroup.numel, self.steps_done)]

    def adam(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """AdamW over this job's spans of flat p/g/m/v (host buffers or a staging slot)."""
        for a, b, steps in self.spans():
            adam_update(p[a:b], g[a:b], m[a:b], v[a:b], steps, self.hyper)


@dataclass
class UpdateStats:
    """What one update did: wall time, busy time per resource, and the bytes it moved each way over PCIe."""

    seconds: float
    cpu_adam_seconds: float
    cpu_subgroups: int
    staged_subgroups: int
    h2d_bytes: int
    d2h_bytes: int
    lane_seconds: dict[str, float]  # busy time of each lane: grads_down, params_up, stage_in, gpu, stage_out
    staged_window_s: float  # from the first staged subgroup's way in to the last one's way back
    device_bytes: int = 0  # GPU memory the update allocated and freed: slots, the grad and param scratch
    resident_subgroups: int = 0  # updated in place on the GPU
    admitted: int = 0  # resident subgroups copied in for this update (counted in h2d_bytes)
    fallbacks: int = 0  # resident or staged subgroups that found no GPU memory and took the CPU path
    timeline: list[dict] | None = None  # with Engine.trace: every block of work, {lane, start, end, label}
    params_written_s: float | None = None  # overlap: from the update's start until every param write was enqueued
    params_done_s: float | None = None  # overlap: ... until every param write had run (on a GPU, its clock)
    forward_wait_s: float | None = None  # overlap: how long the caller was blocked waiting for those writes
    idle_tail_s: float | None = None  # overlap: of the update after those writes, what ran before the next forward
    prefetched: int = 0  # staged subgroups whose states came in during backward (their slots filled ahead)
    prefetched_elements: int = 0  # their elements
    speculated: int = 0  # CPU subgroups whose AdamW ran during backward and was kept (only their params went up)
    speculated_elements: int = 0  # their elements: the CPU work done before the update began


@dataclass
class _Flush:
    """A staged subgroup's way back, once its update is enqueued: its states on the GPU (p, m, v), the event
    after which they are final, and the staging slot they are in (None: a slot filled ahead)."""

    subgroup: Subgroup
    states: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    written: Event
    slot: Slot | None


def bf16_update(kernel: cpu_adamw.Bf16GradAdam, job: Job, multipliers: Sequence[float],
                save: torch.Tensor | None = None, saved: Callable[[int], None] | None = None) -> None:
    """The job's spans updated from the bf16 gradients in the first half of its subgroup's grad32 memory,
    and every param of the subgroup rounded into the second half (a param without a gradient from its
    unchanged master), ready to go up. With ``save`` ([3, numel]: master, exp_avg, exp_avg_sq) the states
    before are copied there on the way (an update run ahead, to be undone), and ``saved(k)`` is told each
    time the first ``k`` elements' are."""
    sg = job.subgroup
    grads, params = sg.bf16_halves()
    master, exp_avg, exp_avg_sq = sg.master, sg.exp_avg, sg.exp_avg_sq
    done = 0
    for a, b, steps in [*job.spans(), (sg.numel, sg.numel, 0)]:
        if done < a:
            params[done:a].copy_(master[done:a])
            if save is not None:  # states no span updates: kept aside too, so that an undo may copy all back
                for dst, src in zip(save[:, done:a], (master, exp_avg, exp_avg_sq)):
                    dst.copy_(src[done:a])
        if a < b:
            kernel(master[a:b], grads[a:b], exp_avg[a:b], exp_avg_sq[a:b], steps, job.hyper, multipliers, params[a:b],
                   None if save is None else save[:, a:b])
        done = b
        if saved is not None:
            saved(done)


def _grads_fp32(dst: torch.Tensor, sg: Subgroup, scratch: torch.Tensor | None,
                multipliers: Sequence[torch.Tensor], grads: dict | None = None) -> None:
    """dst = the subgroup's gradients in fp32 * m1 * m2 ..., gathered and up-cast on the GPU (not the host)."""
    work = dst if scratch is None else scratch[: sg.numel]
    sg.gather_grads(work, grads)
    if hasattr(grads, "gathered"):  # overlap.HeldGrads: those read by every subgroup may go
        grads.gathered(sg)
    for m in multipliers:
        work.mul_(m)
    if work is not dst:
        dst.copy_(work, non_blocking=True)


def _grads_bf16(dst: torch.Tensor, sg: Subgroup, scratch: torch.Tensor | None, grads: dict | None) -> None:
    """dst = the subgroup's bf16 gradients as they are (the multipliers are applied on the host, in fp32)."""
    work = dst if scratch is None else scratch.view(torch.bfloat16)[: sg.numel]
    sg.gather_grads(work, grads)
    if hasattr(grads, "gathered"):
        grads.gathered(sg)
    if work is not dst:
        dst.copy_(work, non_blocking=True)


def _params_from(src: torch.Tensor, sg: Subgroup, scratch: torch.Tensor | None) -> None:
    """The model's params = src (fp32 masters, or bf16 params rounded on the host; on the host or the GPU)
    rounded, cast on the params' device."""
    if scratch is not None:
        scratch = scratch.view(src.dtype)
        scratch[: sg.numel].copy_(src, non_blocking=True)
        src = scratch[: sg.numel]
    sg.scatter_params(src)


def start_worker(device: torch.device, threads: int) -> None:
    """The CPU worker thread's start: this rank's GPU (a new thread starts on GPU 0, another rank's) and the
    creating thread's CPU thread count. Torch gives a new thread the count that any thread set last, not its
    creator's: after one engine's ``set_cpu_threads(1)``, every later engine's worker would run on one thread
    (the GPU suite's calibration warning of H200 call 126, the engine's CPU path at 0.74 against the bare
    kernel's 4.67 G elements/s, came after the test that sets one thread)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads)


def _ignore(index: int, event) -> None:
    pass


def _ignore_bytes(held: int) -> None:
    pass


class _GradFeed:
    """Sends CPU subgroups' gradients down (up-cast on the GPU), GRAD_LOOKAHEAD ahead of the CPU; those that
    were streamed down during backward (``landed``: subgroup index -> event) are not sent again."""

    def __init__(self, lane: Lane, jobs: list[Job], scratch, multipliers, landed: dict, grads: dict | None,
                 bf16: set[int]) -> None:
        self.lane, self.jobs, self.scratch, self.multipliers, self.grads = lane, jobs, scratch, multipliers, grads
        self.streamed, self.bf16 = landed, bf16  # bf16: subgroups whose bf16 gradients go down as they are
        self.events: list = []
        for _ in range(GRAD_LOOKAHEAD):
            self._send()

    def _send(self) -> None:
        if len(self.events) < len(self.jobs):
            sg = self.jobs[len(self.events)].subgroup
            if sg.index in self.streamed:
                self.events.append(self.streamed[sg.index] or Done())
                return
            with self.lane.run(f"sg{sg.index}"):
                if sg.index in self.bf16:
                    _grads_bf16(sg.bf16_halves()[0], sg, self.scratch, self.grads)
                else:
                    _grads_fp32(sg.grad32, sg, self.scratch, self.multipliers, self.grads)
            self.events.append(self.lane.record())

    def landed(self, i: int) -> Event:
        """The event of subgroup i's gradient landing on the host; sends the next one on its way."""
        self._send()
        return self.events[i]


class Engine:
    """Runs updates for one device; holds its lanes and its CPU worker, nothing between steps."""

    def __init__(self, device: torch.device, bf16_cpu_path: bool = False, release_at_flush: bool = False) -> None:
        """``bf16_cpu_path``: CPU-placed subgroups of bf16 params whose gradients are sent at the update take
        the bf16 kernel of ``cpu_adamw.py`` (if it builds here and matches torch's kernel; else torch's).
        ``release_at_flush`` (``prefetch="release"``): each slot filled ahead goes back to the allocator once its
        flush is enqueued, reused only after its streams have run that far (``Ahead.release_after``), instead of
        at the update's end, which with ``overlap`` runs into the next forward: that forward's activations and
        the last update's fills are then not on the GPU at once."""
        self.device = device = indexed(device)
        self.release_at_flush = release_at_flush
        self.bf16_kernel = cpu_adamw.load() if bf16_cpu_path else None
        names = ("grads_down", "params_up", "stage_in", "gpu", "stage_out", "resident")
        self.lanes = {name: Lane(device) for name in names}
        self.grads_down, self.params_up, self.stage_in, self.gpu, self.stage_out, self.resident = self.lanes.values()
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="dos-cpu-adam", initializer=start_worker,
                                           initargs=(device, torch.get_num_threads()))
                        if device.type == "cuda" else None)
        self._warned_fallback = False
        self._on_written: Callable[[int, object], None] = _ignore
        self._on_settled: Callable[[int, object], None] = _ignore
        # told the GPU bytes an update holds of its own (its buffers, the slots filled ahead it took) once it has
        # allocated them, before it lets a slot filled ahead go and before its end (``MemoryBudget.note_update``)
        self.on_memory: Callable[[int], None] = _ignore_bytes
        self._holding = 0
        self.trace = False  # record each block's start and end (UpdateStats.timeline), for `dos profile`
        self._cpu_spans: list[tuple[float, float, str]] = []

    def takes_bf16(self, sg: Subgroup) -> bool:
        """Whether ``sg``, placed on the CPU, takes the bf16 path: its gradients land in the first half of its
        grad32 memory as bf16 (``Subgroup.bf16_halves``), and its params go up from the second half."""
        return self.bf16_kernel is not None and sg.bf16

    def set_cpu_threads(self, threads: int) -> None:
        """Threads of the CPU path's AdamW from now on. With a GPU it runs on the engine's worker thread,
        whose count is its own (torch keeps one per thread): the caller's is left as it is. Fewer threads
        leave more host memory bandwidth to the staged subgroups' copies that run at the same time."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if self._worker is None:
            torch.set_num_threads(threads)
        else:
            self._worker.submit(torch.set_num_threads, threads).result()

    def cpu_threads(self) -> int:
        """Threads the CPU path's AdamW runs on (the worker's own count, with a GPU)."""
        if self._worker is None:
            return torch.get_num_threads()
        return self._worker.submit(torch.get_num_threads).result()

    def close(self) -> None:
        """Stop the CPU worker thread (the optimizer is being closed)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def update(self, jobs: list[Job], multipliers: Sequence[torch.Tensor] = (), max_slots: int = DEFAULT_STAGING_SLOTS,
               residents: Residents | None = None, landed: dict | None = None, ready: Event = None,
               grads: dict | None = None,
               on_written: Callable[[int, object], None] | None = None,
               ahead: dict[int, Ahead] | None = None,
               on_settled: Callable[[int, object], None] | None = None) -> UpdateStats:
        """Apply one optimizer step to every job; returns once params and states are all updated (a resident
        subgroup's states on the GPU, the others' on the host). ``landed``: CPU subgroups whose unscaled fp32
        gradients were streamed to the host during backward (subgroup index -> event); the multipliers are
        applied to them on the host. For an update run on another thread (``overlap``): ``ready``, the event
        after which the gradients are complete (recorded by the caller), ``grads``, the gradients by
        id(param), ``on_written(index, event)``, told as each subgroup's params are written, and
        ``on_settled(index, event)``, as its host states are (a staged one's flush enqueued). ``ahead``:
        staged subgroups whose states are already in slots of their own (subgroup index -> ``Ahead``), held
        here until every stream is done with them (``release_at_flush``: each taken out of the dict at its
        flush, for the allocator to reuse once that flush has run)."""
        residents = residents if residents is not None else Residents(self.device)
        landed, ahead = landed or {}, ahead or {}
        self._on_written, self._on_settled = on_written or _ignore, on_settled or _ignore
        start, origin = self._clock()
        self._cpu_adam_seconds, self._cpu_spans = 0.0, []
        if ready is None:
            ready = current_point(self.device)  # the gradients (and the multipliers) are complete here
        for lane in self.lanes.values():
            lane.wait(ready)
        jobs, fresh, fallbacks = self._admit(jobs, residents)
        staged_planned = sum(j.placement is Placement.STAGED for j in jobs)
        filled_ahead = set(ahead)  # ``ahead`` loses its entries as their slots go (release_at_flush)
        pending: list[Future] = []
        try:
            jobs, slots, down, up, scratch, ahead_grad, sizes = self._buffers(jobs, max_slots, landed, ahead)
            # the buffers (and residents just admitted) come from the caller's stream, which may have freed
            # their blocks after ``ready`` with its own work still queued on them (overlap): the lanes use
            # them after that work
            allocated = current_point(self.device)
            for lane in self.lanes.values():
                lane.wait(allocated)
            on_cpu = [j for j in jobs if j.placement is Placement.CPU]
            bf16 = {j.subgroup.index for j in on_cpu if self.takes_bf16(j.subgroup)}
            feed = _GradFeed(self.grads_down, on_cpu, down, multipliers, landed, grads, bf16)
            on_host = []
            if landed or bf16:  # the multipliers are final at ``ready``, whichever stream computed them
                if ready is not None:
                    ready.synchronize()
                on_host = [m.to("cpu") for m in multipliers]
            pending = [self.on_cpu(self._update_on_cpu, job, i, feed, up, on_host)
                       for i, job in enumerate(feed.jobs)]
            for job in (j for j in jobs if j.placement is Placement.RESIDENT):
                self._update_resident(job, residents, job.subgroup.index in fresh, scratch, multipliers, grads)
            staged = [j for j in jobs if j.placement is Placement.STAGED]
            updated = {j.subgroup.index: self._update_staged(j, None, multipliers, grads, ahead[j.subgroup.index],
                                                             ahead_grad)
                       for j in staged if j.subgroup.index in ahead}  # params first: the next forward waits for them
            turn, later, out = 0, [], None
            for job in staged:  # flushed in order (the next backward fills in this order), but see FLUSH_AHEAD_LAST
                out = updated.pop(job.subgroup.index, None)
                if out is None:
                    out = self._update_staged(job, slots[turn % len(slots)], multipliers, grads)
                    turn += 1
                elif FLUSH_AHEAD_LAST:
                    later.append(out)
                    continue
                self._flush(out, ahead)
            out = None  # from here on, no reference to a slot filled ahead but its entry (release_at_flush)
            while later:
                self._flush(later.pop(0), ahead)
        finally:  # even on an error: never release the slots while the worker or a stream still uses them
            try:
                wait(pending)
                for lane in self.lanes.values():
                    lane.synchronize()
                for filled in ahead.values():  # also those no job used (no gradient, planned elsewhere)
                    filled.loaded.synchronize()
            finally:  # the buffers go now, before the budget hears that the update holds nothing: a peak the
                # next forward reaches from here on is the model's (a reference kept to the return would be ours)
                slots = down = up = scratch = ahead_grad = feed = updated = later = filled = None
                ahead.clear()  # the slots filled ahead, the caller's dict's references with them
                self._hold(0)
        for f in pending:
            f.result()  # re-raises an error of the CPU worker
        return self._stats(jobs, start, origin, bf16, sizes, fresh, filled_ahead, fallbacks, staged_planned)

    def _admit(self, jobs: list[Job], residents: Residents) -> tuple[list[Job], set[int], int]:
        """GPU memory for resident jobs not yet resident; one that finds none takes the CPU path this step.
        Returns the jobs, the subgroups just admitted (their states still to copy in) and the fallbacks."""
        fresh, out, fallbacks = set(), [], 0
        for j in jobs:
            if j.placement is Placement.RESIDENT and j.subgroup not in residents:
                if residents.allocate(j.subgroup):
                    fresh.add(j.subgroup.index)
                else:
                    j, fallbacks = dataclasses.replace(j, placement=Placement.CPU), fallbacks + 1
            out.append(j)
        if fallbacks:
            warnings.warn(f"not enough GPU memory to keep {fallbacks} subgroup(s) resident: updated on the CPU "
                          "this step", RuntimeWarning)
        return out, fresh, fallbacks

    def _timeline(self, origin, start: float) -> list[dict]:
        blocks = [(name, *span) for name, lane in self.lanes.items() for span in lane.timeline(origin)]
        blocks += [("cpu_adam", a - start, b - start, label) for a, b, label in self._cpu_spans]
        return [{"lane": lane, "start": a, "end": b, "label": label} for lane, a, b, label in blocks]

    def _buffers(self, jobs: list[Job], count: int, landed: dict, ahead: dict):
        """Staging slots (for the staged jobs without a slot filled ahead), the CPU path's scratch, the
        residents' fp32 gradient buffer and the one the GPU lane shares across the staged jobs filled ahead
        (their slots hold no gradient), and their sizes; those staged jobs fall back to the CPU without memory
        for slots. The budget is told what the update holds once they are allocated
        (``MemoryBudget.note_update``)."""
        cuda = self.device.type == "cuda"
        sizes = BufferSizes.of(jobs, count, landed, ahead, cuda)
        slots = []
        if sizes.slots:
            try:
                slots = [Slot(sizes.slot_numel, self.device) for _ in range(sizes.slots)]
            except torch.cuda.OutOfMemoryError:
                jobs = self._staged_to_cpu(jobs, lambda i: i not in ahead, "the staging slots")
        ahead_grad = None
        if sizes.ahead_grad:
            try:
                ahead_grad = torch.empty(sizes.ahead_grad, dtype=FP32, device=self.device)
            except torch.cuda.OutOfMemoryError:  # their host states are untouched: the CPU path is exact
                jobs = self._staged_to_cpu(jobs, lambda i: i in ahead,
                                           "the gradient buffer of the subgroups filled ahead")
        final = BufferSizes.of(jobs, count, landed, ahead, cuda)  # the fallbacks' jobs: no slot or buffer of theirs
        down = torch.empty(final.down, dtype=FP32, device=self.device) if final.down else None
        up = torch.empty(final.up, dtype=FP32, device=self.device) if final.up else None
        grads = torch.empty(final.grads, dtype=FP32, device=self.device) if final.grads else None
        self._hold(final.bytes() + filled_bytes(ahead))
        return jobs, slots, down, up, grads, ahead_grad, final

    def _hold(self, held: int) -> None:
        """The update holds ``held`` GPU bytes of its own from here on: told after it allocates and before it
        lets go (``on_memory``), so that a peak between is never counted as ours when it was the model's."""
        self.on_memory(held)
        self._holding = held

    def _staged_to_cpu(self, jobs: list[Job], which: Callable[[int], bool], missing: str) -> list[Job]:
        """The staged jobs whose subgroup index ``which`` takes, on the CPU path this step, as GPU memory for
        ``missing`` was not there (warned once)."""
        if not self._warned_fallback:
            warnings.warn(f"not enough GPU memory for {missing}: updating those subgroups on the CPU")
            self._warned_fallback = True
        return [dataclasses.replace(j, placement=Placement.CPU)
                if j.placement is Placement.STAGED and which(j.subgroup.index) else j for j in jobs]

    def on_cpu(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the CPU path's worker thread, after what was queued there before (without a
        GPU: now, on the caller's thread)."""
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        done: Future = Future()
        done.set_result(fn(*args))
        return done

    @torch.no_grad()  # runs in the CPU worker thread, where the caller's no_grad does not reach
    def _update_on_cpu(self, job: Job, index: int, feed: "_GradFeed", scratch, on_host: list) -> None:
        sg = job.subgroup
        feed.landed(index).synchronize()
        # queued on this worker before the update: it has ended (or raises its error); False: it stood down
        # (speculate.py: the clip's norm passed first), so the update runs here as for any other subgroup
        if job.ran_ahead is None or job.ran_ahead.result() is False:
            t0 = time.perf_counter()
            if sg.index in feed.bf16:
                bf16_update(self.bf16_kernel, job, [float(m) for m in on_host])
            else:
                if sg.index in feed.streamed:  # streamed during backward, unscaled: the same fp32 multiplies
                    for m in on_host:
                        sg.grad32.mul_(m)
                job.adam(sg.master, sg.grad32, sg.exp_avg, sg.exp_avg_sq)
            t1 = time.perf_counter()
            self._cpu_adam_seconds += t1 - t0
            self._cpu_spans.append((t0, t1, f"sg{sg.index}"))
        self._on_settled(sg.index, Done())
        host = sg.bf16_halves()[1] if sg.index in feed.bf16 else sg.master
        with self.params_up.run(f"sg{sg.index}"):
            _params_from(host, sg, scratch)
        self._on_written(sg.index, self.params_up.record(timing=True))

    def _update_resident(self, job: Job, residents: Residents, fresh: bool, scratch: torch.Tensor,
                         multipliers, grads: dict | None) -> None:
        sg = job.subgroup
        p, m, v = residents.tensors(sg)
        if fresh:
            with self.stage_in.run(f"sg{sg.index}"):
                residents.copy_in(sg)
            self.resident.wait(self.stage_in.record())
        with self.resident.run(f"sg{sg.index}"):
            g = scratch[: sg.numel]
            _grads_fp32(g, sg, None, multipliers, grads)
            job.adam(p, g, m, v)
            _params_from(p, sg, None)
        self._on_written(sg.index, self.resident.record(timing=True))

    def _update_staged(self, job: Job, slot: Slot | None, multipliers, grads: dict | None,
                       filled: Ahead | None = None, filled_grad: torch.Tensor | None = None) -> _Flush:
        """Through ``slot`` (its way in first), or through a slot ``filled`` ahead (only its event awaited),
        its gradient in ``filled_grad`` (the GPU lane's buffer: written and read on that lane, in order); the
        states' way back is returned, for ``_flush`` to enqueue."""
        sg = job.subgroup
        n = sg.numel
        if filled is None:
            p, g, m, v = slot.p[:n], slot.g[:n], slot.m[:n], slot.v[:n]
            self.stage_in.wait(slot.free)
            with self.stage_in.run(f"sg{sg.index}"):
                for dst, src in ((p, sg.master), (m, sg.exp_avg), (v, sg.exp_avg_sq)):
                    dst.copy_(src, non_blocking=True)
            self.gpu.wait(self.stage_in.record())
        else:
            p, g, m, v = filled.p, filled_grad[:n], filled.m, filled.v
            self.gpu.wait(filled.loaded)
        with self.gpu.run(f"sg{sg.index}"):
            _grads_fp32(g, sg, None, multipliers, grads)
            job.adam(p, g, m, v)
            _params_from(p, sg, None)
        written = self.gpu.record(timing=True)  # timed: when the params were written (overlap)
        self._on_written(sg.index, written)
        return _Flush(sg, (p, m, v), written, slot)

    def _flush(self, out: _Flush, ahead: dict[int, Ahead]) -> None:
        """A staged subgroup's states back to the host, after its update; its slot is free again after that
        (a staging slot for the next subgroup; one filled ahead, with ``release_at_flush``, for the allocator:
        taken out of ``ahead``, whose caller holds no other reference)."""
        sg = out.subgroup
        self.stage_out.wait(out.written)
        with self.stage_out.run(f"sg{sg.index}"):
            for dst, src in zip((sg.master, sg.exp_avg, sg.exp_avg_sq), out.states):
                dst.copy_(src, non_blocking=True)
        flushed = self.stage_out.record()
        if out.slot is not None:
            out.slot.free = flushed
        elif self.release_at_flush:
            self._hold(self._holding - FILL_BYTES_PER_ELEMENT * ahead[sg.index].p.numel())
            ahead.pop(sg.index).release_after(self.gpu.stream, self.stage_out.stream)
        self._on_settled(sg.index, flushed)

    def _clock(self) -> tuple[float, object]:
        """The update's start on the host clock, and its timeline's origin: the same instant, or with ``trace``
        on a GPU, an event on the caller's stream once everything before it has run (one clock for the host
        and the streams)."""
        if not (self.trace and self.device.type == "cuda"):
            start = time.perf_counter()
            return start, start
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        return start, torch.cuda.current_stream(self.device).record_event(torch.cuda.Event(enable_timing=True))

    def _stats(self, jobs: list[Job], start: float, origin, bf16: set[int], sizes: BufferSizes, fresh: set[int],
               filled_ahead: set[int], resident_fallbacks: int, staged_planned: int) -> UpdateStats:
        """What the update begun at ``start`` did: ``jobs`` as they ran (fallbacks on the CPU path), ``fresh``
        the residents it admitted, ``filled_ahead`` the staged subgroups whose slots came filled; of the
        ``staged_planned`` jobs, those not staged in ``jobs`` fell back to the CPU path."""
        cpu = [j.subgroup for j in jobs if j.placement is Placement.CPU]
        staged = [j.subgroup for j in jobs if j.placement is Placement.STAGED]
        link_bytes = STAGED_BYTES * sum(sg.numel for sg in staged) + sum(
            (BF16_CPU_PATH_BYTES if sg.index in bf16 else CPU_PATH_BYTES) * sg.numel for sg in cpu)
        admitted = sum(j.subgroup.numel for j in jobs if j.subgroup.index in fresh)
        filled = [sg.numel for sg in staged if sg.index in filled_ahead]
        ran_ahead = [j.subgroup.numel for j in jobs if j.ran_ahead is not None]
        window = Lane.window_seconds(self.stage_in, self.stage_out)
        timeline = self._timeline(origin, start) if self.trace else None
        busy = {name: lane.busy_seconds() for name, lane in self.lanes.items()}  # resets the lanes: read last
        return UpdateStats(
            time.perf_counter() - start, self._cpu_adam_seconds, len(cpu), len(staged),
            h2d_bytes=link_bytes + RESIDENT_BYTES_PER_ELEMENT * admitted, d2h_bytes=link_bytes, lane_seconds=busy,
            staged_window_s=window, device_bytes=sizes.bytes(),
            resident_subgroups=sum(j.placement is Placement.RESIDENT for j in jobs), admitted=len(fresh),
            fallbacks=resident_fallbacks + staged_planned - len(staged), timeline=timeline, prefetched=len(filled),
            prefetched_elements=sum(filled), speculated=len(ran_ahead), speculated_elements=sum(ran_ahead))
