"""scikit-learn's bundled 8×8 handwritten digits as PyTorch datasets (offline, no downloads)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import TensorDataset


class DigitsSplit(NamedTuple):
    """A train/test split of the digits.

    Each dataset yields ``(image, label)`` with ``image`` float32 (1, 8, 8) in [0, 1] and
    ``label`` int64 (). ``dataset.tensors[0]`` is the whole image stack (N, 1, 8, 8);
    ``.flatten(1)`` gives the (N, 64) design matrix.
    """

    train: TensorDataset
    test: TensorDataset


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> DigitsSplit:
    """Load ``sklearn.datasets.load_digits`` (1797 images, 10 classes) and split it.

    The split is stratified by class and deterministic: the same `seed` gives the same split
    on every machine. The data ships with scikit-learn; nothing is downloaded.

    **Arguments:**
    - `test_fraction`: share of each class held out for testing, in (0, 1); default 0.2
      (1437 train / 360 test images).
    - `seed`: seed of the split's permutation; default 0.

    **Returns:** a :class:`DigitsSplit` ``(train, test)`` of ``TensorDataset`` s holding
    images float32 (N, 1, 8, 8) scaled from the raw 0–16 range to [0, 1] and labels int64 (N,).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1); got {test_fraction}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"`seed` must be an int; got {type(seed).__name__}")
    from .._extras import require

    datasets = require("sklearn.datasets", "load_digits")
    train_test_split = require("sklearn.model_selection", "load_digits").train_test_split
    bunch = datasets.load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0
    labels = np.asarray(bunch.target, dtype=np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )

    def as_dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(1),
                             torch.from_numpy(np.ascontiguousarray(y)))

    return DigitsSplit(as_dataset(x_tr, y_tr), as_dataset(x_te, y_te))
