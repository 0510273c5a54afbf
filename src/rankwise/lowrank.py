"""The former home of the layers and the optimizer: ``rankwise.nn`` and ``rankwise.optim``."""

from .nn import *  # noqa: F403
from .optim import *  # noqa: F403
