"""Small offline datasets for examples, tests and the ``rankwise`` command line."""

from ._digits import DigitsSplit as DigitsSplit
from ._digits import load_digits as load_digits
