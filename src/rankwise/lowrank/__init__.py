"""Dynamical low-rank training (DLRT) and its stabilised variant (SDLRT)."""

from ._attention import LowRankMultiheadAttention as LowRankMultiheadAttention
from ._average import DenseEMA as DenseEMA
from ._base import AbstractLowRankLayer as AbstractLowRankLayer
from ._budget import ALLOCATION_RULES as ALLOCATION_RULES
from ._clip import clip_grad_norm_ as clip_grad_norm_
from ._clip import grad_norm as grad_norm
from ._conv import LowRankConv2d as LowRankConv2d
from ._convert import to_low_rank as to_low_rank
from ._export import export as export
from ._hf import LowRankConv1D as LowRankConv1D
from ._linear import LowRankLinear as LowRankLinear
from ._metrics import compression as compression
from ._metrics import stability_distance as stability_distance
from ._optim import DLRT as DLRT
from ._optim import SDLRT as SDLRT
from ._optim import AugmentedBUG as AugmentedBUG
from ._policies import Budget as Budget
from ._policies import Feedback as Feedback
from ._policies import SeedFeedback as SeedFeedback
from ._policies import Tolerance as Tolerance
from ._policies import TwoSidedFeedback as TwoSidedFeedback
from ._pretrained import from_pretrained as from_pretrained
from ._settings import Adam as Adam
from ._settings import AdamW as AdamW
from ._settings import Settings as Settings
from ._settings import Sgd as Sgd
