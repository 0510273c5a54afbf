"""Training: :func:`fit`, the one training loop, with its :class:`Callback` s, and
:class:`CodedCheckpoints`. :func:`train`, the digits run behind ``rankwise train``, and its
records live with the other commands' runs (:mod:`rankwise.experiments.train_run`) and are
re-exported here when first used.

``fit`` and its callbacks need torch only; :func:`train` also reads the digits (scikit-learn)
and writes TensorBoard events, which come with the ``rankwise[cli]`` extra.
"""

from typing import Any

from ..train_config import FORMAT_VERSION as FORMAT_VERSION
from ..train_config import METHODS as METHODS
from ..train_config import TrainConfig as TrainConfig
from ._checkpoints import CodedCheckpoints as CodedCheckpoints
from ._loop import Callback as Callback
from ._loop import Loop as Loop
from ._loop import accuracy as accuracy
from ._loop import fit as fit
from ._warm import DenseWarmStart as DenseWarmStart

_RUN = ("EpochRecord", "Progress", "ProgressCallback", "Records", "train", "write_json_atomic")


def __getattr__(name: str) -> Any:
    if name in _RUN:  # (imported on use: the run imports this package's loop)
        from ..experiments import train_run

        return getattr(train_run, name)
    raise AttributeError(f"module 'rankwise.train' has no attribute {name!r}")

__all__ = ["FORMAT_VERSION", "METHODS", "Callback", "CodedCheckpoints", "DenseWarmStart", "EpochRecord",
           "Loop", "Progress", "ProgressCallback", "Records", "TrainConfig", "accuracy", "fit", "train",
           "write_json_atomic"]
