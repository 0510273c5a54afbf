"""rankwise: low-rank training that adapts its rank, for PyTorch.

The public API of the low-rank training core is re-exported here; ``rankwise.ode`` and
``rankwise.ckpt`` hold the other two capabilities.
"""

from .lowrank import DLRT as DLRT
from .lowrank import SDLRT as SDLRT
from .lowrank import AbstractLowRankLayer as AbstractLowRankLayer
from .lowrank import LowRankConv2d as LowRankConv2d
from .lowrank import LowRankLinear as LowRankLinear
from .lowrank import compression as compression
from .lowrank import stability_distance as stability_distance
from .lowrank import to_low_rank as to_low_rank

__version__ = "0.1.0"
