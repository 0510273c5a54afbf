"""Loaders for MNIST (IDX files) and CIFAR-10/100 (the python pickle batches) from a folder the
user provides. Nothing is downloaded."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """One IDX file (optionally gzipped) as an array of its declared type and shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic {data[:4]!r})")
    kind, ndim = data[2], data[3]
    if kind not in _IDX_TYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{kind:02x}")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_TYPES[kind])
    body = data[4 + 4 * ndim:]
    if len(body) != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"{path}: {len(body)} data bytes, header says shape {shape} of {dtype}")
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def _find(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(f"{folder}: no {stem}[.gz] (the MNIST IDX files)")


def load_mnist(data_dir: str | Path) -> tuple[TensorDataset, TensorDataset]:
    """MNIST from ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each may be ``.gz``) in
    `data_dir`: (train, test) of images float32 (N, 1, 28, 28) in [0, 1] and labels int64."""
    d = Path(data_dir)

    def pair(prefix: str) -> TensorDataset:
        x = read_idx(_find(d, f"{prefix}-images-idx3-ubyte"))
        y = read_idx(_find(d, f"{prefix}-labels-idx1-ubyte"))
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{d}: {prefix} images {x.shape} and labels {y.shape} do not match")
        return TensorDataset(torch.from_numpy(x.astype(np.float32) / 255.0)[:, None],
                             torch.from_numpy(y.astype(np.int64)))

    return pair("train"), pair("t10k")


def load_cifar(data_dir: str | Path, classes: int = 10) -> tuple[TensorDataset, TensorDataset]:
    """CIFAR-10 (``data_batch_1..5``, ``test_batch``) or CIFAR-100 (``train``, ``test``, fine
    labels) python pickle batches in `data_dir`: (train, test) of images float32
    (N, 3, 32, 32) in [0, 1] and labels int64."""
    if classes not in (10, 100):
        raise ValueError(f"`classes` must be 10 or 100; got {classes}")
    d = Path(data_dir)
    if classes == 10:
        names = ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"])
    else:
        names = (["train"], ["test"])
    key = b"labels" if classes == 10 else b"fine_labels"

    def read(files: list[str]) -> TensorDataset:
        xs, ys = [], []
        for name in files:
            path = d / name
            if not path.exists():
                raise FileNotFoundError(f"{d}: no {name} (the CIFAR-{classes} python batches)")
            with open(path, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            x = np.asarray(batch[b"data"], dtype=np.uint8)
            if x.ndim != 2 or x.shape[1] != 3072:
                raise ValueError(f"{path}: data has shape {x.shape}, expected (N, 3072)")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch[key], dtype=np.int64))
        x, y = np.concatenate(xs), np.concatenate(ys)
        if len(x) != len(y):
            raise ValueError(f"{d}: {len(x)} images but {len(y)} labels")
        return TensorDataset(torch.from_numpy(x.astype(np.float32) / 255.0), torch.from_numpy(y))

    return read(names[0]), read(names[1])
