"""Small offline datasets for examples, tests and the ``rankwise`` command line."""

from ._bbc import load_bbc_news as load_bbc_news
from ._bbc import stratified_split as stratified_split
from ._bbc import subsample as subsample
from ._bytes import load_bbc_text as load_bbc_text
from ._bytes import random_windows as random_windows
from ._digits import DigitsSplit as DigitsSplit
from ._digits import load_digits as load_digits
from ._files import load_cifar as load_cifar
from ._files import load_mnist as load_mnist
from ._files import read_idx as read_idx
from ._mnist1d import Mnist1dSplit as Mnist1dSplit
from ._mnist1d import load_mnist1d as load_mnist1d

__all__ = ["DigitsSplit", "Mnist1dSplit", "load_bbc_news", "load_bbc_text", "load_cifar", "load_digits",
           "load_mnist", "load_mnist1d", "random_windows", "read_idx", "stratified_split", "subsample"]
