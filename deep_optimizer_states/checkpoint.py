"""Crash-safe checkpoints: atomic saves with a manifest, and loads that verify before they touch anything.

A checkpoint is a sub-directory of a root (``step-000000123/``) holding ``model.pt``, ``optimizer.pt`` and
``extra.pt`` (whichever were given) and ``manifest.json``: the format version, each file's sha256 and size,
and every tensor's key path, shape and dtype. ``save_checkpoint`` writes it into a hidden temporary sibling,
fsyncs every file and the directory, and renames it into place; a process killed at any moment leaves
either the whole new checkpoint or none of it, and the older ones untouched (they are pruned only after the
new one is durable). ``load_checkpoint`` checks files, checksums and shapes first and raises
``CheckpointError`` naming what differs, before the model or optimizer is modified.

One saver per root directory at a time; readers may run alongside it. Tensors are plain (unsharded) ones:
FSDP2's sharded state goes through ``integrations.fsdp2.save_sharded_checkpoint`` (DCP, the same layout).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

FORMAT = "deep_optimizer_states.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_TEMP = ".tmp-"
_TRASH = ".trash-"
_OURS = re.compile(r"(step|ckpt)-\d{9}(\.\d+)?")  # the names save_checkpoint gives
_LEFTOVER = re.compile(rf"({re.escape(_TEMP)}|{re.escape(_TRASH)}){_OURS.pattern}\..+")
_PLAIN = (str, int, float, complex, bytes, type(None), torch.dtype, torch.device, torch.Size)
_FILES = {"model": "model.pt", "optimizer": "optimizer.pt", "extra": "extra.pt"}

__all__ = ["CheckpointError", "save_checkpoint", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "read_manifest"]


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model/optimizer it is loaded into."""


# ---- saving -----------------------------------------------------------------------------------------------
def save_checkpoint(directory: str | os.PathLike, model: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
                    step: int | None = None, keep: int = 2) -> Path:
    """Write one checkpoint under ``directory`` atomically; then delete all but the newest ``keep``.

    Returns the new checkpoint's path. Tensors are saved as contiguous CPU copies, so a view into a large
    shared buffer (as DeepOptimizerStates' state) stores only its own bytes, and GPU tensors need no GPU to
    load. Peak extra host memory is one copy of the model's or the optimizer's state, whichever is larger.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if optimizer is not None and not callable(getattr(optimizer, "state_dict", None)):
        raise TypeError(f"optimizer must have a state_dict() method (a torch.optim.Optimizer), "
                        f"got {type(optimizer).__name__}")
    check_save_args(extra, step, keep)
    if model is None and optimizer is None and extra is None:
        raise ValueError("nothing to save: pass a model, an optimizer or extra")

    root = Path(directory)
    serial, final, temp = new_checkpoint_paths(root, step)
    sources = {"model": model.state_dict if model is not None else None,
               "optimizer": optimizer.state_dict if optimizer is not None else None,
               "extra": (lambda: extra) if extra is not None else None}
    try:
        files = {}
        for role, source in sources.items():
            if source is not None:
                payload = _cpu_copy(source(), {})
                _check_loadable(payload, role)
                files[_FILES[role]] = _write_payload(temp / _FILES[role], payload)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "serial": serial, "step": step,
                    "created_unix": time.time(), "torch_version": torch.__version__, "files": files}
        _write_bytes(temp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(temp)
        os.rename(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _prune(root, keep, final)
    return final


def new_checkpoint_paths(root: Path, step: int | None) -> tuple[int, Path, Path]:
    """(serial, final path, temporary directory) of the next checkpoint under ``root``; the temporary
    directory is created, hidden, beside where the checkpoint will be renamed to."""
    root.mkdir(parents=True, exist_ok=True)
    serial = 1 + max((m["serial"] for _, m in _manifests(root)), default=0)
    name = f"step-{step:09d}" if step is not None else f"ckpt-{serial:09d}"
    if (root / name).exists():
        name = f"{name}.{serial}"
    temp = root / f"{_TEMP}{name}.{os.getpid()}.{secrets.token_hex(4)}"
    temp.mkdir()
    return serial, root / name, temp


def check_save_args(extra: Any, step: Any, keep: Any) -> None:
    """Refuse bad ``extra``/``step``/``keep`` of a save, naming what to change (shared with sharded saves)."""
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}; wrap it: extra={{'value': ...}}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an int >= 0 or None, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (how many checkpoints to keep), got {keep!r}")


def _cpu_copy(obj: Any, memo: dict[tuple, torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a contiguous CPU copy owning its storage.

    Tensors viewing the same memory the same way (tied weights) share one copy, through ``memo``.

    Mappings become dicts (OrderedDicts stay OrderedDicts, with a module state_dict's ``_metadata``) and
    sequences lists/tuples, so the file holds only types torch.load(weights_only=True) reads.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided:
            return t.to("cpu", copy=True)
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key not in memo:
            memo[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)
        return memo[key]
    if isinstance(obj, OrderedDict):
        out = OrderedDict((k, _cpu_copy(v, memo)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, Mapping):
        return {k: _cpu_copy(v, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return (list if isinstance(obj, list) else tuple)(_cpu_copy(v, memo) for v in obj)
    return obj


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, value) for every non-container value in nested mappings/sequences; parts joined with '/'."""
    if isinstance(obj, Mapping):
        items = obj.items()
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = enumerate(obj)
    else:
        yield prefix, obj
        return
    for k, v in items:
        yield from _leaves(v, f"{prefix}/{k}" if prefix else str(k))


def _tensors(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    return ((k, v) for k, v in _leaves(obj) if isinstance(v, torch.Tensor))


def _check_loadable(obj: Any, role: str) -> None:
    """Refuse a value load_checkpoint could not read back (it loads with weights_only=True), naming its key."""
    for key, leaf in _leaves(obj):
        if isinstance(leaf, (torch.Tensor, *_PLAIN)):
            continue
        buffer = io.BytesIO()
        try:
            torch.save(leaf, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as e:
            raise TypeError(f"{role} key {key!r} holds a {type(leaf).__name__}, which torch.save and "
                            f"torch.load(weights_only=True) can't round-trip ({_reason(e)}); store only tensors and "
                            "plain Python values (numbers, strings, lists, dicts), e.g. obj.state_dict() instead of "
                            "obj") from None


def _reason(e: Exception) -> str:
    """The informative line of a torch.load error (weights-only refusals bury it in advice)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    detail = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    return f"{type(e).__name__}: {(detail or lines or [''])[0]}"


def _tensor_table(obj: Any) -> dict[str, dict]:
    return {k: {"shape": list(t.shape), "dtype": str(t.dtype)} for k, t in _tensors(obj)}


def _write_payload(path: Path, obj: Any) -> dict:
    """torch.save ``obj`` to ``path`` durably; return its manifest entry."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": _sha256(path), "size": path.stat().st_size, "tensors": _tensor_table(obj)}


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed files) durable; a no-op where directories can't be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Delete complete checkpoints beyond the newest ``keep``, and leftovers of interrupted saves/prunes.

    Only what save_checkpoint names is touched: directories (not links) named as it names checkpoints and
    its temporary and trash directories; a user's copy, link or other folder in the root stays. A checkpoint
    is renamed to a hidden name before it is removed, so a prune killed halfway never leaves a half-deleted
    directory that looks like a checkpoint.
    """
    ours = [p for p in list_checkpoints(root) if _OURS.fullmatch(p.name) and not p.is_symlink()]
    for old in ours[keep:]:
        if old != newest:
            trash = root / f"{_TRASH}{old.name}.{secrets.token_hex(4)}"
            os.rename(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
    for leftover in root.iterdir():
        if _LEFTOVER.fullmatch(leftover.name) and leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


# ---- finding ----------------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict:
    """The parsed ``manifest.json`` of checkpoint ``path``; CheckpointError if it is absent or unreadable."""
    path = Path(path)
    file = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not file.is_file():
        hint = ("it holds checkpoints: pass latest_checkpoint(...) of it" if any(_manifests(path)) else
                "the save was interrupted, or it was not written by save_checkpoint; "
                "use latest_checkpoint(root) to find the newest complete checkpoint")
        raise CheckpointError(f"{path}: no {MANIFEST}: {hint}")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable manifest ({e}); load an older checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {version!r}, this code reads up to {FORMAT_VERSION}: "
                              "upgrade deep_optimizer_states to load it")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("serial"), int):
        raise CheckpointError(f"{file}: manifest lacks 'files' or 'serial'")
    return manifest


def _manifests(root: Path) -> Iterator[tuple[Path, dict]]:
    """(path, manifest) for every sub-directory of ``root`` with a readable manifest (complete or not)."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.name.startswith(".") or not (child / MANIFEST).is_file():
            continue
        try:
            yield child, read_manifest(child)
        except CheckpointError:
            continue


def _check_files(path: Path, manifest: dict, checksums: bool) -> None:
    """Raise CheckpointError on the first file that is missing, has the wrong size or (optionally) checksum."""
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (the manifest lists it); load an older checkpoint")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry['size']}: the file is truncated "
                                  "or was replaced; load an older checkpoint")
        if checksums and (digest := _sha256(file)) != entry["sha256"]:
            raise CheckpointError(f"{file}: sha256 {digest[:16]}... differs from the manifest's "
                                  f"{entry['sha256'][:16]}...: the file is corrupt; load an older checkpoint")


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``directory`` (readable manifest, files present at their sizes), newest first."""
    found = []
    for path, manifest in _manifests(Path(directory)):
        try:
            _check_files(path, manifest, checksums=False)
        except CheckpointError:
            continue
        found.append((manifest["serial"], path.name, path))
    return [path for *_, path in sorted(found, reverse=True)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None; interrupted saves are ignored."""
    found = list_checkpoints(directory)
    return found[0] if found else None


# ---- loading ----------------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike, model: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, map_location: Any = "cpu",
                    verify: bool = True) -> dict:
    """Verify checkpoint ``path``, load it into ``model`` then ``optimizer``, and return its ``extra`` dict.

    Every check (files, sizes, sha256 unless ``verify=False``, the model's keys/shapes/dtypes, the optimizer's
    groups and state shapes; for DeepOptimizerStates every check of its ``load_state_dict``) runs before
    anything is modified; a failure raises CheckpointError naming the file or key. Only if another
    optimizer's ``load_state_dict`` (or ours behind a load pre-hook) still refuses is the model already
    loaded, and the error says so.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if manifest.get("sharded"):
        raise CheckpointError(f"{path}: a sharded (FSDP2) checkpoint: load it with "
                              "deep_optimizer_states.integrations.fsdp2.load_sharded_checkpoint")
    _check_files(path, manifest, checksums=verify)
    files = manifest["files"]
    for role, obj in (("model", model), ("optimizer", optimizer)):
        if obj is not None and _FILES[role] not in files:
            raise CheckpointError(f"{path}: no {_FILES[role]} (it was saved without a {role}); pass {role}=None")
    if model is not None:
        _check_model(path, model, files[_FILES["model"]]["tensors"])
    wanted = {"model": model is not None, "optimizer": optimizer is not None, "extra": True}
    loaded = {role: _load_payload(path / name, files[name], map_location)
              for role, name in _FILES.items() if name in files and wanted[role]}
    if optimizer is not None:
        _check_optimizer(path, optimizer, loaded["optimizer"])
        check = getattr(optimizer, "check_state_dict", None)  # ours: every check, nothing written
        if callable(check) and not getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None):
            try:
                check(loaded["optimizer"])
            except (ValueError, TypeError) as e:
                raise CheckpointError(f"{path / _FILES['optimizer']}: {e}; nothing was loaded") from None
    if model is not None:
        model.load_state_dict(loaded["model"])
    if optimizer is not None:
        try:
            optimizer.load_state_dict(loaded["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError, OverflowError) as e:
            raise CheckpointError(f"{path / _FILES['optimizer']}: the optimizer's load_state_dict refused it ({e}); "
                                  "the model is already loaded, the optimizer keeps what its load_state_dict left "
                                  "(torch's optimizers and DeepOptimizerStates check before writing)") from e
    return loaded.get("extra", {})


def _load_payload(file: Path, entry: dict, map_location: Any) -> Any:
    """torch.load (weights only) ``file`` and check its tensors against the manifest."""
    try:
        obj = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{file}: torch.load(weights_only=True) failed ({_reason(e)}); load an older "
                              "checkpoint") from None
    table = _tensor_table(obj)
    if table != entry["tensors"]:
        key = min(k for k in table.keys() | entry["tensors"].keys() if table.get(k) != entry["tensors"].get(k))
        raise CheckpointError(f"{file}: tensor {key!r} is {_describe(table.get(key))} in the file but "
                              f"{_describe(entry['tensors'].get(key))} in the manifest; load an older checkpoint")
    return obj


def _describe(entry: dict | None) -> str:
    return f"shape {tuple(entry['shape'])} {entry['dtype']}" if entry else "absent"


def _check_model(path: Path, model: nn.Module, saved: dict[str, dict]) -> None:
    """Raise CheckpointError on the first key, shape or dtype where ``model`` differs from the checkpoint."""
    own = _tensor_table(model.state_dict())
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"{path / _FILES['model']}: keys differ from the model's: "
                              f"missing in the checkpoint {missing[:5]}, not in the model {unexpected[:5]}; "
                              "build the model with the configuration the checkpoint was saved with")
    for key, entry in own.items():
        if entry != saved[key]:
            raise CheckpointError(f"{path / _FILES['model']}: key {key!r}: checkpoint has {_describe(saved[key])}, "
                                  f"the model has {_describe(entry)}; build the model with the configuration "
                                  "(shapes and dtype) the checkpoint was saved with")


def _check_optimizer(path: Path, optimizer: torch.optim.Optimizer, sd: Any) -> None:
    """Raise CheckpointError where the saved state_dict does not fit ``optimizer``'s param groups.

    Non-scalar per-param state tensors must have their param's shape, as in every elementwise optimizer
    (Adam, AdamW, SGD, DeepOptimizerStates).
    """
    file = path / _FILES["optimizer"]
    if not (isinstance(sd, dict) and isinstance(sd.get("param_groups"), list) and isinstance(sd.get("state"), dict)):
        raise CheckpointError(f"{file}: not an optimizer state_dict (needs 'state' and 'param_groups')")
    saved_groups, groups = sd["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"{file}: {len(saved_groups)} param groups, the optimizer has {len(groups)}; build "
                              "the optimizer with the param groups it was saved with")
    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved.get("params", ())) != len(group["params"]):
            raise CheckpointError(f"{file}: param group {gi} has {len(saved.get('params', ()))} params, the "
                                  f"optimizer's {len(group['params'])}; build the optimizer over the same params")
        for idx, p in zip(saved["params"], group["params"]):
            for key, value in (sd["state"].get(idx) or {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise CheckpointError(f"{file}: state/{idx}/{key} has shape {tuple(value.shape)}, its param "
                                          f"(group {gi}) has {tuple(p.shape)}; build the optimizer over the same "
                                          "params")
