"""torchrun support for the `dos` commands: join the process group, shard a model with FSDP2, leave cleanly."""

from __future__ import annotations

import os
import sys

import torch


def world_size() -> int:
    """Processes in the job (torchrun's WORLD_SIZE; 1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join(device: torch.device) -> tuple[torch.device, int, int]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on GPUs, gloo on the CPU) and take
    this rank's GPU; returns (device, rank, world size)."""
    import torch.distributed as dist

    if world_size() <= 1:
        return device, 0, 1
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, dist.get_rank(), dist.get_world_size()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each decoder layer (``model.model.layers`` of a Hugging Face causal LM), then the root."""
    from ..core.fsdp_api import fully_shard

    for layer in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(layer)
    return fully_shard(model)


def _reduce(value: float, op) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=op)
    return float(t.item())


def mean_over_ranks(value: float, world: int) -> float:
    """The mean of every rank's ``value``."""
    return value if world == 1 else _reduce(value, torch.distributed.ReduceOp.SUM) / world


def max_over_ranks(value: float, world: int) -> float:
    """The largest of every rank's ``value``."""
    return value if world == 1 else _reduce(value, torch.distributed.ReduceOp.MAX)


def leave(rc: int) -> None:
    """End a torchrun job's process once its work is done and reported: a barrier, then exit without
    interpreter teardown, where a gloo process now and then aborts in C++ static destructors ("terminate
    called without an active exception") and turns a finished run into a failed exit status."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
