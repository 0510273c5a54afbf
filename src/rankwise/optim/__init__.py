"""The rank-adaptive integrators that train :mod:`rankwise.nn`'s layers (DLRT, SDLRT, the
augmented BUG step), their update rules (Sgd, Adam, AdamW, Muon), rank policies (Tolerance,
Budget, feedback), gradient clipping and a dense EMA; data parallelism in :mod:`.parallel`.
The per-layer math is in :mod:`.functional` (pure functions)."""

from . import functional
from ._average import DenseEMA
from ._clip import clip_grad_norm_, grad_norm
from ._optim import DLRT, SDLRT, AugmentedBUG
from .rules._policies import Budget, Feedback, SeedFeedback, Tolerance, TwoSidedFeedback
from .rules._settings import Adam, AdamW, Muon, Settings, Sgd

__all__ = ["DLRT", "SDLRT", "Adam", "AdamW", "AugmentedBUG", "Budget", "DenseEMA", "Feedback", "Muon",
           "SeedFeedback", "Settings", "Sgd", "Tolerance", "TwoSidedFeedback", "clip_grad_norm_",
           "functional", "grad_norm"]
