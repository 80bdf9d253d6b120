"""Which subgroups are updated where: the schedule a user asks for, turned into one placement per subgroup."""

from __future__ import annotations

from enum import Enum
from typing import Sequence, Union

# Until the calibrated performance model chooses, "auto" stages this fraction of subgroups: the best point
# of our sweep on an H200 (1.36B params, subgroups of 25M: k=2 took 0.284 s, docs/update-phase.md).
AUTO_STAGED_FRACTION = 0.5
# The schedules the performance model places: "auto" keeps what fits of the states resident on the GPU and
# splits the rest between the CPU and staging; "offload" keeps every state on the host and only splits.
MODELLED = ("auto", "offload")


class Placement(str, Enum):
    CPU = "cpu"  # grad down to host, fused AdamW on the CPU, fp32 master up and cast on the GPU
    STAGED = "staged"  # master/exp_avg/exp_avg_sq up into a GPU slot, fused AdamW on the GPU, states back
    RESIDENT = "resident"  # states kept on the GPU across steps, updated in place (no PCIe traffic)


Schedule = Union[str, int, Sequence[Union[Placement, str]]]


def validate_schedule(schedule: Schedule) -> Schedule:
    """Return ``schedule`` if it is "auto", "offload", "cpu", "gpu", an int k >= 1, or one placement per
    subgroup ("cpu", "staged", "resident"; a tuple of ``Placement``); raise a ValueError otherwise."""
    if isinstance(schedule, (list, tuple)):
        try:
            return tuple(Placement(p) for p in schedule)
        except ValueError:
            raise ValueError(f"a schedule given per subgroup holds 'cpu', 'staged' or 'resident' for each subgroup, "
                             f"got {list(schedule)!r}") from None
    if isinstance(schedule, bool) or not isinstance(schedule, (str, int)):
        raise ValueError(f"schedule must be 'auto', 'offload', 'cpu', 'gpu', an int k >= 1 or a placement per "
                         f"subgroup, got {schedule!r}")
    if isinstance(schedule, int) and schedule < 1:
        raise ValueError(f"schedule k must be >= 1 (one subgroup in every k staged to the GPU), got {schedule}")
    if isinstance(schedule, str) and schedule not in MODELLED + ("cpu", "gpu"):
        raise ValueError(f"schedule must be 'auto', 'offload', 'cpu', 'gpu', an int k >= 1 or a placement per "
                         f"subgroup, got {schedule!r}")
    return schedule


def spread(count: int, staged: int) -> list[Placement]:
    """``staged`` of ``count`` subgroups staged, spread evenly (the first one staged)."""
    places = [Placement.CPU] * count
    for i in range(staged):
        places[(i * count) // staged] = Placement.STAGED
    return places


def placements(schedule: Schedule, count: int) -> list[Placement]:
    """One placement per subgroup. k: subgroups 0, k, 2k, ... are staged (k=1 stages all)."""
    if isinstance(schedule, tuple):
        if len(schedule) != count:
            raise ValueError(f"the schedule gives {len(schedule)} placements for {count} subgroups: give one per "
                             "subgroup (len(opt.layout.subgroups))")
        return list(schedule)
    if schedule == "cpu":
        return [Placement.CPU] * count
    if schedule == "gpu":
        return [Placement.STAGED] * count
    if schedule in MODELLED:
        return spread(count, round(count * AUTO_STAGED_FRACTION))
    return [Placement.STAGED if i % schedule == 0 else Placement.CPU for i in range(count)]
