"""Two-dimensional coded checkpoints with peer repair (work in progress: codec core)."""

from ._code2d import Code2D as Code2D
from ._code2d import Commitment as Commitment
from ._code2d import Dispersal as Dispersal
from ._code2d import Fragment as Fragment
from ._code2d import NotEnoughSymbols as NotEnoughSymbols
from ._code2d import RepairSymbols as RepairSymbols
