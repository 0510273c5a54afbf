"""GF(2^8) matrix backends, one table: name -> :class:`Backend`. Both give identical bytes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from . import _gf, _isal


class Backend(NamedTuple):
    """A backend's four operations."""

    matmul: Callable[[np.ndarray, np.ndarray], np.ndarray]  # A (a, b) @ X (b, L) -> (a, L)
    inverse: Callable[[np.ndarray], np.ndarray]  # A (k, k) -> A⁻¹
    matmul_into: Callable[..., None]  # (A, srcs, dsts, tables): dsts[i] = Σ_j A[i, j] srcs[j], in place
    tables_for: Callable[[np.ndarray], object]  # A -> the tables matmul_into reuses


BACKENDS: dict[str, Backend] = {
    "numpy": Backend(_gf.matmul, _gf.inverse, _gf.matmul_into, _gf.tables_for),
    "isal": Backend(_isal.matmul, _isal.inverse, _isal.matmul_into, _isal.tables_for),
}
_warned = False


def isal_available() -> bool:
    try:
        _isal.load()
    except OSError:
        return False
    return True


def resolve(name: str) -> str:
    """``"auto"`` -> ``"isal"`` if ISA-L loads, else ``"numpy"`` (warning once)."""
    global _warned
    if name == "auto":
        if isal_available():
            return "isal"
        if not _warned:
            warnings.warn("ISA-L (libisal2) not found: using the slower numpy GF(2^8) backend",
                          RuntimeWarning, stacklevel=3)
            _warned = True
        return "numpy"
    if name not in BACKENDS:
        raise ValueError(f"`backend` must be 'auto' or one of {sorted(BACKENDS)}; got {name!r}")
    if name == "isal" and not isal_available():
        raise ValueError("backend 'isal' needs the ISA-L library (Debian: apt-get install libisal2)")
    return name
