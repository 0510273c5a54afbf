"""Code2D: a checkpoint coded into a k×k block matrix, extended by a systematic MDS code in
both dimensions; every worker holds one row and one column; repair from small peer symbols.

Let M be the data as a k×k grid of blocks (block size B = ⌈|m|/k²⌉, zero padded) and G the
systematic (n, k) Cauchy generator over GF(2^8), k = n − t. The extended grid is
P = G M Gᵀ (n×n); worker i stores the row C[i, :] of C = G M and the column R[:, i] of
R = M Gᵀ (k blocks each). To rebuild worker i, helper j sends P[i, j] = G[i,:]·R[:, j] and
P[j, i] = C[j, :]·G[i,:]ᵀ, both computed from its own fragment; row i of P is an RS codeword
of C[i, :] and column i of P one of R[:, i], so any k helpers suffice — parity workers
included. (Storing the raw M[i, :] and M[:, i], as the seed suggests, cannot repair the
diagonal block M[i, i]: it lives on worker i alone.)

Every symbol is checked against a commitment: a Merkle root for every full row and column of
P (2n line roots) under one top root.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .._checks import code_geometry_problem
from . import _backends, _gf, _merkle
from ._format import CODEC, Commitment, Fragment, RepairSymbols, block_size, check_consistent, commitment_root

log = logging.getLogger(__name__)


class NotEnoughSymbols(Exception):
    """Fewer verified symbols (or fragments) than the k a decode needs."""

    def __init__(self, have: int, need: int, bad_helpers: list[int], what: str = "repair",
                 unit: str = "symbols from distinct helpers"):
        super().__init__(f"{what} needs {need} verified {unit}; got {have}"
                         + (f" (bad symbols from helpers {bad_helpers})" if bad_helpers else ""))
        self.have, self.need, self.bad_helpers = have, need, bad_helpers
        self._args = (have, need, bad_helpers, what, unit)

    def __reduce__(self):  # (DCP gathers a rank's exception to every rank with pickle)
        return type(self), self._args


@dataclass(frozen=True)
class Dispersal:
    """What :meth:`Code2D.encode` gives: the n fragments, the commitment, and the leaf hashes of
    every block of P (``leaves[i][j]`` = leaf of P[i, j], computed once by the encode)."""

    fragments: list[Fragment]
    commitment: Commitment
    leaves: list[list[bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class Lines:
    """Worker ``index``'s two lines of the extended grid P, n blocks of B bytes each: ``row``
    = P[index, :] and ``col`` = P[:, index] (the first k blocks are views of the fragment, the t
    parity blocks computed), with their Merkle trees (leaves first). What :meth:`Code2D.verify`
    computes; a helper answers repair requests from it without extending the lines again."""

    index: int
    row: list[np.ndarray]
    col: list[np.ndarray]
    row_tree: list[list[bytes]]
    col_tree: list[list[bytes]]




_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool)
_POOL_LOCK = threading.Lock()


def _parallel(fn: Callable, items) -> list:
    """``[fn(x) for x in items]`` on a pool of one thread per core (for work that releases the
    GIL); in order, in this thread when there is one core or the pool is gone (interpreter
    shutdown). A forked child makes its own pool (the parent's threads do not exist in it)."""
    global _POOL
    items = list(items)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores == 1 or len(items) < 2:
        return [fn(x) for x in items]
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            pool = ThreadPoolExecutor(max_workers=min(cores, 8), thread_name_prefix="rankwise-code2d")
            _POOL = (os.getpid(), pool)
        pool = _POOL[1]
    try:
        futures = [pool.submit(fn, x) for x in items]
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        return [fn(x) for x in items]
    return [f.result() for f in futures]


class Code2D:
    """The 2-D code with n workers tolerating t losses (k = n − t; 1 ≤ t, 3t < n ≤ 255).

    **Arguments:** `n`, `t`; `backend`: ``"isal"`` (ISA-L, the system library ``libisal2``),
    ``"numpy"`` (the reference), or ``"auto"`` (ISA-L when installed, else numpy with one
    warning); both give identical bytes. `hash`: ``"blake3"`` or ``"sha256"`` for the Merkle
    trees.
    """

    def __init__(self, n: int, t: int, *, backend: str = "auto", hash: str = "blake3") -> None:
        if (problem := code_geometry_problem(n, t)) is not None:
            raise ValueError(f"Code2D {problem}")
        self.n, self.t, self.k = n, t, n - t
        self.backend = _backends.resolve(backend)
        self._mm, self._inv, self._into, self._tables_for = _backends.BACKENDS[self.backend]
        self.hash_name = hash
        self._h = _merkle.get_hash(hash)
        self.G = _gf.cauchy_generator(n, self.k)
        self._parity_tables = self._tables_for(self.G[self.k:])  # reused by every in-place product

    # ---------------------------------------------------------------- geometry
    def block_size(self, data_len: int) -> int:
        return block_size(data_len, self.k)

    def _blocks(self, buf: bytes, B: int) -> np.ndarray:
        """k blocks of B bytes -> (k, B) uint8."""
        return np.frombuffer(buf, dtype=np.uint8).reshape(self.k, B)

    def _line(self, half, B: int) -> list[np.ndarray]:
        """A line of P from its first k blocks (a fragment's row or column, k·B bytes): those
        k blocks as views, then the t parity blocks computed in place -> n arrays of (B,)."""
        blocks = list(self._blocks(half, B))
        parity = np.empty((self.t, B), dtype=np.uint8)
        self._into(self.G[self.k:], blocks, list(parity), self._parity_tables)
        return blocks + list(parity)

    def lines(self, fragment: Fragment, block_size: int) -> Lines:
        """The fragment's two lines of P and their Merkle trees (:class:`Lines`)."""
        row, col = self._line(fragment.row, block_size), self._line(fragment.col, block_size)
        return Lines(fragment.index, row, col, _merkle.levels(self._h, row), _merkle.levels(self._h, col))

    # ---------------------------------------------------------------- encode
    def encode(self, data: bytes | bytearray | memoryview) -> Dispersal:
        """Split ``data`` (any length, 0 included) into n fragments and their commitment.

        The extended grid P (n, n, B) is one buffer: the data is copied into its systematic
        corner once, the parity blocks are written straight into it (ISA-L through pointers),
        every block is hashed once where it lies, and each fragment's row C[i, :] = P[i, :k] is
        a view of it; the columns R[:, i] = P[:k, i] come from one transposed copy of P[:k]."""
        mv = memoryview(data).cast("B")
        n, k, t, B = self.n, self.k, self.t, self.block_size(len(mv))
        P = np.empty((n, n, B), dtype=np.uint8)
        flat = np.frombuffer(mv, dtype=np.uint8)
        G, tab = self.G[k:], self._parity_tables

        def fill(a: int) -> None:  # M's row a: blocks M[a, 0..k-1], the data's bytes [a·kB, (a+1)·kB)
            row = P[a, :k].reshape(-1)
            part = flat[a * k * B:(a + 1) * k * B]
            row[:len(part)] = part
            row[len(part):] = 0

        def systematic_parity(cols: slice) -> None:  # C[k+p, :] = G[k+p, :] M, one range of columns
            self._into(G, [P[a, cols].reshape(-1) for a in range(k)],
                       [P[k + p, cols].reshape(-1) for p in range(t)], tab)

        def finish_row(i: int) -> list[bytes]:  # P[i, k+p] = Σ_j G[k+p, j] P[i, j], then its leaves
            self._into(G, list(P[i, :k]), list(P[i, k:]), tab)
            return [_merkle.leaf(self._h, P[i, j]) for j in range(n)]  # every block hashed once

        # ISA-L, numpy copies and blake3 release the GIL: the rows are shared among the cores
        _parallel(fill, range(k))
        _parallel(systematic_parity, [slice(j, j + 1) for j in range(k)])
        leaves = _parallel(finish_row, range(n))
        rows = [_merkle.levels_from_leaves(self._h, leaves[i])[-1][0] for i in range(n)]
        cols = [_merkle.levels_from_leaves(self._h, [leaves[i][j] for i in range(n)])[-1][0]
                for j in range(n)]
        R = np.empty((n, k, B), dtype=np.uint8)  # R[i] = the blocks P[0..k-1, i]

        def column(i: int) -> None:
            R[i] = P[:k, i]

        _parallel(column, range(n))
        frags = [Fragment(i, memoryview(P[i, :k].reshape(-1)), memoryview(R[i].reshape(-1)))
                 for i in range(n)]
        return Dispersal(frags, self._commitment(len(mv), tuple(rows + cols)), leaves)

    def encode_share(self, data: bytes | bytearray | memoryview, index: int, *,
                     out: np.ndarray | None = None) -> tuple[Fragment, bytes, bytes]:
        """Worker ``index``'s fragment of :meth:`encode` and the Merkle roots of its row and
        column lines of P, without computing the other workers' shares: O(|m|) work instead of
        the whole n×n grid. When every worker holds ``data`` (data-parallel training), each
        encodes its own share, and :meth:`commitment_from_roots` assembles the commitment from
        the 2n gathered roots.

        The two lines P[index, :] and P[:, index] (n blocks each) are computed in place in one
        (2, n, B) buffer, `out` when given (a caller that saves repeatedly reuses it: see
        :meth:`share_buffer`); the fragment's row and column are views of their first k blocks."""
        frag, lines = self._share(data, index, out)
        return frag, _merkle.root(self._h, lines[0]), _merkle.root(self._h, lines[1])

    def encode_share_leaves(self, data: bytes | bytearray | memoryview, index: int, *,
                            out: np.ndarray | None = None) -> tuple[Fragment, list[bytes], list[bytes]]:
        """:meth:`encode_share` with the Merkle leaf hashes (n each) of the row and column lines
        instead of their roots. Leaf j of worker i's row and leaf i of worker j's column hash
        the same block P[i, j]: :meth:`crossing_mismatches` checks each worker's lines against
        the others' before anything is committed (:meth:`commitment_from_leaves`)."""
        frag, lines = self._share(data, index, out)
        row, col = ([_merkle.leaf(self._h, b) for b in line] for line in lines)
        return frag, row, col

    def _share(self, data, index: int, out: np.ndarray | None) -> tuple[Fragment, np.ndarray]:
        """Worker `index`'s fragment and its (2, n, B) lines buffer (see :meth:`encode_share`)."""
        if not 0 <= index < self.n:
            raise ValueError(f"`index` must be in [0, {self.n}); got {index}")
        mv = memoryview(data).cast("B")
        n, k, B = self.n, self.k, self.block_size(len(mv))
        flat, L = np.frombuffer(mv, dtype=np.uint8), k * B
        M: list[np.ndarray] = []  # M[a] (k, B): row a of the data grid, a view where the data covers it
        for a in range(k):
            part = flat[a * L:(a + 1) * L]
            if len(part) < L:  # the zero padding: only the last (partial) rows are copied
                part = np.concatenate([part, np.zeros(L - len(part), np.uint8)])
            M.append(part.reshape(k, B))
        if out is None:
            out = np.empty((2, n, B), np.uint8)
        elif out.shape != (2, n, B) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"`out` must be C-contiguous uint8 of shape {(2, n, B)}; got {out.dtype} "
                             f"{out.shape}{'' if out.flags.c_contiguous else ', not contiguous'}")
        rowline, colline = out[0], out[1]
        if index < k:  # systematic: row and column of M itself
            rowline[:k] = M[index]
            for b in range(k):
                colline[b] = M[b][index]
        else:  # C[i, :] = G[i, :] M and R[:, i] = M G[i, :]ᵀ, block by block
            g = self.G[index:index + 1]
            tab = self._tables_for(g)
            self._into(g, [M[a].reshape(-1) for a in range(k)], [rowline[:k].reshape(-1)], tab)
            for b in range(k):
                self._into(g, list(M[b]), [colline[b]], tab)
        G, tab = self.G[k:], self._parity_tables
        self._into(G, list(rowline[:k]), list(rowline[k:]), tab)  # P[i, k:] from C[i, :]
        self._into(G, list(colline[:k]), list(colline[k:]), tab)  # P[k:, i] from R[:, i]
        frag = Fragment(index, memoryview(rowline[:k].reshape(-1)), memoryview(colline[:k].reshape(-1)))
        return frag, out

    def crossing_mismatches(self, row_leaves: list[list[bytes]], col_leaves: list[list[bytes]]
                            ) -> list[tuple[int, int]]:
        """The cells (i, j), i ≠ j, where worker i's row leaf j differs from worker j's column
        leaf i: the two workers disagree about block P[i, j], so one of them is wrong."""
        return [(i, j) for i in range(self.n) for j in range(self.n)
                if i != j and row_leaves[i][j] != col_leaves[j][i]]

    def commitment_from_leaves(self, data_len: int, row_leaves: list[list[bytes]],
                               col_leaves: list[list[bytes]]) -> Commitment:
        """:meth:`commitment_from_roots` with every line root computed here from the line's
        leaves (so a worker's root is whatever its cross-checked leaves give)."""
        def root(leaves: list[bytes]) -> bytes:
            return _merkle.levels_from_leaves(self._h, leaves)[-1][0]

        return self.commitment_from_roots(data_len, [root(r) for r in row_leaves],
                                          [root(c) for c in col_leaves])

    def share_buffer(self, data_len: int, reuse: np.ndarray | None = None) -> np.ndarray:
        """A buffer for :meth:`encode_share` of `data_len` bytes: `reuse` when it has the right
        size (its bytes are overwritten), else a new one."""
        shape = (2, self.n, self.block_size(data_len))
        return reuse if reuse is not None and reuse.shape == shape else np.empty(shape, np.uint8)

    def commitment_from_roots(self, data_len: int, row_roots: list[bytes],
                              col_roots: list[bytes]) -> Commitment:
        """The commitment of :meth:`encode` from every worker's :meth:`encode_share` roots."""
        if len(row_roots) != self.n or len(col_roots) != self.n:
            raise ValueError(f"need {self.n} row and {self.n} column roots; "
                             f"got {len(row_roots)}, {len(col_roots)}")
        return self._commitment(data_len, tuple(row_roots) + tuple(col_roots))

    def _commitment(self, data_len: int, lines: tuple[bytes, ...]) -> Commitment:
        fields = dict(n=self.n, t=self.t, data_len=data_len, block_size=self.block_size(data_len),
                      hash=self.hash_name, codec=CODEC, line_roots=lines)
        return Commitment(**fields, root=commitment_root(self._h, **fields))

    # ---------------------------------------------------------------- verification
    def _check(self, com: Commitment) -> None:
        """Raise ``ValueError`` unless `com` is a commitment of this code whose fields are
        consistent: its geometry, and its root recomputed from them (:func:`commitment_root`)."""
        if (com.n, com.t) != (self.n, self.t) or com.hash != self.hash_name or com.codec != CODEC:
            raise ValueError(f"commitment is for n={com.n}, t={com.t}, hash={com.hash}, codec={com.codec}; "
                             f"this code is n={self.n}, t={self.t}, hash={self.hash_name}, codec={CODEC}")
        check_consistent(com)

    def verify(self, fragment: Fragment, commitment: Commitment) -> bool:
        """Do the fragment's row and column lines hash to the committed line roots?"""
        return self.verified_lines(fragment, commitment) is not None

    def verified_lines(self, fragment: Fragment, commitment: Commitment) -> Lines | None:
        """The fragment's :class:`Lines` if they hash to the committed line roots, else None."""
        self._check(commitment)
        B, i = commitment.block_size, fragment.index
        if not 0 <= i < self.n or len(fragment.row) != self.k * B or len(fragment.col) != self.k * B:
            return None
        lines = self.lines(fragment, B)
        ok = (lines.row_tree[-1][0] == commitment.line_roots[i]
              and lines.col_tree[-1][0] == commitment.line_roots[self.n + i])
        return lines if ok else None

    # ---------------------------------------------------------------- repair
    def symbols_size(self, target: int, block_size: int) -> int:
        """The exact length of an honest helper's :meth:`helper_symbols` for `target` (its
        wire form), from the geometry alone: what a receiver expects, nothing more."""
        d = len(self._h(b""))
        depth = len(_merkle.path(_merkle.levels_from_leaves(self._h, [bytes(d)] * self.n), target))
        dummy = RepairSymbols(0, target, bytes(block_size), (bytes(d),) * depth, bytes(block_size),
                              (bytes(d),) * depth)
        return len(dummy.to_bytes())

    def helper_symbols(self, fragment: Fragment | Lines, target: int) -> RepairSymbols:
        """The two blocks helper ``fragment.index`` sends to rebuild worker ``target``, from its
        fragment or from the :class:`Lines` its verification computed."""
        if not 0 <= target < self.n:
            raise ValueError(f"`target` must be in [0, {self.n}); got {target}")
        lines = fragment if isinstance(fragment, Lines) else self.lines(fragment, len(fragment.row) // self.k)
        return RepairSymbols(lines.index, target, memoryview(lines.col[target]),
                             tuple(_merkle.path(lines.col_tree, target)), memoryview(lines.row[target]),
                             tuple(_merkle.path(lines.row_tree, target)))

    def verified_symbols(self, target: int, symbols: list[RepairSymbols],
                         commitment: Commitment) -> tuple[dict[int, RepairSymbols], list[int]]:
        """Split helpers' symbols for `target` into the verified ones (by helper) and the
        helpers whose symbols failed their Merkle paths or do not fit (sorted)."""
        self._check(commitment)
        n, B, h = self.n, commitment.block_size, self._h
        good: dict[int, RepairSymbols] = {}
        bad: set[int] = set()
        for s in symbols:
            j = s.helper
            roots = commitment.line_roots
            ok = (s.target == target and 0 <= j < n and j != target and j not in good
                  and len(s.col_block) == B and len(s.row_block) == B
                  and _merkle.verify(h, s.col_block, target, n, list(s.col_path), roots[n + j])
                  and _merkle.verify(h, s.row_block, target, n, list(s.row_path), roots[j]))
            if ok:
                good[j] = s
            elif j not in good:
                bad.add(j)
        return good, sorted(bad)

    def repair(self, target: int, symbols: list[RepairSymbols], commitment: Commitment) -> Fragment:
        """Rebuild worker ``target`` from any k helpers' verified symbols; bad symbols are
        dropped (their senders: :meth:`verified_symbols`, a log warning, and
        ``NotEnoughSymbols.bad_helpers`` when fewer than k good ones remain)."""
        good, bad = self.verified_symbols(target, symbols, commitment)
        if len(good) < self.k:
            raise NotEnoughSymbols(len(good), self.k, bad)
        if bad:
            log.warning("repair of worker %d: dropped bad symbols from helpers %s", target, bad)
        return self.rebuild(target, good, commitment)

    def rebuild(self, target: int, good: dict[int, RepairSymbols], commitment: Commitment) -> Fragment:
        """Worker ``target``'s fragment from ≥ k symbols :meth:`verified_symbols` accepted."""
        J = sorted(good)[:self.k]
        Ginv = self._inv(self.G[J])
        tab = self._tables_for(Ginv)
        B = commitment.block_size
        row, col = np.empty((self.k, B), np.uint8), np.empty((self.k, B), np.uint8)
        # row i of P at positions J is G[J] · C[i, :]; column i at J is G[J] · R[:, i]
        self._into(Ginv, [np.frombuffer(good[j].col_block, np.uint8) for j in J], list(row), tab)
        self._into(Ginv, [np.frombuffer(good[j].row_block, np.uint8) for j in J], list(col), tab)
        frag = Fragment(target, memoryview(row.reshape(-1)), memoryview(col.reshape(-1)))
        if not self.verify(frag, commitment):  # pragma: no cover - only with a hash collision
            raise RuntimeError(f"rebuilt fragment {target} does not match the commitment")
        return frag

    # ---------------------------------------------------------------- retrieve
    def verify_row(self, index: int, row: bytes, commitment: Commitment) -> bool:
        """Does ``row`` = C[index, :] hash to the committed root of row ``index`` of P?"""
        self._check(commitment)
        B = commitment.block_size
        if not 0 <= index < self.n or len(row) != self.k * B:
            return False
        return _merkle.root(self._h, self._line(row, B)) == commitment.line_roots[index]

    def verified_rows(self, rows: dict[int, bytes],
                      commitment: Commitment) -> tuple[dict[int, bytes], list[int]]:
        """Verify rows C[i, :] in index order until k pass; returns those k (or fewer) and the
        indices of the rows that failed on the way."""
        self._check(commitment)
        valid: dict[int, bytes] = {}
        bad: list[int] = []
        for i in sorted(rows):  # systematic rows first; stop at k verified ones
            if len(valid) == self.k:
                break
            if self.verify_row(i, rows[i], commitment):
                valid[i] = rows[i]
            else:
                bad.append(i)
        return valid, bad

    def retrieve_rows(self, rows: dict[int, bytes], commitment: Commitment) -> bytes:
        """The original bytes from any k verified rows C[i, :] (|m|/k bytes each: half a
        fragment, all a reader needs); rows that fail are skipped (see :meth:`verified_rows`)."""
        valid, bad = self.verified_rows(rows, commitment)
        if len(valid) < self.k:
            raise NotEnoughSymbols(len(valid), self.k, bad, "retrieve", "rows")
        return self._decode(valid, commitment.data_len)

    def _decode(self, rows: dict[int, bytes], data_len: int) -> bytes:
        """The data from ≥ k verified rows C[i, :] (index -> bytes)."""
        idx = list(range(self.k)) if all(i in rows for i in range(self.k)) else sorted(rows)[:self.k]
        C = np.stack([np.frombuffer(rows[i], np.uint8) for i in idx])
        return bytes(self.decode_rows(C, idx, data_len))

    def decode_rows(self, C: np.ndarray, idx: list[int], data_len: int) -> memoryview:
        """The data from k verified rows stacked in one array: ``C[j]`` = C[idx[j], :], (k, k·B).
        With the systematic rows 0..k−1 in order the data is C itself: a view, no copy."""
        if len(idx) != self.k or C.shape[0] != self.k:
            raise ValueError(f"decode needs exactly k={self.k} rows; got {len(idx)}")
        M = C if list(idx) == list(range(self.k)) else self._mm(self._inv(self.G[list(idx)]), C)
        return memoryview(np.ascontiguousarray(M).reshape(-1))[:data_len]

    def retrieve(self, fragments: list[Fragment], commitment: Commitment, *,
                 rejected: list[int] | None = None) -> bytes:
        """The original bytes from the first k valid fragments (invalid ones are skipped, and
        their positions in `fragments` appended to `rejected` when given)."""
        self._check(commitment)
        valid: dict[int, Fragment] = {}
        for pos, f in enumerate(fragments):
            if len(valid) == self.k or f.index in valid:
                continue
            if self.verify(f, commitment):
                valid[f.index] = f
            elif rejected is not None:
                rejected.append(pos)
        if len(valid) < self.k:
            raise NotEnoughSymbols(len(valid), self.k, [], "retrieve", "fragments")
        return self._decode({i: f.row for i, f in valid.items()}, commitment.data_len)
