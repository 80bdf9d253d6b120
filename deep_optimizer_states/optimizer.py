"""DeepOptimizerStates: AdamW with fp32 states in pinned host memory, updated interleaved on the CPU and GPU."""

from __future__ import annotations

import contextlib
import functools
import math
import time
import traceback
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from . import state_io
from .core.adam import AdamHyper, check_group
from .core.engine import DEFAULT_STAGING_SLOTS, Engine, Job, UpdateStats
from .core.grad_scaling import DynamicLossScaler, clip_coefficient, combine_norms, total_norm
from .core.grad_stream import GradStream
from .core.host_state import RESET_MESSAGE, HostState, ParamState
from .core.lanes import Done, Event, current_point
from .core.layout import Layout, Subgroup, local, subgroup_count
from .core.overlap import HeldGrads, UpdateInFlight, install_waits
from .core.prefetch import Prefetch
from .core.residency import RESIDENT_BYTES_PER_ELEMENT, Residents
from .core.slots import FILL_BYTES_PER_ELEMENT
from .core.ranks import RankSync, local_ranks, shard_group, use_cpu_threads
from .core.schedule import Placement, Schedule
from .core.speculate import LAUNCH_SHARE, Speculation
from .options import PREFETCH_RELEASE, check_options
from .params import checked_device, normalized_group, param_names, refuse_sparse_modules, trainable_params
from .planning.budget import CudaProbe, MemoryBudget
from .planning.plan import Plan, Planner


class _TorchDefault:
    """weight_decay not given: torch's default for the algorithm (AdamW 1e-2, Adam 0)."""

    def __repr__(self) -> str:
        return "torch's default (AdamW 1e-2, Adam 0)"


TORCH_DEFAULT: Any = _TorchDefault()
# After a step whose updates run ahead were undone (a clip or a loss scale applied), the next step runs none
# ahead: under a clip that lasts, each would be copied aside and back for nothing. Since updates ahead stand down
# once the norm landed passes the clip's (speculate.py), what that costs is fewer of them; False (bench
# systems `_nositout`): run them ahead on every unscaled step, to measure against this default.
SIT_OUT_AFTER_CLIP = True
# With a clip, an update run ahead whose subgroup lands after the norm measured so far passed the clip's stands
# down before its copy aside (the step will scale it); False (bench systems `_nostanddown`): it always runs, and
# a step that clips undoes it, to measure the stand-down against. "forecast" (bench systems `_forecast`, which
# also run updates ahead after a clip): it stands down once that norm, over the share of the last step's norm
# measured by the same point, passes the clip's; a forecast, so a wrong one costs an undo or a head start, never
# exactness. On H100s (overlap.md calls 171-177) its iteration was not told apart from the default's, so it
# is not the default. Under FSDP2 both read this rank's norms, at most the
# global one: a clip is found later, the more ranks the later.
STAND_DOWN: bool | str = True
_STAND_DOWN_MODES = (True, False, "forecast")
MIN_LOSS_SCALE = 1.0  # below it fp16 gradients overflow even unscaled: halving cannot help (DeepSpeed's floor)


class DeepOptimizerStates(torch.optim.Optimizer):
    """AdamW (or Adam) whose fp32 master weights and moments live in pinned host memory.

    Params must share one device (a GPU, or the CPU for testing); they and their grads stay the model's own
    tensors. Each step updates the subgroups on the CPU, staged through the GPU, or resident on the GPU, as
    ``schedule`` says: "cpu" (ZeRO-Offload), "gpu" (every subgroup staged), an int k (one subgroup in every k
    staged), one placement per subgroup, or "auto": as many subgroups resident as ``gpu_memory_budget``
    leaves room for beside what forward and backward were measured to need, the rest placed by the
    calibrated performance model (calibration runs at the first step, or at ``calibrate()``); "offload" is
    "auto" with every state kept on the host (no residents). Under FSDP2 each rank updates its own shards
    and the ranks calibrate together, in lock-step, so that the model prices the host they share.

    Results equal ``torch.optim.AdamW(fused=True)`` applied to fp32 master weights; bf16/fp16 params hold the
    masters rounded to their dtype. As in torch, a param whose ``.grad`` is None is left alone (no decay, no
    moment update, no step count), params with ``requires_grad=False`` are kept in ``param_groups`` but get
    no host memory, and a weight edited in place after construction (``model.load_state_dict``) becomes the
    new master. fp16 params use dynamic loss scaling: backpropagate ``opt.scale_loss(loss)``. A step whose
    gradients hold inf/nan is skipped with a warning (``nonfinite="skip"``) or raises (``"raise"``).
    ``adamw=False`` is classic Adam (L2 decay added to the gradient); ``weight_decay`` defaults to torch's
    for each: 1e-2 for AdamW, 0 for Adam.

    ``stream_grads=True`` sends the CPU path's gradients to host memory during backward, as each subgroup's
    gradients become final, and gives their GPU memory back (those params' ``.grad`` are None after
    backward): the GPU never holds them all at once. Run the backward of every micro-batch but the last
    under ``with opt.accumulating():``, and clip with ``max_grad_norm``/``opt.clip_grad_norm_``, which see
    the streamed gradients (``torch.nn.utils.clip_grad_norm_`` over the params does not). ``speculate=True``
    (with ``stream_grads``) also runs their AdamW during backward, on a copy kept aside: ``step()`` keeps
    it when the step neither skips nor clips and nothing changed since, and undoes it otherwise.

    ``prefetch=True`` (with ``stream_grads``) copies the staged subgroups' states to the GPU during backward,
    into slots of their own held until the update ends; ``prefetch="release"`` gives each slot back at its
    flush instead, for a lower GPU peak when the update runs into the next forward (``overlap``).

    ``bf16_cpu_path=True`` (opt-in): CPU-placed subgroups of bf16 params send their gradients down in bf16
    (also when streamed) and their params up in bf16 (half the PCIe bytes, 32 instead of 36 through host
    memory per element), through a kernel of ours compiled at first use and checked bit for bit against
    torch's; where it does not build or match, torch's kernel is used, with a warning.

    ``cpu_threads``: the CPU path's AdamW threads. By default, with a GPU, one core fewer than the host's (or
    than this rank's share of it under torchrun): the thread that drives the GPU needs a core of its own.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict] | Iterable[tuple[str, torch.Tensor]] | nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = TORCH_DEFAULT,
        amsgrad: bool = False,
        *,
        adamw: bool = True,
        subgroup_size: int = 25_000_000,
        schedule: Schedule = "auto",
        max_grad_norm: float | None = None,
        loss_scale: str | float | None = "auto",
        nonfinite: str = "skip",
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        gpu_memory_budget: int | float | None = None,
        stream_grads: bool = False,
        overlap: bool = False,
        prefetch: bool | str = False,
        speculate: bool | int = False,
        bf16_cpu_path: bool = False,
        model: nn.Module | None = None,
        cpu_threads: int | None = None,
        device: str | torch.device | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        self.layout: Layout | None = None
        if weight_decay is TORCH_DEFAULT:
            weight_decay = 1e-2 if adamw else 0.0
        if isinstance(params, nn.Module) and model is not None:
            raise ValueError("the model is given twice: pass it as the first argument or as model=, not both")
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module (the model that uses the params), got {type(model).__name__}")
        self.module = params if isinstance(params, nn.Module) else model
        if self.module is not None:
            refuse_sparse_modules(self.module)
        if isinstance(params, nn.Module):  # a quantised frozen base (int8 weights, as in QLoRA) is not ours
            params = [(n, p) for n, p in self.module.named_parameters() if p.is_floating_point() or p.requires_grad]
        speculate = check_options(subgroup_size=subgroup_size, staging_slots=staging_slots, betas=betas,
                                  max_grad_norm=max_grad_norm, nonfinite=nonfinite, schedule=schedule,
                                  gpu_memory_budget=gpu_memory_budget, stream_grads=stream_grads, overlap=overlap,
                                  prefetch=prefetch, speculate=speculate, bf16_cpu_path=bf16_cpu_path,
                                  has_model=self.module is not None)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=adamw)
        super().__init__(params, defaults)
        self.overlapper: UpdateInFlight | None = None
        self._failed: str | None = None  # an update that failed part-way, its error (see _check_not_failed)
        self.state = HostState(_weak(self._make_current), _weak(self.synchronize))
        self._group_params = self._params_by_group()  # what the host layout was built for
        self.adamw = adamw
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        names = param_names(self.param_groups, self.module)
        self.device = checked_device(self.param_groups, names, device)
        trainable = trainable_params(self.param_groups, names)
        self.group = shard_group([p for params, _ in trainable for p in params])
        if speculate and loss_scale is not None and (loss_scale != "auto" or any(
                p.dtype == torch.float16 for params, _ in trainable for p in params)):
            raise ValueError("speculate does not support loss scaling (fp16 params): train bf16 params, or pass "
                             "speculate=False")
        if isinstance(schedule, (list, tuple)):  # its length, before the host memory is pinned; all ranks raise
            count = subgroup_count(trainable, subgroup_size)
            if RankSync(self.group, self.device).anyone(len(schedule) != count):
                raise ValueError(f"the schedule gives {len(schedule)} placements for {count} subgroups"
                                 f"{' here, but not on another rank' if len(schedule) == count else ''}: give one per "
                                 "subgroup of this rank (len(opt.layout.subgroups))")
        use_cpu_threads(cpu_threads, self.device)
        self.layout = Layout(trainable, subgroup_size, self.device, local_ranks(),
                             None if self.group is None else functools.partial(torch.distributed.barrier,
                                                                               group=self.group))
        self.layout.before_host_write = _weak(self._evict_param)
        self.engine = Engine(self.device, bf16_cpu_path, release_at_flush=prefetch == PREFETCH_RELEASE)
        if bf16_cpu_path and not RankSync(self.group, self.device).everyone(self.engine.bf16_kernel is not None):
            if self.engine.bf16_kernel is not None:
                warnings.warn("bf16_cpu_path: the kernel did not load on another rank; every rank keeps torch's "
                              "kernel, so that the ranks calibrate and plan alike")
            self.engine.bf16_kernel = None
        self.residents = Residents(self.device)
        self.prefetch = Prefetch(self.device) if prefetch else None
        self._order_ahead: list | None = None  # this step's staged subgroups, in the order the update takes them
        self._had_grad: set[int] | None = None  # subgroups the last update had gradients for (None: no update yet)
        self._room_ahead = 0  # this step's GPU bytes for them
        self.residents.before_evict = _weak(self._note_eviction)
        self.engine.on_memory = _weak(self._note_update)
        probe = CudaProbe(self.device) if self.device.type == "cuda" else None
        largest = max((sg.numel for sg in self.layout.subgroups), default=0)  # elements of the largest subgroup
        self.planner = Planner([sg.numel for sg in self.layout.subgroups], self.device, staging_slots,
                               budget=MemoryBudget(gpu_memory_budget, probe),
                               provisional="cpu" if stream_grads else "auto", sync=RankSync(self.group, self.device),
                               bf16=self.engine.bf16_kernel is not None
                               and all(sg.bf16 for sg in self.layout.subgroups),
                               ahead_cap=speculate * largest, overlap=overlap, prefetch=bool(prefetch))
        self._stepped_at: float | None = None  # when the last step() began (the overlapped iteration's length)
        self._timed_update: UpdateStats | None = None  # the update whose step that was
        self._largest_input = 0
        self.grad_stream = (GradStream(self.layout, self.device, _weak(self._is_cpu_placed), self.engine.takes_bf16)
                            if stream_grads else None)
        self._sampled = False  # the budget has read the model's memory in this step's backward
        self._warned_zeroed = False  # zero_grad(set_to_none=False) has said what it costs with stream_grads
        self._warned_restep = False  # a step without a backward has said that the streamed gradients are gone
        if self.grad_stream is not None:
            self.grad_stream.before_first = _weak(self._backward_began)
        if self.prefetch is not None:
            self.grad_stream.after_grad = _weak(self._fill_ahead)
        self.speculation: Speculation | None = None
        self._speculating = True  # off for the step after one whose gradients were clipped (undone)
        self._clip_seen = max_grad_norm  # the clip an update run ahead expects: max_grad_norm, or clip_grad_norm_'s
        if speculate:
            self.speculation = Speculation(speculate, largest, local_ranks(), self.engine,
                                           LAUNCH_SHARE if self.device.type == "cuda" else 0.0)
            self.grad_stream.after_send = _weak(self._run_ahead)
            self.grad_stream.partial = max_grad_norm is not None  # the norm so far, for the run-ahead's stand-down
        self._hook = None
        self._ran: list[Placement] = []  # the placements the newest update ran (what the planner learns from)
        self._ran_as_planned = True  # ... and they were the plan in force during its backward
        self._fills_bounded = False  # ... and the room for its fills could not hold all its staged subgroups
        if self.module is not None:  # the model must not keep the optimizer alive: a weak reference
            self._hook = self.module.register_forward_pre_hook(_forward_hook(weakref.ref(self)), with_kwargs=True)
            weakref.finalize(self, self._hook.remove)
        self._overlap_handles: list = []
        self._need_order: dict[int, int] = {}  # overlap: subgroup index -> when the next forward first reads it
        if overlap:
            self.overlapper = UpdateInFlight(self.device)
            self._overlap_handles, self._need_order = install_waits(self.module, self.layout, weakref.ref(self))
            weakref.finalize(self, _remove_all, self._overlap_handles)
            weakref.finalize(self, self.overlapper.close)
        self.schedule = schedule
        self.scaler = self._make_scaler(loss_scale)
        self.skipped_steps = 0
        self._scaled_since_step = False
        self._clip_once: float | None = None
        self._norm_cache: torch.Tensor | None = None
        self._norm_of: list | None = None  # the gradients _norm_cache was taken of (``_grad_marks``)
        self.last_grad_norm: torch.Tensor | None = None
        self.last_update: UpdateStats | None = None
        self._expose_state()

    # ---- construction -------------------------------------------------------------------------------
    @property
    def state(self) -> HostState:
        """Per-param states, as torch's ``opt.state`` (views into our host buffers)."""
        return self.__dict__["_state"]

    @state.setter
    def state(self, value: Any) -> None:
        if "_state" in self.__dict__ and isinstance(self.__dict__["_state"], HostState):
            raise RuntimeError(RESET_MESSAGE)
        self.__dict__["_state"] = value  # torch's constructor sets a defaultdict; ours replaces it once

    def _params_by_group(self) -> list[tuple[int, ...]]:
        return [tuple(id(p) for p in g["params"]) for g in self.param_groups]

    def _check_groups(self) -> None:
        """Refuse a step after params were added to, removed from or moved between param groups: the host
        layout (which params, in which group's hyper-parameters) was built once."""
        now = self._params_by_group()
        if now != self._group_params:
            shorter = min(len(now), len(self._group_params))  # a group added or removed: the first one past
            k = next((k for k, (a, b) in enumerate(zip(now, self._group_params)) if a != b), shorter)
            raise RuntimeError(f"the params of param_groups[{k}] changed after DeepOptimizerStates was built (a param "
                               "added, removed or moved to another group): its host states were laid out once, "
                               "so build a new optimizer with the groups you want (load_state_dict() carries "
                               "the states over when the params stay the same)")

    def add_param_group(self, param_group: dict) -> None:
        """Validate and add a group; only during construction (the host layout is built once).

        Accepts what torch.optim accepts (tensors, or (name, tensor) pairs); the same Parameter given twice
        (tied weights, under two names) is kept once.
        """
        if getattr(self, "layout", None) is not None:
            raise RuntimeError("DeepOptimizerStates maps its params once: add_param_group after construction is "
                               "not supported; build a new optimizer with all param groups")
        super().add_param_group(normalized_group(param_group))
        check_group(self.param_groups[-1])

    def _make_scaler(self, loss_scale: str | float | None) -> DynamicLossScaler | None:
        fp16 = any(p.dtype == torch.float16 for b in self.layout.buckets for p in b.params)
        if loss_scale == "auto":
            return DynamicLossScaler() if fp16 else None
        if loss_scale == "dynamic":
            return DynamicLossScaler()
        if loss_scale is None:
            return None
        if (isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0
                and math.isfinite(loss_scale)):
            return DynamicLossScaler(init_scale=float(loss_scale))
        raise ValueError(f"loss_scale must be 'auto', 'dynamic', None or a finite float > 0, got {loss_scale!r}")

    def _expose_state(self) -> None:
        """opt.state[p] holds step, exp_avg, exp_avg_sq and master (views into host memory) for every param
        that has taken a step; as in torch, a param's state is empty before its first step."""
        for b in self.layout.buckets:
            for i, p in enumerate(b.params):
                if b.steps[i] > 0 and not isinstance(self.state.raw(p), ParamState):
                    self.state.expose(p, self._param_state(b, i))
                elif b.steps[i] == 0 and p in self.state:
                    self.state.expose(p, None)

    def _param_state(self, b, i: int) -> ParamState:
        """Param i of bucket b's entry of opt.state: its step count and views of its host buffers."""
        p = b.params[i]
        return ParamState({"step": b.step_tensors[i], **self.layout.views(p)},
                          _weak(self._before_state_write, p), _weak(self._state_written, b, i))

    @contextlib.contextmanager
    def every_state_shown(self) -> Iterator[None]:
        """Inside: ``opt.state`` (and so ``state_dict()``) holds every trainable param's state, also before
        its first step (step 0, zero moments, its master). For torch.distributed.checkpoint, which otherwise
        "initialises" an optimizer without state by a step with zero gradients (moving every step count to
        1) and cannot load a checkpoint that lacks a param never trained yet."""
        self._open()
        self.synchronize()
        for b in self.layout.buckets:
            for i, p in enumerate(b.params):
                if not isinstance(self.state.raw(p), ParamState):
                    self.state.expose(p, self._param_state(b, i))
        try:
            yield
        finally:
            if self.layout is not None:
                self._expose_state()  # as torch: no state before a param's first step

    # ---- resident states ----------------------------------------------------------------------------
    def _make_current(self, p: torch.Tensor | None) -> None:
        """Before the host copy of ``p``'s states (all params' for None) is read or written: the update left
        running ends, a weight edited since the last step becomes its master (as ``master()`` and
        ``state_dict()`` take it: a stale master read here and written back would undo the edit), its
        resident subgroups are evicted, and copies taken ahead are dropped (a view read may be written in
        place)."""
        self.synchronize()
        if self.layout is None:
            return
        if p is None or id(p) in self.layout.where:
            self.layout.take_edits(settle=False, only=p)
        if p is None:
            self._drop_ahead()
            self._undo_ahead()
            self.residents.evict()
        elif id(p) in self.layout.where:
            self._evict_param(*self.layout.where[id(p)])

    def _before_state_write(self, p: torch.Tensor, key: str) -> None:
        """Before a write into opt.state[p]: its states are current on the host; before a new master, the
        edits of every param so far are taken (the write records the params as ours, which would hide them;
        an edit of p itself gives way to the master written)."""
        self._make_current(p)
        if key == "master":
            self.layout.take_edits(settle=False)

    def _state_written(self, b, i: int, key: str) -> None:
        """After a write into opt.state[p]: a new step count is the layout's too; new weights need nothing
        (the master was written), except that the param must follow its master."""
        if key == "step":
            self.layout.sync_steps()  # refused at once if it is no whole number >= 0
        elif key == "master":
            with torch.no_grad():
                local(b.params[i]).copy_(self.layout.views(b.params[i])["master"])
            self.layout.record_writes()

    def _backward_began(self) -> None:
        """From a gradient hook (``stream_grads``, or ``overlap``'s waits): once a step, the budget reads the
        model's memory as backward begins (``MemoryBudget.sample``)."""
        if not self._sampled:
            self._sampled = True
            self.planner.budget.sample(self.residents.bytes() + (self.prefetch.bytes() if self.prefetch else 0))

    def _note_eviction(self, held: int) -> None:
        self.planner.budget.note_eviction(held)

    def _note_update(self, held: int) -> None:
        self.planner.budget.note_update(held)

    def _is_cpu_placed(self, index: int) -> bool:
        return self.plan.placements[index] is Placement.CPU

    def _evict_param(self, bucket, i: int) -> None:
        self._drop_ahead(self.layout.subgroups_of(bucket, i))  # its host states are about to be read or written
        self._undo_ahead(self.layout.subgroups_of(bucket, i))
        if len(self.residents):
            self.residents.evict(only={sg.index for sg in self.layout.subgroups_of(bucket, i)})

    # ---- states staged ahead ------------------------------------------------------------------------
    def _fill_ahead(self) -> None:
        """From a final gradient's hook in backward (``prefetch=True``): copy the plan's staged subgroups'
        states into slots of their own while the budget allows and the link carries them before the update
        (``Planner.room_ahead``), in the order the update will take them,
        each after the last update (``overlap``) has written its host states."""
        if self._order_ahead is None:  # once a step: the plan does not change during backward
            pairs = list(zip(self.layout.subgroups, self.plan.placements))
            staged = [sg for sg, place in pairs if place is Placement.STAGED and sg not in self.residents
                      and (self._had_grad is None or sg.index in self._had_grad)]  # none last step: likely none now
            last = len(self._need_order)
            self._order_ahead = sorted(staged, key=lambda sg: self._need_order.get(sg.index, last))
            # the plan's residents count, some of which the update may admit only then; read once (the
            # budget's readings cost far more than a hook may, and the room is set by the measured need)
            planned = RESIDENT_BYTES_PER_ELEMENT * sum(sg.numel for sg, place in pairs if place is Placement.RESIDENT)
            self._room_ahead = self.planner.room_ahead(max(self.residents.bytes(), planned), 0)
        if self.prefetch.pending(self._order_ahead):
            self.prefetch.top_up(self._order_ahead, self._room_ahead - self.prefetch.step_bytes,
                                 self.planner.budget.note_fill, self._host_final)

    def _host_final(self, sg: Subgroup) -> Event | None:
        """When ``sg``'s host states are final (the last update, left running by ``overlap``, may still be
        writing them): an event, or None while that is not known yet."""
        return Done() if self.overlapper is None else self.overlapper.host_final(sg.index)

    def _drop_ahead(self, subgroups: Iterable[Subgroup] | None = None) -> None:
        """Forget the slots filled ahead (of ``subgroups``, else all): the host copy may change, or the step
        does not take them."""
        if getattr(self, "prefetch", None) is None:
            return
        self.prefetch.drop(None if subgroups is None else {sg.index for sg in subgroups})

    # ---- updates run ahead --------------------------------------------------------------------------
    def _run_ahead(self, sg: Subgroup) -> None:
        """From a gradient hook, as CPU subgroup ``sg``'s final gradients go down (``speculate``): its update
        starts with the hyper-parameters and step counts of now; ``step()`` keeps it or undoes it."""
        if not self._speculating or self.planner.pending:
            return  # the last step clipped; or calibration comes first
        # the last update (overlap) has counted its steps when it started, and its CPU work for this subgroup
        # is queued on the worker before this; it may still be flushing staged subgroups: if this was one of
        # them, the run-ahead waits for that flush on the worker. Only when that is not known yet does the
        # launching thread wait for the whole update (skipping instead missed the first subgroups backward
        # makes final).
        after = self._host_final(sg)
        if after is None:
            with self.grad_stream.annotated("dos.wait_last_update"):
                self.synchronize()
        if sg in self.residents:
            return  # a resident of an older plan: its states are on the GPU until the step evicts them
        group = self.param_groups[sg.group_index]
        try:
            check_group(group)
        except ValueError:
            return  # step() says what is wrong
        job = Job(sg, Placement.CPU, AdamHyper.from_group(group, self.adamw),
                  runs=sg.runs([True] * len(sg.bucket.params)))
        over = None
        if STAND_DOWN not in _STAND_DOWN_MODES:
            raise ValueError(f"optimizer.STAND_DOWN is {STAND_DOWN!r}: set it to True, False or 'forecast'")
        if STAND_DOWN and self._clip_seen is not None and self.scaler is None:  # (a loss scale keeps none ahead)
            over = self.grad_stream.clip_check(sg.index, self._clip_seen ** 2, forecast=STAND_DOWN == "forecast")
        self.speculation.start(job, self.grad_stream.landed[sg.index], after, over)

    def _undo_ahead(self, subgroups: Iterable[Subgroup] | None = None) -> None:
        """Put back the states before of the subgroups whose update ran ahead (of ``subgroups``, else all)."""
        if getattr(self, "speculation", None) is not None:
            self.speculation.undo(subgroups)

    def release_gpu_memory(self) -> None:
        """Move every resident state back to pinned host memory now (before a forward that needs more GPU
        memory than training did, e.g. evaluation with a larger batch); the next step admits them again."""
        self._open()
        self.synchronize()
        self.residents.evict()

    def _before_forward(self, args: tuple, kwargs: dict) -> None:
        """A forward with more input elements than any so far may need more memory than was measured: the
        residents leave before it runs, not after an out-of-memory error (the next step measures again)."""
        if self.layout is None:
            return
        size = sum(t.numel() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        if size > self._largest_input:
            if self._largest_input and len(self.residents):
                self.synchronize()
                self.residents.evict()
            self._largest_input = size

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master weight of ``p`` (its local shard under FSDP2): a view into pinned host memory."""
        self._open()
        self.synchronize()
        self.layout.take_edits(settle=False)
        if id(p) not in self.layout.where:
            raise KeyError("this param has no master: it is not in the optimizer, or had requires_grad=False "
                           "when the optimizer was built")
        self._make_current(p)
        return self.layout.views(p)["master"]

    # ---- schedule -----------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @schedule.setter
    def schedule(self, value: Schedule) -> None:
        self._open()
        self.synchronize()
        self.planner.plan(value)

    @property
    def plan(self) -> Plan:
        """Where each subgroup is updated now, with the performance model's prediction when it has one."""
        return self.planner.current

    @property
    def placements(self) -> list[Placement]:
        return list(self.plan.placements)

    # ---- the training-loop API ----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: multiplied by the loss scale for fp16 params, unchanged otherwise."""
        if self.scaler is None:
            return loss
        self._scaled_since_step = True
        return loss * self.scaler.scale

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside are not the last micro-batch of the step (with ``stream_grads``: their
        gradients stay on the GPU to be accumulated; without it, a no-op)."""
        self._open()
        with (self.grad_stream.accumulating() if self.grad_stream is not None else contextlib.nullcontext()):
            yield

    def _total_norm(self) -> torch.Tensor:
        if self.grad_stream is None:
            return total_norm(self.layout.grads(), self.device, self.group)
        return combine_norms(self.grad_stream.grad_norms(), self.device, self.group)

    def _has_grad(self) -> list[list[bool]]:
        flags = self.layout.has_grad()
        if self.grad_stream is None:
            return flags
        if self.grad_stream.gone and self.grad_stream.first_final_at is None and not self._warned_restep:
            self._warned_restep = True  # torch would step again with the gradients the params still hold
            warnings.warn("step() with no backward since the last step: the gradients stream_grads sent to the "
                          "host then are not stepped again (their .grad is None), where torch would step with "
                          "the gradients the params still hold. Call opt.zero_grad() between steps, or build "
                          "the optimizer with stream_grads=False", RuntimeWarning)
        return [[f or self.grad_stream.had_grad(p) for f, p in zip(fs, b.params)]
                for fs, b in zip(flags, self.layout.buckets)]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients to global L2 norm ``max_norm`` (applied in ``step``); returns the norm."""
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"max_norm must be a finite float > 0, got {max_norm!r}")
        self._open()
        self._norm_cache = self._total_norm()
        self._norm_of = self._grad_marks()
        self._clip_once = float(max_norm)
        if self.speculation is not None and self.max_grad_norm is None:  # the next backward's run-ahead expects it
            self._clip_seen = self._clip_once
            self.grad_stream.partial = True
        return self._norm_cache / self.scaler.scale if self.scaler is not None else self._norm_cache

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One AdamW step for every param that has a gradient; returns when params and states are updated."""
        began = time.perf_counter()
        self.synchronize()  # the previous update, if step() left it running
        if self._stepped_at is not None and self.last_update is not self._timed_update:  # the iteration priced
            self.planner.observe_step(began - self._stepped_at, self.last_update.params_done_s,
                                      time.perf_counter() - began, self.last_update.idle_tail_s or 0.0)
        self._stepped_at, self._timed_update = began, self.last_update
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._open()
        self._check_not_failed()
        self._check_groups()
        for group in self.param_groups:
            check_group(group)
        self.layout.check_unchanged(self.module)
        self.layout.sync_steps()
        self._refuse_new_grads()
        self.layout.take_edits()
        try:
            self._refuse_edited_grads()
            self._step(self._has_grad())
        finally:
            self.planner.budget.new_step()
            if self.grad_stream is not None:
                self.planner.observe_backward(self.grad_stream.backward_s())
                self.grad_stream.end_step()
            self._drop_ahead()  # those the update did not take: a skipped step's (the next backward refills)
            self._undo_ahead()  # those the step did not keep (a skipped or failed step's)
            if self.prefetch is not None:
                self.prefetch.restart()
            self._order_ahead = None
            self._sampled = False
        return loss

    def _step(self, has_grad: list[list[bool]]) -> None:
        if not any(map(any, has_grad)):  # torch: nothing to do when no param has a gradient
            self._norm_cache, self._clip_once = None, None
            return
        multipliers = self._grad_multipliers()
        if multipliers is None:  # inf/nan gradients: nothing updated
            return
        # an update run ahead applied no multiplier: kept only if the step applies none either (x * 1 == x)
        unscaled = self.speculation is None or all(float(m) == 1.0 for m in multipliers)
        hyper = [AdamHyper.from_group(g, self.adamw) for g in self.param_groups]
        streamed_for = self.plan  # the plan during backward: stream_grads sent its CPU subgroups down
        budget = self.planner.budget
        filled = budget.filled_at_peak(self.prefetch.step_bytes) if self.prefetch is not None else 0
        plan = now = self.planner.refresh(budget.held_at_peak(self.residents.bytes()), filled,
                                          self.prefetch.bytes() if self.prefetch is not None else 0,
                                          self.residents.bytes())
        slots = plan.slots  # what fits now
        landed = self.grad_stream.landed if self.grad_stream is not None else {}
        if landed:  # a new plan starts with the next backward; this step runs the one the gradients went for
            plan, slots = streamed_for, min(slots, streamed_for.slots)
        elif plan is not streamed_for:  # planned again: slots filled for the old plan would crowd the new one
            self._drop_ahead()
        # a subgroup whose gradients went down during backward takes the CPU path; so does a staged one that
        # needs a slot where none fits now and the plan of now stages nothing (a fixed schedule that stages
        # still gets one, with a warning): its host states are untouched, the CPU path is exact
        ready = self.prefetch.ready if self.prefetch is not None else {}
        to_cpu = not slots and Placement.STAGED not in now.placements
        self._ran = [Placement.CPU if i in landed or (to_cpu and place is Placement.STAGED and i not in ready)
                     else place for i, place in enumerate(plan.placements)]
        self._ran_as_planned = plan is streamed_for
        staged_ahead = FILL_BYTES_PER_ELEMENT * sum(sg.numel for sg in self._order_ahead or ())
        self._fills_bounded = self._room_ahead < staged_ahead  # fills short of it: priced by the planner's room
        self.residents.evict(keep={i for i, place in enumerate(self._ran) if place is Placement.RESIDENT})
        position = {id(b): k for k, b in enumerate(self.layout.buckets)}
        jobs = []
        for sg, place in zip(self.layout.subgroups, self._ran):
            runs = sg.runs(has_grad[position[id(sg.bucket)]])
            if runs:
                jobs.append(Job(sg, place, hyper[sg.group_index], runs=runs))
        self._had_grad = {j.subgroup.index for j in jobs}
        if self.speculation is not None:
            jobs = self.speculation.settle(jobs, keep=unscaled)
            self._speculating = unscaled or (not SIT_OUT_AFTER_CLIP and self.scaler is None)
        ahead = self.prefetch.take() if self.prefetch is not None else None
        if self.overlapper is not None:
            self._start_update(jobs, multipliers, max(slots, 1), landed, has_grad, ahead)
            return
        try:
            self.last_update = self.engine.update(jobs, multipliers, max(slots, 1), self.residents, landed,
                                                  ahead=ahead)
        except BaseException as err:
            self._failed = _failure(err)
            raise
        finally:
            self.layout.record_writes()
        self.planner.after_update()
        self._after_update(has_grad)

    def _after_update(self, has_grad: list[list[bool]] | None) -> None:
        """What follows an update that has ended; ``has_grad``: the params whose step counts it advances
        (None: counted when it started, ``_start_update``)."""
        self.planner.observe(self.last_update, self._ran, overlapped=self.overlapper is not None,
                             planned_in_backward=self._ran_as_planned, fills_bounded=self._fills_bounded)
        if has_grad is not None:
            self.layout.advance_steps(has_grad)
        self._expose_state()

    def _start_update(self, jobs: list[Job], multipliers: list[torch.Tensor], slots: int, landed: dict,
                      has_grad: list[list[bool]], ahead: dict | None = None) -> None:
        """Leave the update running (``overlap=True``): it reads this step's gradients (held here, so that
        zero_grad and the next backward may replace them) after the point where they are complete, and lets
        go of each as soon as the subgroups holding it have read it."""
        ready = current_point(self.device)
        last = len(self._need_order)
        jobs = sorted(jobs, key=lambda j: self._need_order.get(j.subgroup.index, last))  # as the forward reads
        grads = HeldGrads({id(p): (local(p.grad) if p.grad is not None else None)
                           for b in self.layout.buckets for p in b.params},
                          [j.subgroup for j in jobs if j.subgroup.index not in landed])

        def update() -> UpdateStats:  # touches no param's .grad: the next backward may be writing them
            try:
                return self.engine.update(jobs, multipliers, slots, self.residents, landed, ready=ready,
                                          grads=grads, on_written=self.overlapper.written, ahead=ahead,
                                          on_settled=self.overlapper.settled)
            finally:  # the params as we left them, here: an edit made after the update ended is the user's
                self.layout.record_writes()

        # the step counts move now (the jobs hold those they update with), so that the next backward may run a
        # subgroup's update ahead while this one still flushes others; whatever reads them synchronizes first
        self.layout.advance_steps(has_grad)
        self.overlapper.start(update, [j.subgroup.index for j in jobs])

    def synchronize(self) -> None:
        """Wait for the update that ``step()`` left running (``overlap=True``; a no-op otherwise) and raise its
        error if it failed. The optimizer calls it before anything that reads or writes params, states or
        step counts (the next step, ``opt.state``, ``state_dict``, ``master``, ``model.state_dict()``,
        ``model.load_state_dict()``); call it before reading params outside a forward some other way."""
        overlapper = getattr(self, "overlapper", None)
        if overlapper is None or not overlapper.busy:
            return
        try:
            self.last_update = overlapper.join()
        except BaseException as err:
            self._failed = _failure(err)
            raise
        # no planner.after_update(): the update ran beside the next forward, whose own peak must still count;
        # the update's buffers held at that peak are taken out of the need (``MemoryBudget.note_update``)
        self._after_update(None)

    def _refuse_edited_grads(self) -> None:
        """With stream_grads, a gradient changed in place after backward would reach only part of the step
        (decided by every rank together, so that all raise or none does)."""
        if self.grad_stream is None:
            return
        edited = self.grad_stream.edited()
        if self.planner.sync.anyone(edited is not None):
            raise RuntimeError(
                f"a gradient ({edited or 'on another rank'}) was changed in place after backward, but stream_grads "
                "had already sent other gradients to the host, which miss the change: clip with max_grad_norm= or "
                "opt.clip_grad_norm_, scale the loss with opt.scale_loss (not torch's GradScaler.unscale_), or "
                "build the optimizer with stream_grads=False to edit gradients between backward and step")

    def _refuse_new_grads(self) -> None:
        """A param frozen at construction has no host memory: refuse to silently ignore its new gradient."""
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and id(p) not in self.layout.where:
                    raise RuntimeError(f"a param of shape {tuple(p.shape)} had requires_grad=False when the optimizer "
                                       "was built and now has a gradient: it has no optimizer state. Build the "
                                       "optimizer after unfreezing it")

    def _grad_multipliers(self) -> list[torch.Tensor] | None:
        """Unscale and clip factors for this step, or None when the step is skipped (inf/nan gradients)."""
        clip = self._clip_once if self._clip_once is not None else self.max_grad_norm
        raw, self._norm_cache, self._clip_once = self._norm_cache, None, None
        # gradients changed after clip_grad_norm_ measured them (not those set to None since: as in torch, the
        # clip applies to those left) are measured again; every rank called it, so all ask together
        if raw is not None and self.planner.sync.anyone(
                any(m is not None and m != b for m, b in zip(self._grad_marks(), self._norm_of))):
            raw = self._total_norm()
            if bool(torch.isfinite(raw)):  # inf/nan ones: the step is skipped (or raises) below, as any such
                raise RuntimeError("the gradients changed after opt.clip_grad_norm_ measured them (another backward, "
                                   "or an edit of a .grad): the clip it returned is for the gradients it measured. "
                                   "Call it after the last backward and any change to the gradients; nothing "
                                   "was updated")
        if raw is None:
            raw = self._total_norm()
        # one device sync per step: no update is ever half applied. A non-finite norm of finite gradients
        # (huge ones: the squares overflow) steps, as torch's; with a loss scaler it is skipped and the scale
        # backs off instead (the norm of the unscaled gradients is not at hand to clip by)
        finite = bool(torch.isfinite(raw)) or (self.scaler is None and self._grads_finite())
        norm, multipliers = raw, []
        if self.scaler is not None:
            if not self._scaled_since_step:
                raise RuntimeError("fp16 params need a scaled loss before every step: call "
                                   "opt.scale_loss(loss).backward() (a second step() on the same gradients, with no "
                                   "backward of a scaled loss since the last, is refused too), or pass "
                                   "loss_scale=None to DeepOptimizerStates to train unscaled. Under a "
                                   "framework that never calls scale_loss (the Hugging Face Trainer), train bf16 "
                                   "or fp32 params with autocast instead of fp16 params")
            self._scaled_since_step = False
            inv_scale = 1.0 / self.scaler.scale
            self.scaler.update(found_inf=not finite)
            if not finite:  # an fp16 overflow is expected now and then: skip quietly, the scale backs off
                self.last_grad_norm = raw
                self.skipped_steps += 1
                if self.scaler.scale < MIN_LOSS_SCALE:
                    raise FloatingPointError(
                        f"inf/nan gradients at every loss scale down to {MIN_LOSS_SCALE:g} "
                        f"({self.scaler.skipped_steps} steps skipped so far): the loss or the model is not finite "
                        "whatever the scale (NaN in the data, a diverged run). Nothing was updated; reload the last "
                        "checkpoint, lower the lr, or train bf16")
                return None
            multipliers.append(torch.full((), inv_scale, device=self.device))
            norm = raw * inv_scale
        self.last_grad_norm = norm
        if not finite:
            if self.nonfinite == "raise":
                raise FloatingPointError(f"the gradients hold inf/nan (global norm {norm.item()}); nothing was "
                                         "updated. Pass nonfinite='skip' to skip such steps instead")
            self.skipped_steps += 1
            warnings.warn(f"step skipped: the gradients hold inf/nan (global norm {norm.item()}); params and "
                          f"optimizer states are unchanged ({self.skipped_steps} skipped so far)", RuntimeWarning)
            return None
        if clip is not None:
            multipliers.append(clip_coefficient(norm, clip))
        return multipliers

    def _grad_marks(self) -> list:
        """Which gradient tensor each param holds, and its version counter: what moves when a backward adds to
        the gradients, an edit changes one in place or a new one is set (``clip_grad_norm_``'s norm is then
        not theirs; a gradient set to None leaves nothing to clip)."""
        return [None if p.grad is None else (id(g := local(p.grad)), g.data_ptr(), g._version)
                for b in self.layout.buckets for p in b.params]

    @torch.no_grad()
    def _grads_finite(self) -> bool:
        """Whether every gradient of this step is finite, element by element (over the ranks too): asked
        only when the fp32 global norm is not, which finite gradients above ~1e19 / sqrt(numel) also give
        (torch's AdamW steps on them)."""
        ok = all(bool(torch.isfinite(g).all()) for g in self.layout.grads())
        if self.grad_stream is not None:
            for index, event in self.grad_stream.landed.items():
                if event is not None:
                    event.synchronize()
                sg = self.layout.subgroups[index]
                landed = sg.bf16_halves()[0] if self.engine.takes_bf16(sg) else sg.grad32
                ok = ok and bool(torch.isfinite(landed).all())
        if self.group is None:
            return ok
        flag = torch.tensor([0 if ok else 1], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return not bool(flag)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch: grads to None (or zeroed in place with ``set_to_none=False``); a pending
        ``clip_grad_norm_`` belongs to the gradients it measured and is dropped with them. Gradients set to
        None do not wait for an update left running (it holds the ones it reads); zeroed in place, they do.
        With ``stream_grads``, ``set_to_none=False`` gives the params whose gradients left the GPU in the last
        backward a zero gradient again, as torch would hold (a param that gets no gradient in the next
        backward is still stepped, as by torch): GPU memory that ``set_to_none=True`` saves."""
        if not set_to_none:
            self.synchronize()
        self._undo_ahead()  # the gradients they ran with are dropped: no step takes them
        super().zero_grad(set_to_none)
        self._norm_cache, self._clip_once = None, None
        if self.grad_stream is not None:
            if not set_to_none:
                self._zero_gone_grads()
            self.grad_stream.gone = {}
            self.grad_stream.reset()

    @torch.no_grad()
    def _zero_gone_grads(self) -> None:
        """The gradients stream_grads gave back in the last backward, as torch's ``zero_grad(set_to_none=False)``
        leaves them: zeros, of their dtype (warned once: it keeps the memory that streaming saves)."""
        gone = self.grad_stream.gone
        params = [p for b in self.layout.buckets for p in b.params if id(p) in gone and p.grad is None]
        if params and not self._warned_zeroed:
            self._warned_zeroed = True
            warnings.warn("zero_grad(set_to_none=False) with stream_grads gives every param whose gradient left "
                          "the GPU a zero gradient again (torch's semantics: a param without a gradient in the "
                          "next backward is still stepped), which holds the GPU memory that stream_grads saves "
                          "until backward sends it down again; zero_grad() (set_to_none=True) does not")
        for p in params:
            p.grad = torch.zeros_like(p, dtype=gone[id(p)])

    def memory(self) -> dict[str, int]:
        """Bytes this optimizer holds: pinned host memory (the fp32 states, allocated once), the GPU memory
        of resident states (kept between steps) and the GPU memory its last update allocated and freed
        (staging slots, scratch); with residency's counters (admitted, evicted, failed admissions) and the
        GPU memory budget, the measured need of forward + backward and what the optimizer held at the peak
        that set it (residents, slots filled ahead, an update left running: the peak's other part; None
        without a GPU)."""
        self._open()
        self.synchronize()
        budget = self.planner.budget
        c = self.residents.counters
        return {"host_bytes": self.layout.bytes()["host"], "device_resident_bytes": self.residents.bytes(),
                "device_update_bytes": self.last_update.device_bytes if self.last_update else 0,
                "resident_subgroups": len(self.residents), "admitted": c.admitted, "evicted": c.evicted,
                "failed_admissions": c.failed, "gpu_budget_bytes": budget.bytes() if budget.active else None,
                "gpu_need_bytes": budget.need, "gpu_ours_at_need_bytes": budget.ours_at_need}

    def calibrate(self, force: bool = False) -> None:
        """Load this machine's rates now, measuring them if none are stored or if ``force`` (else "auto" does
        it at the first step); cached per machine. Every rank of a sharded model calls it together."""
        self.synchronize()
        self.planner.calibrate(force)

    # ---- lifetime -----------------------------------------------------------------------------------
    def _open(self) -> None:
        if self.layout is None:
            raise RuntimeError("this DeepOptimizerStates was closed; build a new one")

    def _check_not_failed(self) -> None:
        """After an update failed part-way, its states are partly updated while no step count moved: refuse to
        train on them or to checkpoint them until a checkpoint is loaded."""
        if self._failed is not None:
            raise RuntimeError(f"an earlier update failed part-way ({self._failed}), so some params and moments "
                               "were updated and others not: load the last checkpoint with load_state_dict() (model "
                               "and optimizer) to go on")

    def close(self) -> None:
        """Free the pinned host memory and stop the CPU worker now, instead of when garbage collected."""
        if self.layout is None:
            return
        try:
            self.synchronize()  # an update's error is raised once everything below is closed
        finally:
            if self.overlapper is not None:
                self.overlapper.close()
            _remove_all(self._overlap_handles)
            self.engine.close()
            if self.grad_stream is not None:
                self.grad_stream.close()
            if self._hook is not None:
                self._hook.remove()
            self._drop_ahead()
            self.residents = Residents(self.device)  # the GPU states go with the optimizer
            dict.clear(self.state)
            self.layout = None

    def __enter__(self) -> "DeepOptimizerStates":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any):
        raise TypeError("DeepOptimizerStates cannot be copied or pickled (it owns pinned host memory, CUDA streams "
                        "and a worker thread): save opt.state_dict() and load it into a new optimizer")

    # ---- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's layout (per-param step/exp_avg/exp_avg_sq) plus fp32 ``master_param`` and the loss scaler."""
        self._open()
        self.synchronize()
        self._check_not_failed()
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self.layout.take_edits(settle=False)  # weights edited since the last step are what a checkpoint holds
        self.layout.sync_steps()
        self.residents.evict()  # the host copy is what a checkpoint holds (the next step admits them again)
        sd = state_io.pack(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError where ``load_state_dict`` would refuse ``state_dict`` (as given, before any
        load pre-hook), changing nothing: for checking a checkpoint before the model is loaded from it."""
        state_io.check(self, state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of ours (or of torch.optim.AdamW / Adam); validated whole before anything is written."""
        self._open()
        self.synchronize()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.residents.evict()  # loaded values go to the host; residents would overwrite them
        self._drop_ahead()  # and so would copies taken ahead of them
        self._undo_ahead()  # and a step would take updates run ahead of them as done
        state_io.load(self, state_dict)
        self._failed = None
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _weak(method: Callable, *first: Any) -> Callable:
    """``method`` (bound to the optimizer) called through a weak reference, with ``first`` before the
    caller's arguments: the optimizer's own parts hold it without a reference cycle, so dropping the
    optimizer frees it (its pinned memory with it) at once, as dropping a torch optimizer does, instead of
    at the next garbage collection. A function (not a partial), so that a deep copy of its holder leaves it
    as it is."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*first, *args, **kwargs)
    return call


def _failure(err: BaseException) -> str:
    """A failed update's error as text, with where it was raised: the exception itself would keep its
    traceback's frames, and the optimizer in them, alive after the user drops the optimizer."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f", raised at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def _forward_hook(ref: "weakref.ref[DeepOptimizerStates]") -> Callable:
    """The model's pre-forward hook (``_before_forward``), run as plain Python under torch.compile (one graph
    break before the forward): bookkeeping and evictions that dynamo need not trace, and that torch 2.11's
    dynamo refused to (a setattr on the optimizer)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        opt = ref()
        if opt is not None:
            opt._before_forward(args, kwargs)
    return torch.compiler.disable(hook)


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
