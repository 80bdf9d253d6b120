"""``opt.state``: per-param views into the optimizer's host buffers, kept truthful.

torch users read ``opt.state[p]["exp_avg"]`` and frameworks write it back (Lightning and Accelerate move
every state tensor to the model's device after a load: ``state[p][k] = state[p][k].to(device)``). Here a
read first makes the host copy current (a resident subgroup's GPU states are evicted to it), and a write
copies the values into the host buffer instead of replacing the view: the optimizer keeps updating the
buffer it owns, so a state_dict never holds a stale copy and no framework parks 12 bytes per param on the
GPU behind our back.
"""

from __future__ import annotations

from typing import Any, Callable, ItemsView, KeysView, NoReturn, ValuesView

import torch


RESET_MESSAGE = ("DeepOptimizerStates keeps each param's states in its own host buffers, so they cannot be removed "
                 "or replaced through opt.state: to start over, build a new optimizer; to restore states, use "
                 "load_state_dict(); to change one, assign into it (opt.state[p]['exp_avg'] = t, "
                 "opt.state[p]['step'] = 0)")


class ParamState(dict):
    """One param's state: step, exp_avg, exp_avg_sq, master. Assigning a tensor to a key that holds one
    writes its values into the held tensor (``before_write(key)`` runs first, ``after_write(key)`` after)."""

    def __init__(self, values: dict, before_write: Callable[[str], None], after_write: Callable[[str], None]) -> None:
        super().__init__(values)
        self._before, self._after = before_write, after_write

    def __setitem__(self, key, value) -> None:
        held = dict.get(self, key)
        if key == "step" and isinstance(held, torch.Tensor) and isinstance(value, (int, float)) \
                and not isinstance(value, bool):  # torch allows a plain number here
            value = torch.tensor(float(value))
        if isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor) and value is not held:
            if value.shape != held.shape:
                raise ValueError(f"opt.state[p][{key!r}] has shape {tuple(held.shape)}; cannot assign a tensor of "
                                 f"shape {tuple(value.shape)}")
            self._before(key)
            with torch.no_grad():
                held.copy_(value)
            self._after(key)
            return
        if value is held:
            return
        if held is not None:
            raise TypeError(f"opt.state[p][{key!r}] holds a tensor the optimizer updates: assign a tensor of its "
                            f"shape (or a number to 'step'), got {type(value).__name__}")
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        raise RuntimeError(RESET_MESSAGE)

    def pop(self, *args: Any) -> NoReturn:
        raise RuntimeError(RESET_MESSAGE)

    def clear(self) -> None:
        raise RuntimeError(RESET_MESSAGE)


class HostState(dict):
    """``opt.state``: reading an entry first makes it current (``on_read(param)``; ``on_read(None)`` for
    all params), so a resident subgroup's states are evicted to the host before anyone sees them. Every
    access first runs ``on_access()`` (an update left running by ``step()`` ends first: it adds entries
    and moves step counts)."""

    def __init__(self, on_read: Callable[[torch.Tensor | None], None],
                 on_access: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self._on_read, self._on_access = on_read, on_access

    def __missing__(self, key):  # torch's optimizer state is a defaultdict(dict)
        value = {}
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key, value) -> None:
        if isinstance(dict.get(self, key), ParamState) or not isinstance(value, (ParamState, dict)) or value:
            raise RuntimeError(RESET_MESSAGE)
        dict.__setitem__(self, key, value)

    def __reduce_ex__(self, protocol):
        raise TypeError("opt.state holds views into the optimizer's pinned host buffers and cannot be copied or "
                        "pickled: copy opt.state_dict() instead")

    def expose(self, key: torch.Tensor, value: "ParamState | None") -> None:
        """The optimizer's own bookkeeping: show ``value`` as the param's state (None: none)."""
        if value is None:
            dict.pop(self, key, None)
        else:
            dict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        raise RuntimeError(RESET_MESSAGE)

    def pop(self, *args: Any) -> NoReturn:
        raise RuntimeError(RESET_MESSAGE)

    def popitem(self) -> NoReturn:
        raise RuntimeError(RESET_MESSAGE)

    def clear(self) -> None:
        raise RuntimeError(RESET_MESSAGE)

    def __getitem__(self, key):
        self._on_access()
        if dict.__contains__(self, key):
            self._on_read(key)
        return super().__getitem__(key)

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        self._on_access()
        if dict.__contains__(self, key):
            self._on_read(key)
        return super().get(key, default)

    def values(self) -> ValuesView:
        self._on_access()
        self._on_read(None)
        return super().values()

    def items(self) -> ItemsView:
        self._on_access()
        self._on_read(None)
        return super().items()

    def __contains__(self, key) -> bool:
        self._on_access()
        return super().__contains__(key)

    def __iter__(self):
        self._on_access()
        return super().__iter__()

    def __len__(self) -> int:
        self._on_access()
        return super().__len__()

    def keys(self) -> KeysView:
        self._on_access()
        return super().keys()

    def raw(self, key: torch.Tensor) -> "ParamState | None":
        """The entry without making it current (the optimizer's own bookkeeping)."""
        return dict.get(self, key)
