"""An update left running after ``step()`` returns (``overlap=True``), and the waits that keep it exact.

``step()`` does everything that needs all gradients at once on the caller's thread (the global norm, the
inf/nan check, clipping and unscale factors, the plan) and hands the update itself to one background
thread. The next forward runs beside it: a forward pre-hook on every module that reads params waits only
for the subgroups holding them (a CPU wait until the subgroup's write was enqueued, then a CUDA event wait
on the caller's stream; under FSDP2, in front of each ``fully_shard`` unit's all-gather, a host wait until
the write has run), and the update goes in the order the forward reads the subgroups. The gradients the
update reads are the ones of this step, held by reference (``HeldGrads``), so ``zero_grad`` (to None) and
the next backward may come at any time; each is let go as soon as the subgroups holding it have read it.
Anything else that reads or writes params, states or the step count goes through ``synchronize()`` first
(the optimizer calls it for its own entry points).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from .layout import Layout, Subgroup


class HeldGrads(dict):
    """This step's gradients by id(param), held for an update left running. ``gathered(sg)`` (called by the
    engine once subgroup ``sg``'s gathering copies are enqueued, on the stream that runs them) lets go of
    each gradient whose every reading subgroup has gathered it; on a GPU the memory is not reused before
    those copies have run (``record_stream``)."""

    def __init__(self, grads: dict, readers: Sequence["Subgroup"]) -> None:
        super().__init__(grads)
        self._left: dict[int, int] = {}
        for sg in readers:
            for key in {id(sg.bucket.params[pc.i]) for pc in sg.pieces}:
                self._left[key] = self._left.get(key, 0) + 1
        self._lock = threading.Lock()  # the CPU worker gathers too (the CPU path's gradients)

    def gathered(self, sg: "Subgroup") -> None:
        with self._lock:
            for key in {id(sg.bucket.params[pc.i]) for pc in sg.pieces}:
                self._left[key] = self._left.get(key, 0) - 1
                grad = self.pop(key, None) if self._left[key] == 0 else None
                if grad is not None and grad.is_cuda:
                    grad.record_stream(torch.cuda.current_stream(grad.device))


class UpdateInFlight:
    """At most one update running in the background; which subgroups' params it has written so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dos-update", initializer=initializer)
        self._future: Future | None = None
        self._written: dict[int, tuple[threading.Event, object]] = {}
        self._lock = threading.Lock()
        self._started = 0.0
        self._last_written = 0.0  # perf_counter when the newest subgroup's params were enqueued
        self._waited = 0.0  # seconds the caller's thread spent blocked in wait_for during this update

    @property
    def busy(self) -> bool:
        """Whether an update was started and not joined yet."""
        return self._future is not None

    def start(self, update: Callable[[], object], subgroups: Iterable[int]) -> None:
        """Run ``update`` in the background; ``subgroups`` are those it will write (forward waits for them)."""
        assert self._future is None, "join the running update first"
        with self._lock:
            self._written = {i: (threading.Event(), None) for i in subgroups}
        self._waited = 0.0
        self._future = self._thread.submit(self._run, update)

    def _run(self, update: Callable[[], object]) -> object:
        self._started = self._last_written = time.perf_counter()
        try:
            with torch.no_grad():
                return update()
        finally:  # an update that failed half-way must not leave a forward waiting forever
            for flag, _ in list(self._written.values()):
                flag.set()

    def written(self, index: int, event) -> None:
        """The engine wrote subgroup ``index``'s params (enqueued before ``event`` on a GPU): release its
        waiters. Called from the update's threads."""
        with self._lock:
            entry = self._written.get(index)
            if entry is None:
                return
            self._written[index] = (entry[0], event)
            self._last_written = time.perf_counter()
        entry[0].set()

    def wait_for(self, subgroups: Iterable[int], on_host: bool = False) -> None:
        """Make the caller's work wait until these subgroups' params are written: the host until the write
        is enqueued, then the caller's CUDA stream until it has run; with ``on_host``, the host until it
        has run (for readers on streams of their own, such as FSDP2's all-gathers)."""
        if self._future is None:
            return
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for i in subgroups:
            entry = self._written.get(i)
            if entry is None:
                continue
            t = time.perf_counter()
            if not entry[0].is_set():
                entry[0].wait()
            event = self._written[i][1]
            if isinstance(event, torch.cuda.Event):
                if on_host:
                    event.synchronize()
                elif stream is not None:
                    stream.wait_event(event)
            self._waited += time.perf_counter() - t

    def join(self) -> object:
        """Wait for the update to end (the engine returns once every lane has run): its result, or its error
        raised here. The result's ``params_written_s`` and ``forward_wait_s`` say how long the update took
        to enqueue every param write and how long the caller's forward was blocked on it meanwhile."""
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            stats = future.result()
            if hasattr(stats, "params_written_s"):
                stats.params_written_s = self._last_written - self._started
                stats.forward_wait_s = self._waited
            return stats
        finally:
            self._written = {}

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def install_waits(model: nn.Module, layout: "Layout", ref: Callable[[], Any]) -> tuple[list, dict[int, int]]:
    """Hooks that keep an update left running exact, and the order in which the next forward needs the
    subgroups (subgroup index -> rank; the update goes in that order). ``ref()`` is the optimizer (a weak
    reference: the model must not keep it alive), with ``overlapper`` and ``synchronize()``:

    - a forward pre-hook per module that reads params: it waits for the subgroups holding them. Without
      FSDP2 that is each module with params of its own; under FSDP2 each ``fully_shard`` unit, whose own
      pre-hook all-gathers its shards on a stream of its own, so ours runs first and waits on the host;
    - without FSDP2, a gradient hook per param that makes a backward wait the same way before autograd
      accumulates into a gradient the update may still read (after a forward it has waited already; a
      backward through a retained graph has not). FSDP2 writes sharded gradients itself, after the
      forward's waits;
    - hooks that end the update before the model's state_dict is read or loaded."""
    def waits(indices: frozenset, on_host: bool = False) -> Callable:
        def hook(*args: Any) -> None:
            opt = ref()
            if opt is not None and opt.overlapper is not None:
                opt.overlapper.wait_for(indices, on_host)
        return hook

    def sync(*args: Any) -> None:
        opt = ref()
        if opt is not None:
            opt.synchronize()

    def subgroups(params: Iterable[torch.Tensor]) -> frozenset:
        return frozenset(sg.index for p in params if id(p) in layout.where
                         for sg in layout.subgroups_of(*layout.where[id(p)]))

    handles, need = [], {}
    units = [m for m in model.modules() if _is_fsdp_unit(m)]
    for m in units or list(model.modules()):
        if units:  # the unit's own params: not those of the units inside it
            inner = {id(p) for u in m.modules() if u is not m and _is_fsdp_unit(u) for p in u.parameters()}
            indices = subgroups(p for p in m.parameters() if id(p) not in inner)
        else:
            indices = subgroups(m.parameters(recurse=False))
        if indices:
            handles.append(m.register_forward_pre_hook(waits(indices, on_host=bool(units)), prepend=True))
            for i in sorted(indices):
                need.setdefault(i, len(need))
    if not units:
        for b in layout.buckets:
            for i, p in enumerate(b.params):
                handles.append(p.register_hook(waits(frozenset(sg.index for sg in layout.subgroups_of(b, i)))))
    handles.append(model.register_state_dict_pre_hook(sync))
    handles.append(model.register_load_state_dict_pre_hook(sync))
    return handles, need


def _is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to this module (FSDP2; torch >= 2.5)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:  # torch 2.5
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:  # torch built without distributed support
            return False
    return isinstance(module, FSDPModule)
