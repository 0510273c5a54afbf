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
    "DLRT": "rankwise.optim",
    "AugmentedBUG": "rankwise.optim",
    "Budget": "rankwise.optim",
    "Feedback": "rankwise.optim",
    "SeedFeedback": "rankwise.optim",
    "Tolerance": "rankwise.optim",
    "TwoSidedFeedback": "rankwise.optim",
    "SGD": "rankwise.optim",
    "Adam": "rankwise.optim",
    "AdamW": "rankwise.optim",
    "Muon": "rankwise.optim",
    "DenseEMA": "rankwise.optim",
    "Settings": "rankwise.optim",
    "SDLRT": "rankwise.optim",
    "AbstractLowRankLayer": "rankwise.nn",
    "LowRankConv2d": "rankwise.nn",
    "LowRankLinear": "rankwise.nn",
    "LowRankConv1D": "rankwise.nn",
    "LowRankMultiheadAttention": "rankwise.nn",
    "compression": "rankwise.nn",
    "clip_grad_norm_": "rankwise.optim",
    "grad_norm": "rankwise.optim",
    "export": "rankwise.nn",
    "stability_distance": "rankwise.nn",
    "to_low_rank": "rankwise.nn",
    "fit": "rankwise.train",
    "MemoryCount": "rankwise._memory",
    "training_memory": "rankwise._memory",
}

_SUBMODULES = frozenset({"nn", "optim", "lowrank", "ode", "ckpt", "peft", "models", "data", "train",
                         "train_config", "dist", "linalg", "experiments", "cli"})

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # what static tools and IDEs see
    from ._memory import MemoryCount as MemoryCount
    from ._memory import training_memory as training_memory
    from .nn import AbstractLowRankLayer as AbstractLowRankLayer
    from .nn import LowRankConv1D as LowRankConv1D
    from .nn import LowRankConv2d as LowRankConv2d
    from .nn import LowRankLinear as LowRankLinear
    from .nn import LowRankMultiheadAttention as LowRankMultiheadAttention
    from .nn import compression as compression
    from .nn import export as export
    from .nn import stability_distance as stability_distance
    from .nn import to_low_rank as to_low_rank
    from .optim import DLRT as DLRT
    from .optim import SDLRT as SDLRT
    from .optim import SGD as SGD
    from .optim import Adam as Adam
    from .optim import AdamW as AdamW
    from .optim import AugmentedBUG as AugmentedBUG
    from .optim import Budget as Budget
    from .optim import DenseEMA as DenseEMA
    from .optim import Feedback as Feedback
    from .optim import Muon as Muon
    from .optim import SeedFeedback as SeedFeedback
    from .optim import Settings as Settings
    from .optim import Tolerance as Tolerance
    from .optim import TwoSidedFeedback as TwoSidedFeedback
    from .optim import clip_grad_norm_ as clip_grad_norm_
    from .optim import grad_norm as grad_norm
    from .train import fit as fit


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # ``rankwise.models`` etc. without importing them first
        return importlib.import_module(f"rankwise.{name}")
    if name == "Sgd":  # the SGD rule's earlier name (torch spells it SGD); kept so that code using it runs
        return importlib.import_module("rankwise.optim").SGD
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rankwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    """The public names and the subpackages (not this module's own imports)."""
    return sorted({*_LAZY, *_SUBMODULES, "__version__"})
