"""Low-rank layers W = U S Vᵀ: the layers, conversion of a model, export to dense, loading.

``to_low_rank`` replaces a model's ``nn.Linear`` / ``nn.Conv2d`` / attention projections by
the layers below; ``export`` turns them back into dense modules; ``from_pretrained`` loads a
checkpoint of a converted model. The optimizers that train them live in :mod:`rankwise.optim`.
"""

from ._attention import LowRankMultiheadAttention
from ._base import AbstractLowRankLayer
from ._budget import ALLOCATION_RULES
from ._conv import LowRankConv2d
from ._convert import to_low_rank
from ._export import export
from ._hf import LowRankConv1D
from ._linear import LowRankLinear
from ._metrics import compression, stability_distance
from ._pretrained import from_pretrained

__all__ = ["ALLOCATION_RULES", "AbstractLowRankLayer", "LowRankConv1D", "LowRankConv2d", "LowRankLinear",
           "LowRankMultiheadAttention", "compression", "export", "from_pretrained", "stability_distance",
           "to_low_rank"]
