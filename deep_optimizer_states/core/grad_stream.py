"""Gradients that leave the GPU during backward: the CPU path's gradients streamed to host memory.

With ``stream_grads=True`` a post-accumulate-grad hook on every param notes when its gradient is final (the
backward of the last micro-batch: non-final ones run under ``opt.accumulating()``). Once every param piece
of a CPU-placed subgroup is final, the subgroup's gradients are gathered and up-cast into one fp32 GPU
buffer on a side stream and copied down into its pinned ``grad32`` while backward goes on; a param whose
subgroups are all on their way gives its gradient back to the allocator (``p.grad = None``, the memory
kept for the side stream until its copy has run). So the GPU never holds the CPU path's gradients all at
once. Each final gradient's L2 norm is taken in fp32 before it can leave, in batches (one ``_foreach_norm``
over the gradients final since the last batch, as a subgroup goes down and as backward ends: a call per
gradient would cost backward's launching thread three kernel launches each), so the global norm (clipping,
the inf/nan check) is ready when backward ends; the clip and unscale factors are applied to the landed fp32
gradients on the host, the same IEEE multiplies the GPU path does. Staged and resident subgroups keep
their gradients on the GPU. With ``partial`` the norms' running sum of squares goes down beside each
subgroup's gradients (``partial_sq``): a lower bound of the global norm's square by the time they land, which
tells an update run ahead (``speculate``) that a clip will scale this step before backward ends; and over the
share of its norm's square the last step had measured by then (``last_share``), a forecast of this step's.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from typing import Callable, Iterator

import torch

from .grad_scaling import norms_fp32
from .layout import Layout, Subgroup, local


_NOTHING = contextlib.nullcontext()
_OWNER: dict[int, weakref.ref] = {}  # id(param) -> the GradStream that streams it (the newest one built)


class GradStream:
    """Per step: which subgroups' gradients have landed on the host, and the norms of final gradients."""

    def __init__(self, layout: Layout, device: torch.device, is_cpu_placed: Callable[[int], bool],
                 takes_bf16: Callable[[Subgroup], bool] = lambda sg: False) -> None:
        """``takes_bf16`` (``Engine.takes_bf16``): subgroups that land as bf16, in the first half of grad32
        (``bf16_cpu_path``)."""
        self.layout, self.device, self.is_cpu_placed, self.takes_bf16 = layout, device, is_cpu_placed, takes_bf16
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.final = True  # False inside opt.accumulating(): this backward is not the last micro-batch
        self._subgroups_of = {id(p): layout.subgroups_of(b, i) for b in layout.buckets for i, p in enumerate(b.params)}
        self._pieces = {sg.index: len(sg.pieces) for sg in layout.subgroups}
        self._biggest = max((sg.numel for sg in layout.subgroups), default=0)
        self._buffer: torch.Tensor | None = None
        self.sent = 0  # subgroups sent down since the optimizer was built (telemetry)
        self.after_grad: Callable[[], None] | None = None  # told after each final gradient (prefetch fills)
        self.before_first: Callable[[], None] | None = None  # told at a step's first final gradient, first
        self.after_send: Callable[[Subgroup], None] | None = None  # told as a subgroup's gradients go down
        self.gone: dict[int, torch.dtype] = {}  # the last step's ``taken``, until opt.zero_grad
        self.annotate = False  # name the hooks' spans for torch.profiler (`dos profile --kernels`)
        self._ref = weakref.ref(self)
        hook = _weak_hook(self._ref)  # the model's params must not keep the optimizer alive
        params = [p for b in layout.buckets for p in b.params]
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        self._ids = [id(p) for p in params]
        for i in self._ids:  # the newest optimizer of a param streams it: a dropped one not yet collected
            _OWNER[i] = self._ref  # would otherwise take its gradients
        weakref.finalize(self, _remove, list(self._handles), self._ids, self._ref)
        self._sumsq: torch.Tensor | None = None  # with ``partial``: this step's measured norms' sum of squares
        # with ``partial``, two rows, this step's and the last one's (``_row`` this step's): per subgroup that sum
        # as its gradients went down, and the whole sum as backward ended
        self._partial_host: torch.Tensor | None = None
        self._total_host: torch.Tensor | None = None
        self._row = 0
        self.reset()

    def end_step(self) -> None:
        """The step is over: the gradients given back this step are ``gone`` (torch would still hold them, for
        ``zero_grad(set_to_none=False)`` to zero), and the step's other records are forgotten."""
        self.gone = self.taken
        if self._partial_host is not None and self.landed:  # this step's sums become the last step's
            self._row = 1 - self._row  # (reset zeroes the new row)
        self.reset()

    def reset(self) -> None:
        """Forget this step's gradients (after the step, or at zero_grad)."""
        self.waiting = dict(self._pieces)  # per subgroup: params whose final gradient has not come
        self.landed: dict[int, object] = {}  # subgroup index -> event: its fp32 gradients are on the host
        self.norms: dict[int, torch.Tensor] = {}  # id(param) -> L2 norm of its final gradient (fp32)
        self.versions: dict[int, int] = {}  # id(param) -> its final gradient's version counter then
        self._unmeasured: list[torch.Tensor] = []  # params with a final gradient whose norm is not taken yet
        self._measure_queued = False  # the end of this backward will take the norms left
        self.taken: dict[int, torch.dtype] = {}  # id(param) -> its gradient's dtype, given back as its subgroups went
        self._buffer = None
        if self._sumsq is not None:  # a new sum: copies of the old one may still be queued on the side stream
            if self.stream is not None:
                self._sumsq.record_stream(self.stream)
            self._sumsq = None
        if self._partial_host is not None:  # a backward dropped by zero_grad leaves nothing in this step's row
            self._partial_host[self._row].zero_()
            self._total_host[self._row] = 0.0
        self.first_final_at: float | None = None  # host clock (perf_counter) at this step's first final gradient
        self.last_final_at: float | None = None  # ... and at its latest

    def backward_s(self) -> float | None:
        """Host seconds from this step's first final gradient to its last: the span of backward in which
        gradients leave and slots are filled ahead (``Planner.observe_backward``); None before any."""
        if self.first_final_at is None or self.last_final_at is None:
            return None
        return self.last_final_at - self.first_final_at

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        _release(self._ids, self._ref)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside are not the last micro-batch of the step: their gradients stay."""
        before, self.final = self.final, False
        try:
            yield
        finally:
            self.final = before

    def annotated(self, name: str) -> contextlib.AbstractContextManager:
        """A span named ``name`` in torch.profiler's trace while ``annotate`` (else nothing, at no cost)."""
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.final or p.grad is None or _OWNER.get(id(p)) is not self._ref:
            return
        # backward runs its hooks with grad mode off: no_grad's decorator would cost each hook more than the
        # bookkeeping (it is for a hook called outside backward)
        with self.annotated("dos.grad_hook"), torch.no_grad() if torch.is_grad_enabled() else _NOTHING:
            self._final_grad(p)

    def _final_grad(self, p: torch.Tensor) -> None:
        if id(p) in self.versions:
            raise RuntimeError(
                f"a gradient was accumulated a second time this step into a param (shape {tuple(p.shape)}) whose "
                "gradient stream_grads had already treated as final (it may have left the GPU): run the backward "
                "of every micro-batch but the last under `with opt.accumulating():`, and call opt.zero_grad() "
                "between steps. Reentrant activation checkpointing (torch.utils.checkpoint with "
                "use_reentrant=True, the default of transformers 4) does this too for a param read inside one of "
                "its segments, each with a backward of its own, and elsewhere (another segment, or outside any): "
                "checkpoint with use_reentrant=False (transformers: activation_checkpointing_enable("
                "activation_checkpointing_kwargs={'use_reentrant': False}), or gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False}) where it lacks that name), or "
                "build the optimizer with stream_grads=False")
        if self.first_final_at is None and self.before_first is not None:
            self.before_first()
        self.versions[id(p)] = local(p.grad)._version
        self.last_final_at = time.perf_counter()
        if self.first_final_at is None:
            self.first_final_at = self.last_final_at
        self._unmeasured.append(p)
        if not self._measure_queued:
            self._queue_measure()
        done = []
        for sg in self._subgroups_of[id(p)]:
            self.waiting[sg.index] -= 1
            if self.waiting[sg.index] == 0 and self.is_cpu_placed(sg.index):
                done.append(sg)
        if done:
            self._measure()  # before any of these gradients goes down or is given back
        for sg in done:
            self._send(sg)
            if self.after_send is not None:
                self.after_send(sg)
        for q in {id(q): q for sg in done for q in (sg.bucket.params[pc.i] for pc in sg.pieces)}.values():
            self._give_back(q)
        self._give_back(p)
        if self.after_grad is not None:
            self.after_grad()

    def _queue_measure(self) -> None:
        """Take the norms left when this backward ends (now, when no backward runs: a hook called by hand)."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(_weak_measure(self._ref))
            self._measure_queued = True
        except RuntimeError:
            self._measure()
            self._record_total()

    def _measure(self) -> None:
        """The norms of the final gradients not measured yet, in one kernel call per dtype (the one
        ``grad_scaling.total_norm`` uses, so both paths clip alike)."""
        params = [p for p in self._unmeasured if p.grad is not None]
        self._unmeasured = []
        if params:
            norms = norms_fp32([local(p.grad) for p in params])
            self.norms.update(zip(map(id, params), norms))
            if self.partial:
                if self._sumsq is None:
                    self._sumsq = torch.zeros((), dtype=torch.float32, device=norms[0].device)
                self._sumsq.add_(torch.stack(norms).square().sum())

    @property
    def partial(self) -> bool:
        """Whether each subgroup's gradients go down with the norms' running sum of squares (``partial_sq``)."""
        return self._partial_host is not None

    @partial.setter
    def partial(self, on: bool) -> None:
        if on and self._partial_host is None:
            pin = self.device.type == "cuda"
            self._partial_host = torch.zeros(2, max(self._pieces, default=-1) + 1, dtype=torch.float32, pin_memory=pin)
            self._total_host = torch.zeros(2, dtype=torch.float32, pin_memory=pin)
        elif not on:
            self._partial_host = self._total_host = None

    def partial_sq(self, index: int, row: int | None = None) -> float:
        """The square of the norm of the gradients measured by the time subgroup ``index``'s went down (read
        once they have landed): at most the global norm's square (the sum runs in place on the device, so a
        later copy may count more of this step's norms, never another step's); 0.0 without ``partial``.
        ``row``: the step's row (``clip_check``), this step's by default."""
        if self._partial_host is None:
            return 0.0
        return float(self._partial_host[self._row if row is None else row, index])

    def last_share(self, index: int, row: int | None = None) -> float | None:
        """The share of the last step's norm's square measured by the time subgroup ``index``'s gradients went
        down then: ``partial_sq`` over it forecasts this step's (layers' shares move little between steps); None
        where not known (no last step with ``partial``, the subgroup did not go down in it, or its norm was not
        finite). Read once this step's gradients of the subgroup have landed (the last step's copies ran before
        them on the stream). ``row``: this step's row, as for ``partial_sq``."""
        if self._partial_host is None:
            return None
        last = 1 - (self._row if row is None else row)
        total, part = float(self._total_host[last]), float(self._partial_host[last, index])
        return part / total if math.isfinite(total) and total > 0.0 and part > 0.0 else None

    def clip_check(self, index: int, limit_sq: float, forecast: bool = False) -> Callable[[], bool]:
        """For an update run ahead of subgroup ``index``, called on the worker once its gradients have landed:
        whether this step's clip at ``limit_sq`` (a squared norm) will scale them, the norm measured by then
        over it; with ``forecast``, likely will: that norm over the last step's share by the same point
        (``last_share``). This step's row is taken now, so a task still queued after the step's end (one the
        step kept) reads its own step's sums, not the next one's."""
        row = self._row

        def over() -> bool:
            share = self.last_share(index, row) if forecast else None
            return self.partial_sq(index, row) > limit_sq * (1.0 if share is None else share)
        return over

    def _record_total(self) -> None:
        """As backward ends, with ``partial``: this step's whole sum of squares into its host slot (on the side
        stream, before the next step's copies)."""
        if self._total_host is None or self._sumsq is None:
            return
        if self.stream is None:
            self._total_host[self._row].copy_(self._sumsq)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the last norms are summed
        with torch.cuda.stream(self.stream):
            self._total_host[self._row].copy_(self._sumsq, non_blocking=True)

    def _give_back(self, p: torch.Tensor) -> None:
        """Free ``p``'s gradient once it is final and every subgroup holding it has gone down."""
        if id(p) in self.taken or id(p) not in self.norms or p.grad is None:
            return
        if all(sg.index in self.landed for sg in self._subgroups_of[id(p)]):
            if self.stream is not None:
                local(p.grad).record_stream(self.stream)  # not reused before the copy has read it
            self.taken[id(p)] = p.grad.dtype
            p.grad = None

    def _send(self, sg: Subgroup) -> None:
        """Gather and up-cast the subgroup's gradients on the side stream, then copy them to its grad32 (bf16
        ones as they are, into its first half, with ``bf16``)."""
        bf16 = self.takes_bf16(sg)
        dst = sg.bf16_halves()[0] if bf16 else sg.grad32
        if self.stream is None:
            sg.gather_grads(dst)
            self._send_partial(sg)
            self.landed[sg.index] = None
            self.sent += 1
            return
        if self._buffer is None:  # one buffer: uses follow each other on the one side stream
            with torch.cuda.stream(self.stream):
                self._buffer = torch.empty(self._biggest, dtype=torch.float32, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are computed
        with torch.cuda.stream(self.stream):
            work = (self._buffer.view(torch.bfloat16) if bf16 else self._buffer)[: sg.numel]
            sg.gather_grads(work)
            dst.copy_(work, non_blocking=True)
            self._send_partial(sg, non_blocking=True)
            self.landed[sg.index] = self.stream.record_event()
        self.sent += 1

    def _send_partial(self, sg: Subgroup, non_blocking: bool = False) -> None:
        """With ``partial``: the norms' running sum of squares into ``sg``'s host slot, beside its gradients."""
        if self._partial_host is not None:
            if self._sumsq is None:
                self._partial_host[self._row, sg.index] = 0.0
            else:
                self._partial_host[self._row, sg.index].copy_(self._sumsq, non_blocking=non_blocking)

    def edited(self) -> str | None:
        """Which gradient, if any, was changed in place after backward once some went down this step: the
        streamed ones would miss the change (torch's clip_grad_norm_ or GradScaler.unscale_ over the params,
        a manual scaling). A moved version counter alone does not say so (FSDP2's gradients are views of
        one buffer, whose accumulation moves every view's counter): its norm must have moved too."""
        if not self.landed:
            return None
        suspects = [p for b in self.layout.buckets for p in b.params
                    if p.grad is not None and id(p) in self.norms and id(p) not in self.taken
                    and local(p.grad)._version != self.versions[id(p)]]
        if not suspects:
            return None
        now = torch.stack(norms_fp32([local(p.grad) for p in suspects]))
        then = torch.stack([self.norms[id(p)] for p in suspects])
        moved = (now.view(torch.int32) != then.view(torch.int32)).tolist()  # bits: a NaN equals itself
        return next((f"param of shape {tuple(p.shape)}" for p, m in zip(suspects, moved) if m), None)

    def had_grad(self, p: torch.Tensor) -> bool:
        """Whether ``p`` had a final gradient this step (also once it was given back)."""
        return id(p) in self.taken or p.grad is not None

    def grad_norms(self) -> list[torch.Tensor]:
        """The L2 norm of every param's gradient this step, in layout order: taken as it landed, or now (in one
        kernel call: a caller may have changed a gradient still here since)."""
        params = [p for b in self.layout.buckets for p in b.params if id(p) in self.taken or p.grad is not None]
        now = [p for p in params if id(p) not in self.taken]
        measured = dict(zip(map(id, now), norms_fp32([local(p.grad) for p in now])))
        return [self.norms[id(p)] if id(p) in self.taken else measured[id(p)] for p in params]


def _weak_measure(ref: "weakref.ref[GradStream]") -> Callable[[], None]:
    def measure() -> None:
        stream = ref()
        if stream is not None:
            stream._measure_queued = False
            stream._measure()
            stream._record_total()
    return measure


def _weak_hook(ref: "weakref.ref[GradStream]") -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        stream = ref()
        if stream is not None:
            stream._on_grad(p)
    return hook


def _release(ids: list[int], ref: weakref.ref) -> None:
    for i in ids:
        if _OWNER.get(i) is ref:
            del _OWNER[i]


def _remove(handles: list, ids: list[int], ref: weakref.ref) -> None:
    for h in handles:
        h.remove()
    _release(ids, ref)
