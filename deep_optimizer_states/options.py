"""The optimizer's options checked before anything is built: a bad value fails at once with what to change,
not after the host memory for a big model has been pinned (tens of seconds)."""

from __future__ import annotations

import math
from typing import Any

from .core.schedule import Schedule, validate_schedule
from .core.speculate import DEFAULT_SPECULATIVE_SUBGROUPS
from .planning.budget import validate_budget

NONFINITE_POLICIES = ("skip", "raise")
PREFETCH_RELEASE = "release"  # prefetch's value for the slots filled ahead given back at their flush


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_options(*, subgroup_size: Any, staging_slots: Any, betas: Any, max_grad_norm: Any, nonfinite: Any,
                  schedule: Schedule, gpu_memory_budget: Any, stream_grads: Any, overlap: Any, prefetch: Any,
                  speculate: Any, bf16_cpu_path: Any, has_model: bool) -> int:
    """Raise ValueError for the first option that is wrong; return how many subgroups may run ahead
    (``speculate``: True means the default count, False 0)."""
    if not _positive_int(subgroup_size):
        raise ValueError(f"subgroup_size must be an int > 0 (elements per subgroup), got {subgroup_size!r}")
    if not _positive_int(staging_slots):
        raise ValueError(f"staging_slots must be an int >= 1, got {staging_slots!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and not isinstance(
            max_grad_norm, bool) and max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"max_grad_norm must be a finite float > 0 or None, got {max_grad_norm!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    validate_schedule(schedule)
    validate_budget(gpu_memory_budget)
    for name, value in (("stream_grads", stream_grads), ("overlap", overlap), ("bf16_cpu_path", bf16_cpu_path)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if not (isinstance(prefetch, bool) or (isinstance(prefetch, str) and prefetch == PREFETCH_RELEASE)):
        raise ValueError(f"prefetch must be True, False or {PREFETCH_RELEASE!r} (each slot filled ahead given back "
                         f"at its flush: a lower GPU peak), got {prefetch!r}")
    if prefetch and not stream_grads:
        raise ValueError(f"prefetch={prefetch!r} needs stream_grads=True: the copies start from its gradient hooks "
                         "in backward")
    if isinstance(speculate, bool):
        speculate = DEFAULT_SPECULATIVE_SUBGROUPS if speculate else 0
    if not isinstance(speculate, int) or speculate < 0:
        raise ValueError(f"speculate must be True, False or an int >= 0 (subgroups updated ahead), "
                         f"got {speculate!r}")
    if speculate and not stream_grads:
        raise ValueError("speculate needs stream_grads=True: the CPU path's update runs ahead from its gradient "
                         "hooks in backward")
    if overlap and not has_model:
        raise ValueError("overlap=True needs the model, to make each module's forward wait for its own params: "
                         "pass the model itself as the first argument, or as model= beside param groups")
    return speculate
