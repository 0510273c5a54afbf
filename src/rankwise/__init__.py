"""rankwise: low-rank training that adapts its rank, for PyTorch.

The public API of the low-rank training core is re-exported here; ``rankwise.ode`` and
``rankwise.ckpt`` hold the other two capabilities.

The names are resolved on first use (PEP 562), so that ``import rankwise`` — and the
``rankwise`` command line, which imports this package first — does not pay for importing
torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "DLRT": "rankwise.lowrank",
    "AugmentedBUG": "rankwise.lowrank",
    "Budget": "rankwise.lowrank",
    "Feedback": "rankwise.lowrank",
    "SeedFeedback": "rankwise.lowrank",
    "Tolerance": "rankwise.lowrank",
    "TwoSidedFeedback": "rankwise.lowrank",
    "Sgd": "rankwise.lowrank",
    "Adam": "rankwise.lowrank",
    "AdamW": "rankwise.lowrank",
    "Muon": "rankwise.lowrank",
    "DenseEMA": "rankwise.lowrank",
    "Settings": "rankwise.lowrank",
    "SDLRT": "rankwise.lowrank",
    "AbstractLowRankLayer": "rankwise.lowrank",
    "LowRankConv2d": "rankwise.lowrank",
    "LowRankLinear": "rankwise.lowrank",
    "LowRankConv1D": "rankwise.lowrank",
    "LowRankMultiheadAttention": "rankwise.lowrank",
    "compression": "rankwise.lowrank",
    "clip_grad_norm_": "rankwise.lowrank",
    "grad_norm": "rankwise.lowrank",
    "export": "rankwise.lowrank",
    "stability_distance": "rankwise.lowrank",
    "to_low_rank": "rankwise.lowrank",
    "fit": "rankwise.train",
    "MemoryCount": "rankwise._memory",
    "training_memory": "rankwise._memory",
}

_SUBMODULES = frozenset({"lowrank", "ode", "ckpt", "peft", "models", "data", "train", "train_config", "dist",
                         "linalg", "experiments", "cli"})

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # what static tools and IDEs see
    from ._memory import MemoryCount as MemoryCount
    from ._memory import training_memory as training_memory
    from .lowrank import DLRT as DLRT
    from .lowrank import SDLRT as SDLRT
    from .lowrank import AbstractLowRankLayer as AbstractLowRankLayer
    from .lowrank import Adam as Adam
    from .lowrank import AdamW as AdamW
    from .lowrank import AugmentedBUG as AugmentedBUG
    from .lowrank import Budget as Budget
    from .lowrank import DenseEMA as DenseEMA
    from .lowrank import Feedback as Feedback
    from .lowrank import LowRankConv1D as LowRankConv1D
    from .lowrank import LowRankConv2d as LowRankConv2d
    from .lowrank import LowRankLinear as LowRankLinear
    from .lowrank import LowRankMultiheadAttention as LowRankMultiheadAttention
    from .lowrank import Muon as Muon
    from .lowrank import SeedFeedback as SeedFeedback
    from .lowrank import Settings as Settings
    from .lowrank import Sgd as Sgd
    from .lowrank import Tolerance as Tolerance
    from .lowrank import TwoSidedFeedback as TwoSidedFeedback
    from .lowrank import clip_grad_norm_ as clip_grad_norm_
    from .lowrank import compression as compression
    from .lowrank import export as export
    from .lowrank import grad_norm as grad_norm
    from .lowrank import stability_distance as stability_distance
    from .lowrank import to_low_rank as to_low_rank
    from .train import fit as fit


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # ``rankwise.models`` etc. without importing them first
        return importlib.import_module(f"rankwise.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rankwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    """The public names and the subpackages (not this module's own imports)."""
    return sorted({*_LAZY, *_SUBMODULES, "__version__"})
