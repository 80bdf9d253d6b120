"""FSDP2's public names wherever this torch keeps them: ``torch.distributed.fsdp`` since torch 2.6,
``torch.distributed._composable.fsdp`` in torch 2.5 (the oldest we support). None of them on a torch built
without distributed support. Imported where FSDP2 is used, not with the package (it loads torch.distributed)."""

from __future__ import annotations

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:
    try:  # torch 2.5
        from torch.distributed._composable.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                                        fully_shard)
    except ImportError:  # a torch build without distributed support
        CPUOffloadPolicy = FSDPModule = MixedPrecisionPolicy = fully_shard = None

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "fully_shard"]
