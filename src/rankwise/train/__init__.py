"""Training: :func:`fit`, the one training loop, with its :class:`Callback` s; :func:`train`,
the digits run behind ``rankwise train``.

``fit`` and its callbacks need torch only; :func:`train` also reads the digits (scikit-learn)
and writes TensorBoard events, which come with the ``rankwise[cli]`` extra.
"""

from ..train_config import FORMAT_VERSION as FORMAT_VERSION
from ..train_config import METHODS as METHODS
from ..train_config import TrainConfig as TrainConfig
from ._checkpoints import CodedCheckpoints as CodedCheckpoints
from ._loop import Callback as Callback
from ._loop import Loop as Loop
from ._loop import accuracy as accuracy
from ._loop import fit as fit
from ._run import EpochRecord as EpochRecord
from ._run import Progress as Progress
from ._run import ProgressCallback as ProgressCallback
from ._run import Records as Records
from ._run import train as train
from ._run import write_json_atomic as write_json_atomic

__all__ = ["FORMAT_VERSION", "METHODS", "Callback", "CodedCheckpoints", "EpochRecord", "Loop", "Progress",
           "ProgressCallback", "Records", "TrainConfig", "accuracy", "fit", "train", "write_json_atomic"]
