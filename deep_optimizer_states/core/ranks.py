"""What one rank shares with the others: the process group its params are sharded over (FSDP2), and the
host it shares with the other ranks launched on the same machine (cores, memory bandwidth, host memory).

Nothing here sets up distributed training: FSDP2 (``fully_shard``) does that. We read what it built.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .layout import DTensor


def shard_group(params: list[torch.Tensor]) -> "dist.ProcessGroup | None":
    """The process group the params are sharded over, or None when they are ordinary tensors.

    Supported: every param a DTensor sharded (``Shard``) over the same one-dimensional mesh, as FSDP2's
    ``fully_shard`` makes them. Replicated dimensions (HSDP, DDP) would count a gradient several times in
    the global norm, so they are refused for now.
    """
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return None
    if len(sharded) != len(params):
        raise ValueError("some params are DTensors (FSDP2) and some are not: shard the whole model with "
                         "fully_shard, or give the optimizer only the sharded params")
    mesh = sharded[0].device_mesh
    for p in sharded:
        if p.device_mesh != mesh or mesh.ndim != 1 or not all(pl.is_shard() for pl in p.placements):
            raise NotImplementedError(f"params sharded as {p.placements} over a {mesh.ndim}-d mesh: "
                                      "DeepOptimizerStates supports FSDP2 sharding over one 1-d mesh (Shard)")
    return mesh.get_group()


def local_ranks() -> int:
    """How many ranks torchrun (or another launcher that sets LOCAL_WORLD_SIZE) started on this host."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads_per_rank(requested: int | None, gpu: bool = False) -> int | None:
    """Threads for this rank's CPU AdamW: ``requested``, else the host's cores split between its local ranks
    when a launcher started several (torchrun sets OMP_NUM_THREADS=1, which would leave the CPU path on one
    core). With a ``gpu`` one core of each rank's share is left out: the thread that drives the GPU (copies,
    event waits, which spin, and the training loop's kernel launches) runs beside the CPU path, and an
    OpenMP team as large as the cores then waits at every barrier for a thread the scheduler parked (one H200,
    16 threads on 16 cores: the engine's CPU path calibrated 6x below the bare kernel, three times in a row;
    15 threads: a plan that mixes both paths, its update at the model's bound). None leaves torch's setting
    alone (one process per host without a GPU, or a thread count already below the cores, e.g. the user's
    OMP_NUM_THREADS or torch.set_num_threads)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"cpu_threads must be an int >= 1 or None, got {requested!r}")
        return requested
    n, spare = local_ranks(), int(gpu)
    if n == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        fewer = max(1, host_cores() - spare)
        return fewer if torch.get_num_threads() > fewer else None
    return max(1, host_cores() // n - spare)


def use_cpu_threads(requested: int | None, device: torch.device) -> int:
    """Set torch's CPU threads to those this rank's CPU path runs on beside ``device``
    (``cpu_threads_per_rank``) and return the count. The optimizer and ``dos calibrate`` / ``dos plan`` call
    it alike: the rates are cached under a fingerprint that holds the thread count, so a calibration
    measured on other threads than the optimizer's is one it never finds (until 2026-12-03 ``dos calibrate``
    measured on all 16 cores of an H200 host, the optimizer ran 15 and calibrated again at its first step)."""
    threads = cpu_threads_per_rank(requested, gpu=device.type == "cuda")
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def all_reduce_sum_(t: torch.Tensor, group: "dist.ProcessGroup | None") -> torch.Tensor:
    """Sum ``t`` over the group in place (a no-op without one)."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class RankSync:
    """The collective decisions of the ranks that share one optimizer's plan (a no-op in one process).

    Calibration under FSDP2 measures the host while every rank does the same thing at the same moment (the
    ranks of a host share its cores, memory bandwidth and PCIe root), and every rank must take the same
    branch: one that calibrated while another loaded a stored result would wait forever at a barrier.
    """

    def __init__(self, group: "dist.ProcessGroup | None", device: torch.device) -> None:
        self.group, self.device = group, device

    @property
    def collective(self) -> bool:
        return self.group is not None

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def mean(self, values: list[float]) -> list[float]:
        """Each value averaged over the ranks."""
        if self.group is None:
            return list(values)
        t = all_reduce_sum_(torch.tensor(values, dtype=torch.float64, device=self.device), self.group)
        return (t / dist.get_world_size(self.group)).tolist()

    def everyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        if self.group is None:
            return flag
        t = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64, device=self.device)
        return all_reduce_sum_(t, self.group).item() == 0

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        return not self.everyone(not flag)
