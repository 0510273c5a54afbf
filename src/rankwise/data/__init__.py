"""Small offline datasets for examples, tests and the ``rankwise`` command line."""

from ._digits import DigitsSplit as DigitsSplit
from ._digits import load_digits as load_digits
from ._mnist1d import Mnist1dSplit as Mnist1dSplit
from ._mnist1d import load_mnist1d as load_mnist1d
