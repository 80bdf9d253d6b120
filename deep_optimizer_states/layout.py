"""Packs parameters into flat buffers and cuts them into subgroups.

One *bucket* per (param group, dtype): the model's params become views into one flat device buffer, their
gradients views into a flat device grad buffer, and the fp32 master weights, exp_avg, exp_avg_sq and an
fp32 gradient landing zone live in flat host buffers of the same length (pinned when the device is a GPU).
A *subgroup* is a contiguous slice of a bucket: it moves in one copy each way and is updated by one call
of the fused AdamW kernel. Subgroups never mix param groups; they may cut through a parameter (AdamW is
element-wise, so that is exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .host_memory import check_host_capacity, host_empty

ALIGN = 64  # elements: every param starts 128-byte aligned (bf16), so GEMMs keep their fast paths
HOST_BYTES_PER_ELEMENT = 16  # fp32 master + exp_avg + exp_avg_sq + grad landing zone


@dataclass
class Bucket:
    """The params of one param group that share a dtype, packed into flat buffers."""

    group_index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    param_flat: torch.Tensor = field(repr=False)
    grad_flat: torch.Tensor = field(repr=False)
    master: torch.Tensor = field(repr=False)
    exp_avg: torch.Tensor = field(repr=False)
    exp_avg_sq: torch.Tensor = field(repr=False)
    grad32: torch.Tensor = field(repr=False)

    def param_slice(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.params[i].numel())

    def grad_view(self, i: int) -> torch.Tensor:
        return self.grad_flat[self.param_slice(i)].view_as(self.params[i])


@dataclass
class Subgroup:
    """A contiguous slice [start, end) of one bucket: the unit of transfer and update."""

    index: int
    bucket: Bucket
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def group_index(self) -> int:
        return self.bucket.group_index

    def _s(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.start : self.end]

    param = property(lambda self: self._s(self.bucket.param_flat))
    grad = property(lambda self: self._s(self.bucket.grad_flat))
    master = property(lambda self: self._s(self.bucket.master))
    exp_avg = property(lambda self: self._s(self.bucket.exp_avg))
    exp_avg_sq = property(lambda self: self._s(self.bucket.exp_avg_sq))
    grad32 = property(lambda self: self._s(self.bucket.grad32))


def _keep_grad_in(view: torch.Tensor):
    """A hook that moves a freshly allocated .grad (after someone set it to None) into the flat buffer."""

    def hook(p: torch.Tensor) -> None:
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    return hook


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _split(numel: int, subgroup_size: int) -> list[tuple[int, int]]:
    """Cut [0, numel) into near-equal aligned pieces of at most about ``subgroup_size`` elements."""
    count = max(1, math.ceil(numel / subgroup_size))
    step = _aligned(math.ceil(numel / count))
    return [(s, min(s + step, numel)) for s in range(0, numel, step)]


class Layout:
    """All buckets and subgroups of one optimizer; owns every flat buffer, device and host."""

    def __init__(self, param_groups: list[dict], subgroup_size: int, device: torch.device) -> None:
        plan = []  # (group index, dtype, params, offsets, numel)
        for gi, group in enumerate(param_groups):
            by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
            for p in group["params"]:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, params in by_dtype.items():
                offsets, n = [], 0
                for p in params:
                    offsets.append(n)
                    n += _aligned(p.numel())
                plan.append((gi, dtype, params, offsets, n))
        self.numel = sum(entry[-1] for entry in plan)
        self.device = device
        pin = device.type == "cuda"
        check_host_capacity(self.numel * HOST_BYTES_PER_ELEMENT, "the optimizer's host buffers")

        self.buckets: list[Bucket] = []
        self.subgroups: list[Subgroup] = []
        for gi, dtype, params, offsets, n in plan:
            bucket = self._build_bucket(gi, dtype, params, offsets, n, pin)
            self.buckets.append(bucket)
            for start, end in _split(n, subgroup_size) if n else ():
                self.subgroups.append(Subgroup(len(self.subgroups), bucket, start, end))
        for sg in self.subgroups:  # fp32 masters from the model's current weights, one subgroup at a time
            sg.master.copy_(sg.param)

    @staticmethod
    def _build_bucket(gi, dtype, params, offsets, n, pin) -> Bucket:
        device = params[0].device
        param_flat = torch.zeros(n, dtype=dtype, device=device)
        grad_flat = torch.zeros(n, dtype=dtype, device=device)
        host = {k: host_empty(n, torch.float32, pin) for k in ("master", "exp_avg", "exp_avg_sq", "grad32")}
        host["exp_avg"].zero_()
        host["exp_avg_sq"].zero_()
        host["grad32"].zero_()
        bucket = Bucket(gi, params, offsets, n, param_flat, grad_flat, **host)
        for i, p in enumerate(params):
            view = param_flat[bucket.param_slice(i)].view_as(p)
            view.copy_(p.detach())
            p.data = view
            if p.grad is not None:
                bucket.grad_view(i).copy_(p.grad)
            p.grad = bucket.grad_view(i)
            p.register_post_accumulate_grad_hook(_keep_grad_in(bucket.grad_view(i)))
        return bucket

    def sync_grads(self) -> None:
        """Make every param's .grad the view into its flat buffer again.

        Someone (``model.zero_grad()``, a framework) may have set ``p.grad = None`` or replaced it; the
        accumulate hook copies fresh grads back, and a param that got no gradient counts as zero.
        """
        for b in self.buckets:
            for i, p in enumerate(b.params):
                view = b.grad_view(i)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view

    def grad_views(self) -> list[torch.Tensor]:
        return [b.grad_view(i) for b in self.buckets for i in range(len(b.params))]

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad_flat.zero_()
        self.sync_grads()
