"""Arithmetic in GF(2^8) with the polynomial x⁸+x⁴+x³+x²+1 (0x11D, as ISA-L): the numpy
reference backend. Elements are uint8; addition is XOR; products use a 256×256 table."""

from __future__ import annotations

import functools

import numpy as np

POLY = 0x11D


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    exp[255:510] = exp[:255]
    a = np.arange(256)
    mul = exp[(log[:, None] + log[None, :]) % 255].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    inv = np.zeros(256, dtype=np.uint8)
    inv[1:] = exp[(255 - log[a[1:]]) % 255]
    return exp, mul, inv


EXP, MUL, INV = _tables()


def mul(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    """Elementwise product."""
    return MUL[np.asarray(a, dtype=np.uint8), np.asarray(b, dtype=np.uint8)]


@functools.lru_cache(maxsize=256)
def _table16(c: int) -> np.ndarray:
    """Multiplication by ``c`` of two packed bytes at once: a 65536-entry uint16 table."""
    v = np.arange(65536, dtype=np.uint32)
    lo, hi = MUL[c][v & 0xFF].astype(np.uint16), MUL[c][v >> 8].astype(np.uint16)
    return lo | (hi << 8)


def matmul(A: np.ndarray, X: np.ndarray) -> np.ndarray:
    """``A @ X`` over GF(2^8): A (r, k) uint8, X (k, L) uint8 -> (r, L) uint8.

    Each product row is an XOR of table lookups; lookups go through 16-bit tables (two bytes
    per lookup), and coefficients 0 and 1 cost nothing and an XOR respectively."""
    A = np.asarray(A, dtype=np.uint8)
    X = np.ascontiguousarray(X, dtype=np.uint8)
    if A.shape[1] != X.shape[0]:
        raise ValueError(f"shape mismatch: {A.shape} @ {X.shape}")
    r, L = A.shape[0], X.shape[1]
    pad = L % 2
    if pad:
        X = np.concatenate([X, np.zeros((X.shape[0], 1), dtype=np.uint8)], axis=1)
    X16 = X.view(np.uint16)
    out = np.zeros((r, X16.shape[1]), dtype=np.uint16)
    tmp = np.empty(X16.shape[1], dtype=np.uint16)
    for j in range(A.shape[1]):
        for i in range(r):
            c = int(A[i, j])
            if c == 1:
                out[i] ^= X16[j]
            elif c:
                np.take(_table16(c), X16[j], out=tmp)
                out[i] ^= tmp
    out8 = out.view(np.uint8)
    return out8[:, :L] if pad else out8


def matmul_into(A: np.ndarray, srcs: list[np.ndarray], dsts: list[np.ndarray], tables=None) -> None:
    """``dsts[i] = Σ_j A[i, j] · srcs[j]`` in place (the reference for
    :func:`rankwise.ckpt._isal.matmul_into`; `tables` is ignored)."""
    out = matmul(A, np.stack(srcs)) if srcs else np.zeros((A.shape[0], 0), np.uint8)
    for y, row in zip(dsts, out, strict=True):
        y[...] = row


def tables_for(A: np.ndarray) -> None:
    return None


def inverse(A: np.ndarray) -> np.ndarray:
    """Inverse of a square matrix over GF(2^8) by Gauss-Jordan; ``ValueError`` if singular."""
    A = np.array(A, dtype=np.uint8)
    k = A.shape[0]
    if A.shape != (k, k):
        raise ValueError(f"inverse needs a square matrix; got {A.shape}")
    aug = np.concatenate([A, np.eye(k, dtype=np.uint8)], axis=1)
    for col in range(k):
        piv = next((r for r in range(col, k) if aug[r, col]), None)
        if piv is None:
            raise ValueError("matrix is singular over GF(2^8)")
        aug[[col, piv]] = aug[[piv, col]]
        aug[col] = MUL[INV[aug[col, col]]][aug[col]]
        for r in range(k):
            if r != col and aug[r, col]:
                aug[r] ^= MUL[aug[r, col]][aug[col]]
    return aug[:, k:]


def cauchy_generator(n: int, k: int) -> np.ndarray:
    """Systematic generator (n, k): identity on top, rows i ≥ k are ``1 / (i ⊕ j)`` — the
    matrix of ISA-L's ``gf_gen_cauchy1_matrix``; every k×k submatrix is invertible."""
    if not 1 <= k <= n <= 256:
        raise ValueError(f"need 1 <= k <= n <= 256; got n={n}, k={k}")
    G = np.zeros((n, k), dtype=np.uint8)
    G[:k] = np.eye(k, dtype=np.uint8)
    i = np.arange(k, n)[:, None]
    j = np.arange(k)[None, :]
    G[k:] = INV[(i ^ j).astype(np.uint8)]
    return G
