"""Deep Optimizer States: AdamW with offloaded optimizer states, updated interleaved on the CPU and the GPU."""

from .core.engine import UpdateStats
from .core.schedule import Placement
from .optimizer import DeepOptimizerStates

__all__ = ["DeepOptimizerStates", "Placement", "UpdateStats"]
__version__ = "0.1.0"
