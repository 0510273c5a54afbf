"""Training: :func:`fit`, the one training loop, with its :class:`Callback` s,
:class:`CodedCheckpoints` and :class:`DenseWarmStart`. ``fit`` and its callbacks need torch
only. The digits run behind ``rankwise train`` (``train(config)``) and its records live with
the other commands' runs, in :mod:`rankwise.experiments.train_run` (the library does not
import the studies).
"""

from ..train_config import FORMAT_VERSION as FORMAT_VERSION
from ..train_config import METHODS as METHODS
from ..train_config import TrainConfig as TrainConfig
from ._checkpoints import CodedCheckpoints as CodedCheckpoints
from ._loop import Callback as Callback
from ._loop import Loop as Loop
from ._loop import accuracy as accuracy
from ._loop import fit as fit
from ._warm import DenseWarmStart as DenseWarmStart

__all__ = ["FORMAT_VERSION", "METHODS", "Callback", "CodedCheckpoints", "DenseWarmStart", "Loop",
           "TrainConfig", "accuracy", "fit"]
