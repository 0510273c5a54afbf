"""mnist1d (Greydanus 2020) generated locally with the ``mnist1d`` package; never downloaded."""

from __future__ import annotations

import random
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import TensorDataset


class Mnist1dSplit(NamedTuple):
    """``train`` / ``test`` datasets of ``(x, y)``: x float32 (40,), standardised; y int64 ()."""

    train: TensorDataset
    test: TensorDataset


def load_mnist1d(*, num_samples: int = 5000, seed: int = 42) -> Mnist1dSplit:
    """Generate mnist1d with ``mnist1d.data.make_dataset`` (the package's defaults: 5000
    sequences of length 40, 10 classes, an 80/20 split; ``seed=42`` is the published dataset).

    Nothing is downloaded: the sequences are generated from the package's bundled templates.
    The generator seeds Python's and NumPy's global RNGs; their states are restored afterwards.
    """
    if num_samples < 10:
        raise ValueError(f"`num_samples` must be >= 10 (one per class); got {num_samples}")
    from .._extras import require

    gen = require("mnist1d.data", "load_mnist1d")
    get_dataset_args, make_dataset = gen.get_dataset_args, gen.make_dataset
    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)

    def ds(x, y) -> TensorDataset:
        return TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64))

    return Mnist1dSplit(ds(d["x"], d["y"]), ds(d["x_test"], d["y_test"]))
