"""ctypes binding to the system ISA-L library (Debian package ``libisal2``): the fast backend.

Only four entry points are used: ``gf_gen_cauchy1_matrix``, ``ec_init_tables``,
``ec_encode_data`` and ``gf_invert_matrix``. ISA-L's field is GF(2^8) with polynomial 0x11D,
the same as the numpy reference backend, so both produce identical bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

_LIB: ctypes.CDLL | None = None
_CHUNK = 1 << 30  # ec_encode_data takes an int length


def load() -> ctypes.CDLL:
    """The loaded library; ``OSError`` if ISA-L is not installed."""
    global _LIB
    if _LIB is None:
        name = ctypes.util.find_library("isal") or "libisal.so.2"
        lib = ctypes.CDLL(name)
        u8p = ctypes.POINTER(ctypes.c_ubyte)
        lib.gf_gen_cauchy1_matrix.argtypes = [u8p, ctypes.c_int, ctypes.c_int]
        lib.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, u8p, u8p]
        lib.ec_encode_data.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, u8p,
                                       ctypes.POINTER(u8p), ctypes.POINTER(u8p)]
        lib.gf_invert_matrix.argtypes = [u8p, u8p, ctypes.c_int]
        lib.gf_invert_matrix.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))


def cauchy_generator(n: int, k: int) -> np.ndarray:
    """ISA-L's ``gf_gen_cauchy1_matrix(n, k)`` as an (n, k) uint8 array."""
    out = np.zeros((n, k), dtype=np.uint8)
    load().gf_gen_cauchy1_matrix(_ptr(out), n, k)
    return out


def inverse(A: np.ndarray) -> np.ndarray:
    A = np.array(A, dtype=np.uint8, order="C")  # gf_invert_matrix overwrites its input
    out = np.zeros_like(A)
    if load().gf_invert_matrix(_ptr(A), _ptr(out), A.shape[0]) != 0:
        raise ValueError("matrix is singular over GF(2^8)")
    return out


def matmul(A: np.ndarray, X: np.ndarray) -> np.ndarray:
    """``A @ X`` over GF(2^8) with ``ec_encode_data``: A (r, k), X (k, L) uint8 -> (r, L)."""
    A = np.ascontiguousarray(A, dtype=np.uint8)
    X = np.ascontiguousarray(X, dtype=np.uint8)
    if X.shape[0] != A.shape[1]:
        raise ValueError(f"shape mismatch: {A.shape} @ {X.shape}")
    out = np.zeros((A.shape[0], X.shape[1]), dtype=np.uint8)
    matmul_into(A, list(X), list(out))
    return out


def matmul_into(A: np.ndarray, srcs: list[np.ndarray], dsts: list[np.ndarray],
                tables: np.ndarray | None = None) -> None:
    """``dsts[i] = Σ_j A[i, j] · srcs[j]`` over GF(2^8), written in place: every source and
    destination a contiguous 1-D uint8 array of one length L (they may live anywhere, e.g.
    blocks of one larger buffer); nothing is copied. `tables`: from :func:`tables_for` (reused
    across calls with the same A)."""
    lib = load()
    r, k = A.shape
    if len(srcs) != k or len(dsts) != r:
        raise ValueError(f"A is {A.shape}; got {len(srcs)} sources and {len(dsts)} destinations")
    if r == 0 or not len(srcs[0]):
        return
    if tables is None:
        tables = tables_for(A)
    u8p = ctypes.POINTER(ctypes.c_ubyte)
    L = len(srcs[0])
    for s in range(0, L, _CHUNK):
        n = min(_CHUNK, L - s)
        src = (u8p * k)(*[_ptr(x[s:]) for x in srcs])
        dst = (u8p * r)(*[_ptr(y[s:]) for y in dsts])
        lib.ec_encode_data(n, k, r, _ptr(tables), src, dst)


def tables_for(A: np.ndarray) -> np.ndarray:
    """ISA-L's expanded multiplication tables of A (r, k), for :func:`matmul_into`."""
    A = np.ascontiguousarray(A, dtype=np.uint8)
    r, k = A.shape
    tables = np.empty(32 * k * r, dtype=np.uint8)
    load().ec_init_tables(k, r, _ptr(A), _ptr(tables))
    return tables
