"""The rank-adaptive integrators that train :mod:`rankwise.nn`'s layers (DLRT, SDLRT, the
augmented BUG step), their update rules (SGD, Adam, AdamW, Muon), rank policies (Tolerance,
Budget, feedback), gradient clipping and a dense EMA; data parallelism in :mod:`.parallel`.
The per-layer math is in :mod:`.functional` (pure functions)."""

from . import functional
from ._average import DenseEMA
from ._clip import clip_grad_norm_, grad_norm
from ._optim import DLRT, SDLRT, AugmentedBUG
from .rules._policies import Budget, Feedback, SeedFeedback, Tolerance, TwoSidedFeedback
from .rules._settings import SGD, Adam, AdamW, Muon, Settings

__all__ = ["DLRT", "SDLRT", "SGD", "Adam", "AdamW", "AugmentedBUG", "Budget", "DenseEMA", "Feedback", "Muon",
           "SeedFeedback", "Settings", "Tolerance", "TwoSidedFeedback", "clip_grad_norm_",
           "functional", "grad_norm"]


def __getattr__(name: str) -> type:
    if name == "Sgd":  # the SGD rule's earlier name (torch spells it SGD); kept so that code using it runs
        return SGD
    raise AttributeError(f"module 'rankwise.optim' has no attribute {name!r}")
