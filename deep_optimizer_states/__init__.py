"""Deep Optimizer States: AdamW with offloaded optimizer states, updated interleaved on the CPU and the GPU."""

from .engine import UpdateStats
from .optimizer import DeepOptimizerStates
from .schedule import Placement

__all__ = ["DeepOptimizerStates", "Placement", "UpdateStats"]
__version__ = "0.1.0"
