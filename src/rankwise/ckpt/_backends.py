"""GF(2^8) matrix backends: name -> (matmul, inverse). Both produce identical bytes."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from . import _gf, _isal

MatMul = Callable[[np.ndarray, np.ndarray], np.ndarray]
BACKENDS: dict[str, tuple[MatMul, Callable[[np.ndarray], np.ndarray]]] = {
    "numpy": (_gf.matmul, _gf.inverse),
    "isal": (_isal.matmul, _isal.inverse),
}
# in place: (matmul_into(A, srcs, dsts, tables), tables_for(A))
INTO = {"numpy": (_gf.matmul_into, _gf.tables_for), "isal": (_isal.matmul_into, _isal.tables_for)}
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
