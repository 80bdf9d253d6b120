"""Maps params onto flat host buffers and cuts them into subgroups.

One *bucket* per param group: the fp32 master weights, exp_avg, exp_avg_sq and an fp32 gradient landing
zone of its params live in flat host buffers (pinned when the device is a GPU), one param after another.
The params and their gradients stay the model's own tensors (or, for FSDP2, the local shards of its
DTensors): savers, tied-weight detection and sharding see ordinary params. A *subgroup* is a contiguous
slice of a bucket: its gradients are gathered into one flat fp32 buffer, it moves in one copy each way,
and its params are scattered back from one flat fp32 buffer. Subgroups never mix param groups; they may
cut through a param (AdamW is element-wise, so that is exact).

The layout also keeps the bookkeeping that makes the host copy trustworthy: each param's step count (a
param without a gradient is left alone, as torch does), and each param's version, storage and fp32 L2 norm
after our last write, so that an edit made outside the optimizer (``model.load_state_dict``, ``p.copy_``,
``p.data = t``, and ``p.data.copy_(t)``, which moves no version counter that the param shares) is taken
into the masters instead of being undone by the next step. The norms cost one multi-tensor kernel over
the params after each write and one before each step; an edit through ``.data`` that keeps every
param's L2 norm (a sign flip, a permutation of its elements) is not seen.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

import torch

from .host_memory import HostSpec, check_host_capacity, host_empty_many

# torch's fused CPU AdamW updates a tensor in units of 16 fp32 elements (a cache line), each a vectorised
# body whose last (size % vector width) elements are rounded apart, as a scalar tail: a slice cut at a whole
# number of units from a param's start, and ending where the param ends, has exactly the tail torch gives
# that param (it updates each param apart), so its bits are torch's.
ALIGN = 16
HOST_BYTES_PER_ELEMENT = 16  # fp32 master + exp_avg + exp_avg_sq + grad landing zone
_HOST_BUFFERS = ("master", "exp_avg", "exp_avg_sq", "grad32")

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support
    DTensor = ()


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor this process holds: a DTensor's local shard, any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(eq=False)
class Bucket:
    """The params of one param group, mapped one after another onto flat host buffers."""

    group_index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    offsets: list[int]
    sizes: list[int]
    numel: int
    master: torch.Tensor = field(repr=False)
    exp_avg: torch.Tensor = field(repr=False)
    exp_avg_sq: torch.Tensor = field(repr=False)
    grad32: torch.Tensor = field(repr=False)
    steps: list[int] = field(repr=False)  # per param: optimizer steps taken
    step_tensors: list[torch.Tensor] = field(repr=False)  # the same, as torch's state["step"] tensors

    def param_slice(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.sizes[i])


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of param ``i`` (flattened) sit at [at, at + hi - lo) of their subgroup."""

    i: int
    lo: int
    hi: int
    at: int


@dataclass(eq=False)
class Subgroup:
    """A contiguous slice [start, end) of one bucket: the unit of transfer and update."""

    index: int
    bucket: Bucket
    start: int
    end: int
    pieces: list[Piece] = field(default_factory=list, repr=False)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def group_index(self) -> int:
        return self.bucket.group_index

    def _s(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.start : self.end]

    master = property(lambda self: self._s(self.bucket.master))
    exp_avg = property(lambda self: self._s(self.bucket.exp_avg))
    exp_avg_sq = property(lambda self: self._s(self.bucket.exp_avg_sq))
    grad32 = property(lambda self: self._s(self.bucket.grad32))

    @property
    def bf16(self) -> bool:
        """Every param here is bf16 (and so is its gradient)."""
        return all(self.bucket.params[pc.i].dtype == torch.bfloat16 for pc in self.pieces)

    def bf16_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """grad32's host memory as two bf16 buffers: the gradients landing, the rounded params going up
        (the bf16 CPU path, ``cpu_adamw.py``)."""
        return self.grad32.view(torch.bfloat16).view(2, self.numel).unbind(0)

    def gather_grads(self, dst: torch.Tensor, grads: dict[int, torch.Tensor | None] | None = None) -> None:
        """dst (flat fp32, or bf16 for bf16 params; any device) = this subgroup's gradients; a missing gradient
        reads as zeros.
        ``grads``: the gradients by id(param), held since the step began (an update left running reads
        those, whatever ``.grad`` holds by then); else each param's ``.grad`` now."""
        for pc in self.pieces:
            out = dst[pc.at : pc.at + pc.hi - pc.lo]
            p = self.bucket.params[pc.i]
            grad = local(p.grad) if grads is None else grads.get(id(p))
            if grad is None:
                out.zero_()
            else:
                out.copy_(grad.reshape(-1)[pc.lo : pc.hi], non_blocking=True)

    def scatter_params(self, src: torch.Tensor) -> None:
        """The model's params = src (flat fp32, or bf16 already rounded; on the params' device) rounded to each
        param's dtype."""
        for pc in self.pieces:
            p = local(self.bucket.params[pc.i]).detach()  # the CPU worker thread is not under no_grad
            p.view(-1)[pc.lo : pc.hi].copy_(src[pc.at : pc.at + pc.hi - pc.lo], non_blocking=True)

    def runs(self, has_grad: list[bool]) -> list[tuple[int, int, int]]:
        """(start, end, steps done) spans of this subgroup to update: params with a gradient, merged where
        neighbours share a step count (one fused kernel call per span) and the span so far is a whole number
        of ``ALIGN`` units (else the kernel would round the end of the earlier param as its body, where
        torch, updating each param apart, rounds it as a tail: see ``ALIGN``)."""
        out: list[tuple[int, int, int]] = []
        for pc in self.pieces:
            if not has_grad[pc.i]:
                continue
            steps, end = self.bucket.steps[pc.i], pc.at + pc.hi - pc.lo
            if out and out[-1][1] == pc.at and out[-1][2] == steps and (pc.at - out[-1][0]) % ALIGN == 0:
                out[-1] = (out[-1][0], end, steps)
            else:
                out.append((pc.at, end, steps))
        return out


def _split(sizes: list[int], subgroup_size: int) -> list[tuple[int, int]]:
    """Cut a bucket (its params' numels, in order) into near-equal pieces of about ``subgroup_size``
    elements at most (up to ``ALIGN`` - 1 more); a cut inside a param falls a whole number of ``ALIGN``
    units from its start, so that updating the two sides apart rounds every element as torch does."""
    numel = sum(sizes)
    count = max(1, math.ceil(numel / subgroup_size))
    step = math.ceil(numel / count)
    offsets = list(itertools.accumulate(sizes, initial=0))
    cuts = [0]
    for target in range(step, numel, step):
        off = offsets[bisect.bisect_right(offsets, target) - 1]  # the start of the param holding ``target``
        cut = off + (target - off) // ALIGN * ALIGN
        if cut > cuts[-1]:
            cuts.append(cut)
    return list(zip(cuts, [*cuts[1:], numel]))


def subgroup_count(groups: list[tuple[list[torch.Tensor], list[str]]], subgroup_size: int) -> int:
    """How many subgroups a ``Layout`` of these groups will have, known before any host memory is pinned."""
    sizes = [[local(p).numel() for p in params] for params, _ in groups]
    return sum(len(_split(n, subgroup_size)) for n in sizes if sum(n))


def _pieces(bucket: Bucket, start: int, end: int) -> list[Piece]:
    """The params' elements in [start, end) of the bucket (from the first param that reaches ``start``)."""
    out = []
    for i in range(max(0, bisect.bisect_right(bucket.offsets, start) - 1), len(bucket.offsets)):
        off, n = bucket.offsets[i], bucket.sizes[i]
        if off >= end:
            break
        lo, hi = max(start, off), min(end, off + n)
        if lo < hi:
            out.append(Piece(i, lo - off, hi - off, lo - start))
    return out


class Layout:
    """All buckets and subgroups of one optimizer; owns the host buffers and the per-param bookkeeping."""

    def __init__(self, groups: list[tuple[list[torch.nn.Parameter], list[str]]], subgroup_size: int,
                 device: torch.device, local_ranks: int = 1, before_allocating=None) -> None:
        """``local_ranks``: processes on this host that build the same layout (FSDP2 shards are near-equal),
        so the host-memory check counts them all; ``before_allocating`` runs after the check (FSDP2: a
        barrier, so that no rank's allocation shrinks what another rank's check reads)."""
        self.device = device
        sizes = [[local(p).numel() for p in params] for params, _ in groups]
        self.numel = sum(map(sum, sizes))
        pin = device.type == "cuda"
        what = "the optimizer's host buffers" + (f" of {local_ranks} ranks on this host" if local_ranks > 1 else "")
        check_host_capacity(self.numel * HOST_BYTES_PER_ELEMENT * local_ranks, what)
        if before_allocating is not None:
            before_allocating()
        self.buckets: list[Bucket] = []
        self.subgroups: list[Subgroup] = []
        for gi, ((params, names), numels) in enumerate(zip(groups, sizes)):
            if not params:
                continue
            offsets = [0, *itertools.accumulate(numels)][:-1]
            n = sum(numels)
            specs = [HostSpec(n, torch.float32, zero=k != "master") for k in _HOST_BUFFERS]
            host = dict(zip(_HOST_BUFFERS, host_empty_many(specs, pin, progress="pinning optimizer states")))
            bucket = Bucket(gi, list(params), list(names), offsets, numels, n, **host, steps=[0] * len(params),
                            step_tensors=[torch.zeros(()) for _ in params])
            self.buckets.append(bucket)
            for start, end in _split(numels, subgroup_size) if n else ():
                self.subgroups.append(Subgroup(len(self.subgroups), bucket, start, end, _pieces(bucket, start, end)))
        self.dtypes = {id(p): p.dtype for b in self.buckets for p in b.params}
        self.shapes = {id(p): tuple(local(p).shape) for b in self.buckets for p in b.params}
        self.where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._seen: dict[int, tuple[int, int]] = {}
        self._pending: set[int] = set()  # ids of params whose loaded master waits for the next step (recheck)
        self.before_host_write = None  # (bucket, i) -> None: called before an edit is written to a master
        with torch.no_grad():
            for b in self.buckets:
                for i in range(len(b.params)):
                    self.take_param(b, i)
        self._norms = self._param_norms()

    def subgroups_of(self, b: Bucket, i: int) -> list[Subgroup]:
        """The subgroups that hold elements of param i of bucket b."""
        s = b.param_slice(i)  # an empty param is in no subgroup (its offset may fall inside one)
        return [sg for sg in self.subgroups if sg.bucket is b and s.start < s.stop and sg.start < s.stop
                and sg.end > s.start]

    def views(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """p's master, exp_avg and exp_avg_sq: views into the host buffers, shaped like its local tensor."""
        b, i = self.where[id(p)]
        s, shape = b.param_slice(i), local(p).shape
        return {k: getattr(b, k)[s].view(shape) for k in ("master", "exp_avg", "exp_avg_sq")}

    # ---- the masters follow the model --------------------------------------------------------------
    def take_param(self, b: Bucket, i: int) -> None:
        """Master of param i = the model's value now (exact: every param dtype widens to fp32). Up-cast on
        the param's device, so the copy to the host is one DMA into pinned memory. A loaded master waiting
        for the next step's recheck is superseded."""
        b.master[b.param_slice(i)].copy_(local(b.params[i]).reshape(-1).float())
        self._pending.discard(id(b.params[i]))
        self._note(b.params[i])

    def _note(self, p: torch.Tensor) -> None:
        t = local(p)
        self._seen[id(p)] = (t._version, t.data_ptr())

    @torch.no_grad()
    def _param_norms(self, only: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Every param's (or ``only`` those params') fp32 L2 norm, bits as int32 (so that a NaN equals
        itself): one multi-tensor kernel."""
        params = [local(p).detach() for p in (only if only is not None else
                                              [p for b in self.buckets for p in b.params])]
        if not params:
            return torch.zeros(0, dtype=torch.int32)
        return torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32)).view(torch.int32)

    def record_writes(self) -> None:
        """Remember every param's version, storage and norm after our own writes (the update, a loaded
        state_dict)."""
        for b in self.buckets:
            for p in b.params:
                self._note(p)
        self._norms = self._param_norms()

    def recheck(self, params: list[torch.Tensor]) -> None:
        """Masters loaded for ``params`` without writing them: at the next step's ``take_edits`` each keeps
        its master if the param holds that master rounded (the weights of the same checkpoint, loaded before
        or after), else takes the param's value (other weights: the model's, as torch's AdamW would use).
        Reads before that step (``master``, ``state_dict``) see the loaded master and settle nothing."""
        self._pending.update(id(p) for p in params)

    @torch.no_grad()
    def take_edits(self, settle: bool = True, only: torch.Tensor | None = None) -> list[str]:
        """Masters of params changed outside the optimizer since our last write := their new values.

        An in-place edit (``model.load_state_dict``, ``p.copy_`` under no_grad) bumps the param's version;
        a new tensor behind it (``p.data = t``) changes its storage; an edit through ``p.data`` moves neither
        but changes the param's norm. A param written back with the value it had (the same weights loaded
        again, an EMA swapped in and back out) keeps its master: taking the rounded bf16 value would lose the
        master's low bits. ``only``: that param alone (a read of its states), at the cost of its own norm.
        Outside a step (``settle=False``) nothing is taken from a model whose params changed dtype, device or
        shape (``changed``: the step refuses them by name first; the host states stay readable). Returns the
        edited params' names.
        """
        if not settle and self.changed():
            return []
        pairs = [(b, i) for b in self.buckets for i in range(len(b.params))]
        if only is None:
            todo, now = range(len(pairs)), self._param_norms()
            moved = (now != self._norms).tolist()  # one device sync
        else:
            b, i = self.where[id(only)]
            k = next(k for k, (c, j) in enumerate(pairs) if c is b and j == i)
            todo, now = [k], self._norms.clone()
            now[k] = self._param_norms([only])[0]
            moved = {k: bool(now[k] != self._norms[k])}  # one device sync
        edited = []
        for k in todo:
            b, i = pairs[k]
            p = b.params[i]
            t = local(p)
            loaded = id(p) in self._pending
            if loaded and not settle:  # a loaded master: the step decides (recheck)
                continue
            self._pending.discard(id(p))
            if loaded or moved[k] or self._seen[id(p)] != (t._version, t.data_ptr()):
                if self.before_host_write is not None:
                    self.before_host_write(b, i)  # a resident's states back on the host first
                if self._rounds_to(b, i, t):
                    self._note(p)
                else:
                    self.take_param(b, i)
                    edited.append(b.names[i])
        self._norms = now
        return edited

    @staticmethod
    def _rounds_to(b: Bucket, i: int, t: torch.Tensor) -> bool:
        """Whether param i's master, rounded to the param's dtype, is exactly the param's value ``t``."""
        if t.numel() != b.sizes[i]:
            return False
        rounded = b.master[b.param_slice(i)].to(device=t.device).to(t.dtype).view(t.shape)
        return bool(torch.equal(rounded, t))

    def changed(self) -> str | None:
        """The first param whose dtype, device or shape changed since the layout was built, and how; None."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                t = local(p)
                what = None
                if t.dtype != self.dtypes[id(p)]:
                    what = f"its dtype changed from {self.dtypes[id(p)]} to {t.dtype} (model.half()/.float()/.to())"
                elif t.device.type != self.device.type or (self.device.index is not None
                                                           and t.device.index != self.device.index):
                    what = f"it moved from {self.device} to {t.device}"
                elif t.numel() != b.sizes[i]:
                    what = f"its size changed to {t.numel()} elements"
                elif tuple(t.shape) != self.shapes[id(p)]:  # the moments would meet other elements
                    what = f"its shape changed from {self.shapes[id(p)]} to {tuple(t.shape)}"
                elif not t.is_contiguous():
                    what = "it is no longer contiguous (p.data was replaced by a strided tensor)"
                if what:
                    return f"param {b.names[i]}: {what}"
        return None

    def check_unchanged(self, module: torch.nn.Module | None) -> None:
        """Refuse a step on params whose dtype, device or shape changed, or that left the model."""
        what = self.changed()
        if what:
            raise RuntimeError(f"{what} after the optimizer was built. The optimizer would update buffers the model "
                               "no longer uses: change dtype or device before building DeepOptimizerStates (or "
                               "build a new one and load_state_dict)")
        if module is not None:
            live = {id(p) for p in module.parameters()}
            for b in self.buckets:
                for i, p in enumerate(b.params):
                    if id(p) not in live:
                        raise RuntimeError(f"param {b.names[i]} is no longer a param of the model (replaced by a "
                                           "new Parameter?): its updates would be lost. Build the optimizer after "
                                           "replacing params, or copy new values into the existing param")

    # ---- gradients and steps ------------------------------------------------------------------------
    def has_grad(self) -> list[list[bool]]:
        """Per bucket, per param: whether it has a gradient this step (torch skips params whose grad is None)."""
        out = []
        for b in self.buckets:
            flags = []
            for i, p in enumerate(b.params):
                g = p.grad
                if g is not None and (g.is_sparse or local(g).layout != torch.strided):
                    raise RuntimeError(f"param {b.names[i]} has a sparse gradient: DeepOptimizerStates (like torch's "
                                       "fused AdamW) needs dense gradients; use sparse=False in the embedding")
                flags.append(g is not None)
            out.append(flags)
        return out

    def grads(self) -> list[torch.Tensor]:
        """The local gradients that exist now."""
        return [local(p.grad) for b in self.buckets for p in b.params if p.grad is not None]

    def sync_steps(self) -> None:
        """Step counts as ``opt.state[p]["step"]`` holds them (a user may have changed one in place)."""
        for b in self.buckets:
            for i, t in enumerate(b.step_tensors):
                value = float(t)
                if value != b.steps[i]:
                    if not (value >= 0 and value == int(value)):
                        raise ValueError(f"param {b.names[i]}: opt.state[p]['step'] must be a whole number >= 0, "
                                         f"got {value}")
                    b.steps[i] = int(value)

    def advance_steps(self, has_grad: list[list[bool]]) -> None:
        for b, flags in zip(self.buckets, has_grad):
            for i, flag in enumerate(flags):
                if flag:
                    b.steps[i] += 1
                    b.step_tensors[i].fill_(b.steps[i])

    def bytes(self) -> dict[str, int]:
        """Host bytes the layout holds (pinned on a GPU machine)."""
        return {"host": self.numel * HOST_BYTES_PER_ELEMENT}
