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

import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .lanes import Done, indexed

if TYPE_CHECKING:
    from .lanes import Event
    from .layout import Layout, Subgroup


class HeldGrads(dict):
    """This step's gradients by id(param), held for an update left running. ``gathered(sg)`` (called by the
    engine once subgroup ``sg``'s gathering copies are enqueued, on the stream that runs them) lets go of
    each gradient whose every reading subgroup has gathered it; on a GPU the memory is not reused before
    those copies have run (``record_stream``)."""

    def __init__(self, grads: dict, readers: Sequence["Subgroup"]) -> None:
        super().__init__(grads)
        self._versions = {key: g._version for key, g in grads.items() if g is not None}
        self._left: dict[int, int] = {}
        for sg in readers:
            for key in _param_ids(sg):
                self._left[key] = self._left.get(key, 0) + 1
        self._lock = threading.Lock()  # the CPU worker gathers too (the CPU path's gradients)

    def gathered(self, sg: "Subgroup") -> None:
        """Let go of the gradients ``sg`` was the last to read; raise if one was changed in place since
        ``step()`` (the update may have read the change: on the CPU it did; on a GPU it may have)."""
        with self._lock:
            for key in _param_ids(sg):
                grad = self.get(key)
                if grad is not None and grad._version != self._versions[key]:
                    raise RuntimeError("a gradient was changed in place while the update that step() left running "
                                       "was reading it (model.zero_grad(set_to_none=False), p.grad.zero_() or "
                                       "another edit of p.grad): call opt.zero_grad() or opt.synchronize() before "
                                       "changing gradients in place")
                self._left[key] = self._left.get(key, 0) - 1
                grad = self.pop(key, None) if self._left[key] == 0 else None
                if grad is not None and grad.is_cuda:
                    grad.record_stream(torch.cuda.current_stream(grad.device))


def _param_ids(sg: "Subgroup") -> set[int]:
    """id() of every param with elements in subgroup ``sg``."""
    return {id(sg.bucket.params[pc.i]) for pc in sg.pieces}


class UpdateInFlight:
    """At most one update running in the background; which subgroups' params it has written so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = device = indexed(device)
        initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dos-update", initializer=initializer)
        self._future: Future | None = None
        self._written: dict[int, tuple[threading.Event, object]] = {}
        self._settled: dict[int, tuple[threading.Event, object]] = {}  # host states final after the event
        self._lock = threading.Lock()
        self._started = 0.0
        self._last_written = 0.0  # perf_counter when the newest subgroup's params were enqueued
        self._waited = 0.0  # seconds the caller's thread spent blocked in wait_for during this update
        self._origin: torch.cuda.Event | None = None  # a timing event where the update began on the GPU
        self._ended = 0.0  # perf_counter when the update returned (every lane had run)
        self._forward_at: float | None = None  # perf_counter of the first wait_for since the update started

    @property
    def busy(self) -> bool:
        """Whether an update was started and not joined yet."""
        return self._future is not None

    @property
    def finished(self) -> bool:
        """Whether the update started has ended (its host states final), joined or not."""
        return self._future is None or self._future.done()

    def start(self, update: Callable[[], object], subgroups: Iterable[int]) -> None:
        """Run ``update`` in the background; ``subgroups`` are those it will write (forward waits for their
        params; ``host_final`` tells when their host states are final)."""
        assert self._future is None, "join the running update first"
        subgroups = list(subgroups)
        with self._lock:
            self._written = {i: (threading.Event(), None) for i in subgroups}
            self._settled = {i: (threading.Event(), None) for i in subgroups}
        self._waited, self._forward_at = 0.0, None
        self._future = self._thread.submit(self._run, update)

    def _run(self, update: Callable[[], object]) -> object:
        self._started = self._last_written = time.perf_counter()
        if self.device.type == "cuda":
            self._origin = torch.cuda.current_stream(self.device).record_event(torch.cuda.Event(enable_timing=True))
        try:
            with torch.no_grad():
                return update()
        finally:  # an update that failed half-way must not leave a forward waiting forever
            self._ended = time.perf_counter()
            for flag, _ in [*self._written.values(), *self._settled.values()]:
                flag.set()

    def written(self, index: int, event: Event) -> None:
        """The engine wrote subgroup ``index``'s params (enqueued before ``event`` on a GPU): release its
        waiters. Called from the update's threads."""
        with self._lock:
            entry = self._written.get(index)
            if entry is None:
                return
            self._written[index] = (entry[0], event)
            self._last_written = time.perf_counter()
        entry[0].set()

    def settled(self, index: int, event: Event) -> None:
        """Subgroup ``index``'s master and moments on the host are final once ``event`` has happened (a staged
        subgroup's flush, enqueued; ``Done()`` for one the CPU path has updated). Called from the update's
        threads."""
        with self._lock:
            entry = self._settled.get(index)
            if entry is None:
                return
            self._settled[index] = (entry[0], event)
        entry[0].set()

    def host_final(self, index: int) -> Event | None:
        """When subgroup ``index``'s host states are final: an event to wait for (``Done()``: already, as for
        one this update does not write), or None while the update has not got that far. Lets the next
        backward start on a subgroup (fill its slot ahead, run its CPU update ahead) while the update still
        flushes others, instead of waiting for all of it."""
        if self._future is None or self._future.done():
            return Done()
        with self._lock:
            entry = self._settled.get(index)
        if entry is None:
            return Done()
        return entry[1] if entry[0].is_set() else None

    def wait_for(self, subgroups: Iterable[int], on_host: bool = False) -> None:
        """Make the caller's work wait until these subgroups' params are written: the host until the write
        is enqueued, then the caller's CUDA stream until it has run; with ``on_host``, the host until it
        has run (for readers on streams of their own, such as FSDP2's all-gathers)."""
        if self._future is None:
            return
        if self._forward_at is None:  # the caller's next forward (or backward) has begun
            self._forward_at = time.perf_counter()
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
        raised here. The result's ``params_written_s``, ``params_done_s`` and ``forward_wait_s`` say how long
        the update took to enqueue every param write, until they had all run (on a GPU: its clock, so
        that copies waiting on the link count), and how long the caller's forward was blocked meanwhile;
        ``idle_tail_s``, how much of the update after those writes ran before the caller's next forward began
        (``_idle_tail_s``)."""
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            stats = future.result()
            if hasattr(stats, "params_written_s"):
                stats.params_written_s = self._last_written - self._started
                stats.params_done_s = self._done_s(stats.params_written_s)
                stats.forward_wait_s = self._waited
                stats.idle_tail_s = self._idle_tail_s(stats.params_done_s)
            return stats
        finally:
            self._written, self._settled = {}, {}
            future = None  # it holds a failed update's error, whose traceback holds this frame: no cycle

    def _idle_tail_s(self, params_done_s: float) -> float:
        """Seconds of the update after its last param write that ran before the caller's next forward began
        (its first ``wait_for``; joined before any forward, as by ``opt.synchronize()`` after each step: all
        of it), beside none of the caller's forward and backward. The planner leaves it out of the rest:
        counted in, such a loop's flushes would look like rest and stage more each step. (The climb of the
        bench's synchronised phases, docs/benchmarks/overlap.md calls 136-145, is not this: there the tail was
        0.) Host work of the loop's own between ``step()`` and the forward counts as idle too: the rest then
        reads short by at most this tail, an error that does not feed itself."""
        until = self._ended if self._forward_at is None else min(self._ended, self._forward_at)
        return max(0.0, until - self._started - params_done_s)

    def _done_s(self, enqueued_s: float) -> float:
        """Seconds from the update's start until its last param write had run: on a GPU from timing events
        (the update has ended, so they have happened), else when they were enqueued (the CPU runs them so)."""
        events = [e for _, e in self._written.values() if isinstance(e, torch.cuda.Event)]
        if self._origin is None or not events:
            return enqueued_s
        return max(enqueued_s, max(self._origin.elapsed_time(e) for e in events) / 1e3)

    def close(self) -> None:
        """Stop the thread once its update has ended; not waiting when called on that thread itself (the
        optimizer's finalizer can run there, when a garbage collection happens to start on it)."""
        self._thread.shutdown(wait=not threading.current_thread().name.startswith("dos-update"))


def install_waits(model: nn.Module, layout: "Layout", ref: Callable[[], Any]) -> tuple[list, dict[int, int]]:
    """Hooks that keep an update left running exact, and the order in which the next forward needs the
    subgroups (subgroup index -> rank; the update goes in that order). ``ref()`` is the optimizer (a weak
    reference: the model must not keep it alive), with ``overlapper`` and ``synchronize()``:

    - a forward pre-hook per module that reads params: it waits for the subgroups holding them. Without
      FSDP2 that is each module with a forward of its own, for its own params and those of its children
      without one (``nn.ParameterList``, ``nn.ParameterDict``), which only it can read; under FSDP2 each
      ``fully_shard`` unit, whose own pre-hook all-gathers its shards (and those of the units it prefetches)
      on a stream of its own, so ours runs first and waits on the host; without FSDP2, also a wait at the
      model's forward for the params of modules that never ran in its first forward (``_FirstForward``),
      and, until that first forward, a pre-hook on every part with params that waits for the whole update
      when the part runs on its own (nothing taught yet about params read before their module runs);
    - without FSDP2, a gradient hook per param that makes a backward wait the same way before autograd
      accumulates into a gradient the update may still read (after a forward it has waited already; a
      backward through a retained graph has not). FSDP2 writes sharded gradients itself, after the
      forward's waits;
    - hooks that end the update before any module's state_dict is read or loaded."""
    def subgroups(params: Iterable[torch.Tensor]) -> frozenset:
        return frozenset(sg.index for p in params if id(p) in layout.where
                         for sg in layout.subgroups_of(*layout.where[id(p)]))

    @_eager  # also from _FirstForward._begin, which dynamo traces: the update's state is never guarded on
    def wait(indices: Iterable[int], on_host: bool) -> None:
        opt = ref()
        if opt is not None and opt.overlapper is not None:
            opt.overlapper.wait_for(indices, on_host)

    def in_backward(indices: Iterable[int]) -> None:
        opt = ref()
        if opt is not None:
            opt._backward_began()
        wait(indices, False)

    def sync(*args: Any) -> None:
        opt = ref()
        if opt is not None:
            opt.synchronize()

    handles, need = [], {}
    units = [m for m in model.modules() if _is_fsdp_unit(m)]
    if units:
        own = _fsdp_unit_params(units, subgroups)
        for m in units:
            handles.append(m.register_forward_pre_hook(_unit_waits(m, own, wait), prepend=True))
        order = [own[_state_key(m)] for m in units]
    else:
        order = []
        owned = _reader_params(model)
        readers = [(m, subgroups(params)) for m, params in owned]
        readers = [(m, indices) for m, indices in readers if indices]
        owners = {id(p): (id(m), subgroups([p])) for m, params in owned for p in params if subgroups([p])}
        first = _FirstForward(model, readers, owners, wait, need, ref, handles)
        reading = {id(m) for m, _ in readers}
        for m in model.modules():  # a part called on its own may read params of others before they run
            if m is not model and id(m) not in reading and next(m.parameters(), None) is not None:
                handles.append(m.register_forward_pre_hook(first.outside, prepend=True))
        for m, indices in readers:  # one hook a module: torch 2.7's dynamo guarded on two by the wrong one's cells
            hook = _module_waits(m, indices, first, wait, part=m is not model)
            handles.append(m.register_forward_pre_hook(hook, prepend=True))
            order.append(indices)
        for b in layout.buckets:
            for i, p in enumerate(b.params):
                indices = frozenset(sg.index for sg in layout.subgroups_of(b, i))
                handles.append(p.register_hook(lambda grad, i=indices: in_backward(i)))
    for indices in order:
        for i in sorted(indices):
            need.setdefault(i, len(need))
    for m in model.modules():  # a submodule's state_dict() and load_state_dict() too
        handles.append(m.register_state_dict_pre_hook(sync))
        handles.append(m.register_load_state_dict_pre_hook(sync))
    if "torch._dynamo" in sys.modules:  # torch.compile does not guard on module hooks (by default): a graph
        torch._dynamo.reset()  # compiled before these existed would run without the waits; compile again
    return handles, need


def _module_waits(module: nn.Module, indices: frozenset, first: "_FirstForward", wait: Callable,
                  part: bool) -> Callable:
    """A module's pre-forward wait for the subgroups of the params only it can read; then, for a part of the
    model, ``_FirstForward.outside``."""
    def hook(*args: Any) -> None:
        first.saw(module)
        wait(indices, False)
        if part:
            first.outside()
    return _eager(hook)


class _FirstForward:
    """Learns from the model's first forward which params are read by code other than their own module's
    before that module's forward began: those of modules that never ran in it (``F.linear(x,
    self.head.weight)`` with ``head`` never called), and those read before their module ran (the same read,
    with ``head`` called later). Their own waits never cover those reads. From then on the model's forward
    waits for their subgroups before anything else, and the update writes them first. The reads are seen by
    a torch function mode over the first forward (every torch function and tensor method a param reaches;
    not a custom kernel that takes its data pointer; not a forward compiled by torch.compile, whose reads
    do not reach the mode: there only the modules that never ran are caught). The first forward itself
    runs with no update left running (an error of the update before it is raised there). Its hooks stay
    for good (a compiled forward does not see hooks added later). Not caught: reads outside the model's
    forward (``opt.synchronize()`` covers those), reads that begin only after the first forward
    (data-dependent control flow). Until the model's first forward, a forward of a part of it waits for the
    whole update (``outside``): a loop that never calls the model itself (only submodules) stays exact, and
    is told once that it is not overlapped. What is learned is kept: a module skipped in the first forward
    only (an MoE expert without tokens) is waited for first at every forward, which costs overlap, not
    exactness."""

    def __init__(self, model: nn.Module, readers: list[tuple[nn.Module, frozenset]],
                 owners: dict[int, tuple[int, frozenset]], wait: Callable, need: dict[int, int],
                 ref: Callable[[], Any], handles: list) -> None:
        self.model, self.readers, self.owners = model, readers, owners
        self.wait, self.need, self.ref = wait, need, ref
        self.fired: set[int] = {id(model)}  # the model's own pre-hook runs before the reads are watched
        self.early: set[int] = set()  # subgroups of params read before their module's forward began
        self.unread: frozenset = frozenset()
        self.active = self.done = self.told = False
        self._mode: _ParamReads | None = None
        handles += [model.register_forward_pre_hook(self._begin, prepend=True),
                    model.register_forward_hook(_eager(self._end)),
                    model.register_forward_hook(self._stop_watching, always_call=True)]

    def read(self, args: tuple, kwargs: dict) -> None:
        """A torch function's arguments in the first forward: note the params whose module has not begun."""
        for t in tree_flatten((args, kwargs))[0]:
            owner = self.owners.get(id(t)) if isinstance(t, torch.Tensor) else None
            if owner is not None and owner[0] not in self.fired:
                self.early |= owner[1]

    def saw(self, module: nn.Module) -> None:
        """A reader module's forward began (its pre-hook)."""
        if self.active:
            self.fired.add(id(module))

    def outside(self, *args: Any) -> None:
        """A part of the model's pre-forward check (its hook, or within its wait's): a forward outside the
        model's own, before its first, which has not yet taught which params are read outside their own
        module's forward: with an update left running, wait for all of it."""
        if self.done or self.active:
            return
        opt = self.ref()
        if opt is None or opt.overlapper is None or not opt.overlapper.busy:
            return
        if not self.told:
            self.told = True
            warnings.warn("overlap=True: a part of the model ran its forward while the update was running, and "
                          "the model given to DeepOptimizerStates has not run a forward of its own since the "
                          "optimizer was built. Its first forward teaches the waits for params read outside their "
                          "own module's forward (a shared weight used through F.linear); until then each such "
                          "forward waits for the whole update: exact, but not overlapped. Call the model itself "
                          "to overlap", RuntimeWarning)
        opt.synchronize()

    def __deepcopy__(self, memo: dict) -> "_FirstForward":
        """A deep copy of the model (an EMA copy) keeps calling the original's hooks, as its other waits do."""
        return self

    def _begin(self, *args: Any) -> None:
        if self.done:
            self.wait(self.unread, False)
            return
        opt = self.ref()
        if opt is not None:
            opt.synchronize()  # this forward runs before the waits it teaches exist
        self.active = True  # after a first forward that raised, this one adds to what that one saw
        if self._mode is None and not _compiling():
            self._mode = _ParamReads(self)
            self._mode.__enter__()

    def _end(self, *args: Any) -> None:
        if self.done or not self.active:
            return
        self.active, self.done = False, True
        self.unread = frozenset(self.early).union(*(i for m, i in self.readers if id(m) not in self.fired))
        rest = [i for i in sorted(self.need, key=self.need.get) if i not in self.unread]
        self.need.clear()
        for i in [*sorted(self.unread), *rest]:
            self.need[i] = len(self.need)

    def _stop_watching(self, *args: Any) -> None:
        """After the first forward, also one that raised (an ``always_call`` hook): the mode goes, and a first
        forward that raised is no longer under way (the next forward of the model, or of a part, is then
        treated as before any first forward)."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if not self.done:
            self.active = False


class _ParamReads(TorchFunctionMode):
    """Tells ``_FirstForward`` the arguments of every torch function called in the model's first forward."""

    def __init__(self, first: _FirstForward) -> None:
        super().__init__()
        self.first = first

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.first.read(args, kwargs)
        return func(*args, **kwargs)


def _eager(hook: Callable) -> Callable:
    """``hook`` run as plain Python under torch.compile (one graph break where it runs): bookkeeping and
    waits that dynamo need not trace, and that torch 2.5-2.6's dynamo failed to (a set built from another)."""
    return torch.compiler.disable(hook)


def _compiling() -> bool:
    """Whether dynamo is tracing (a mode pushed from a hook it traces would not be popped as it was pushed)."""
    return torch.compiler.is_compiling()


def _runs_forward(module: nn.Module) -> bool:
    """Whether the module has a forward of its own (containers such as ParameterList do not)."""
    return type(module).forward is not nn.Module.forward


def _reader_params(model: nn.Module) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """Each module with a forward and the params only it can read: its own, and those of its children
    without a forward, theirs, and so on down."""
    out = []
    for m in model.modules():
        if not _runs_forward(m) and m is not model:
            continue
        params, todo = list(m.parameters(recurse=False)), [c for c in m.children() if not _runs_forward(c)]
        while todo:
            c = todo.pop()
            params += c.parameters(recurse=False)
            todo += [g for g in c.children() if not _runs_forward(g)]
        out.append((m, params))
    return out


def _state_key(unit: nn.Module) -> int:
    """One key per FSDP2 state: ``fully_shard([a, b])`` gives a and b one state and one all-gather."""
    get = getattr(unit, "_get_fsdp_state", None)
    return id(get()) if get is not None else id(unit)


def _fsdp_unit_params(units: list[nn.Module], subgroups: Callable) -> dict[int, frozenset]:
    """The subgroups of each FSDP2 state's own params (not those of the units inside its modules)."""
    own: dict[int, frozenset] = {}
    for m in units:
        inner = {id(p) for u in m.modules() if u is not m and _is_fsdp_unit(u) for p in u.parameters()}
        key = _state_key(m)
        own[key] = own.get(key, frozenset()) | subgroups(p for p in m.parameters() if id(p) not in inner)
    return own


def _unit_waits(unit: nn.Module, own: dict[int, frozenset], wait: Callable) -> Callable:
    """A unit's pre-forward wait: its own shards' writes, and those of the units its pre-forward prefetches
    (``set_modules_to_forward_prefetch``, read when the hook runs: it may be set after the optimizer)."""
    def hook(*args: Any) -> None:
        state = unit._get_fsdp_state() if hasattr(unit, "_get_fsdp_state") else None
        keys = [_state_key(unit)] + [id(s) for s in getattr(state, "_states_to_forward_prefetch", ())]
        wait(frozenset().union(*(own.get(k, frozenset()) for k in keys)), True)
    return _eager(hook)


def _is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to this module (FSDP2; torch >= 2.5)."""
    from .fsdp_api import FSDPModule

    return FSDPModule is not None and isinstance(module, FSDPModule)
