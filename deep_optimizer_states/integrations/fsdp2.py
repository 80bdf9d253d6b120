"""Crash-safe sharded checkpoints of an FSDP2 model and its optimizer, through torch.distributed.checkpoint.

The same layout and guarantees as ``deep_optimizer_states.checkpoint`` (a ``step-N/`` directory per
checkpoint, a manifest with every file's sha256 and size, written into a hidden temporary sibling and
renamed into place only when complete, older ones pruned afterwards), with the model and optimizer state
written by DCP: each rank writes its own shards, and a checkpoint saved on N ranks loads on any number of
ranks, or in one process without a process group. ``latest_checkpoint`` and ``list_checkpoints`` find
these checkpoints too. Every rank calls ``save_sharded_checkpoint`` and ``load_sharded_checkpoint``; the
directory must be one that every rank sees (one host, or a shared file system).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..checkpoint import (FORMAT, FORMAT_VERSION, MANIFEST, CheckpointError, _check_files, _check_loadable,
                          _cpu_copy, _fsync_dir, _load_payload, _prune, _sha256, _write_bytes, _write_payload,
                          check_save_args, new_checkpoint_paths, read_manifest)
from .. import state_io
from ..optimizer import DeepOptimizerStates

SHARDS = "dcp"  # the sub-directory DCP writes into
EXTRA = "extra.pt"
OPTIMIZER_EXTRA = "optimizer-extra.pt"  # ours beyond DCP's state and param_groups: the loss scaler, skips


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _from_rank0(value):
    """Rank 0's ``value`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_states(optimizer: torch.optim.Optimizer):
    """Ours shows every param's state to DCP (no zero-gradient "initialising" step, every param saved)."""
    return optimizer.every_state_shown() if isinstance(optimizer, DeepOptimizerStates) else contextlib.nullcontext()


def _optimizer_extra(optimizer: torch.optim.Optimizer) -> dict | None:
    return state_io.dos_entry(optimizer) if isinstance(optimizer, DeepOptimizerStates) else None


def save_sharded_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                            extra: dict | None = None, step: int | None = None, keep: int = 2) -> Path:
    """Write one sharded checkpoint of ``model`` and ``optimizer`` (and rank 0's ``extra``) under
    ``directory``, atomically; then delete all but the newest ``keep``. Call on every rank."""
    check_save_args(extra, step, keep)
    problem, payload = None, None
    if _rank() == 0 and extra is not None:  # before any collective: every rank raises, or none does
        try:
            payload = _cpu_copy(extra, {})
            _check_loadable(payload, "extra")
        except (TypeError, ValueError) as e:
            problem = e
    problem = _from_rank0(None if problem is None else (type(problem), str(problem)))
    if problem:
        raise problem[0](problem[1])
    root = Path(directory)
    names = None
    if _rank() == 0:
        serial, final, temp = new_checkpoint_paths(root, step)
        names = (serial, str(final), str(temp))
    serial, final, temp = _from_rank0(names)
    temp, final = Path(temp), Path(final)
    try:
        with _all_states(optimizer):
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            dcp.save(state, checkpoint_id=str(temp / SHARDS))
        _barrier()  # every rank's shards are written
        if _rank() == 0:
            files = {}
            if payload is not None:
                files[EXTRA] = _write_payload(temp / EXTRA, payload)
            if (ours := _optimizer_extra(optimizer)) is not None:
                files[OPTIMIZER_EXTRA] = _write_payload(temp / OPTIMIZER_EXTRA, ours)
            for f in sorted((temp / SHARDS).iterdir()):
                with open(f, "rb") as handle:
                    os.fsync(handle.fileno())
                files[f"{SHARDS}/{f.name}"] = {"sha256": _sha256(f), "size": f.stat().st_size}
            _fsync_dir(temp / SHARDS)
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "serial": serial, "step": step,
                        "created_unix": time.time(), "torch_version": torch.__version__, "files": files,
                        "sharded": True, "world_size": world}
            _write_bytes(temp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(temp)
            os.rename(temp, final)
            _fsync_dir(root)
            _prune(root, keep, final)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    _barrier()
    return final


def load_sharded_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                            verify: bool = True) -> dict:
    """Verify sharded checkpoint ``path`` (files, sizes, and sha256 on rank 0 unless ``verify=False``), load
    it into ``model`` and ``optimizer`` (resharded to this run's ranks) and return its ``extra`` dict."""
    path = Path(path)
    manifest = read_manifest(path)
    if not manifest.get("sharded"):
        raise CheckpointError(f"{path}: not a sharded checkpoint; load it with checkpoint.load_checkpoint")
    _check_files(path, manifest, checksums=False)
    problem = None
    if verify and _rank() == 0:
        try:
            _check_files(path, manifest, checksums=True)
        except CheckpointError as e:
            problem = str(e)
    problem = _from_rank0(problem)
    if problem:
        raise CheckpointError(problem)
    files = manifest["files"]
    ours = None
    if OPTIMIZER_EXTRA in files and isinstance(optimizer, DeepOptimizerStates):
        ours = _load_payload(path / OPTIMIZER_EXTRA, files[OPTIMIZER_EXTRA], "cpu")
        try:  # every rank reads the same file: all refuse, before anything is loaded, or none does
            state_io.check_dos(ours)
        except ValueError as e:
            raise CheckpointError(f"{path / OPTIMIZER_EXTRA}: {e}") from None
    with _all_states(optimizer):
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path / SHARDS))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if ours is not None:
        state_io.load_dos(optimizer, ours)
    return _load_payload(path / EXTRA, files[EXTRA], "cpu") if EXTRA in files else {}
