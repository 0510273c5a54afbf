"""The collective phases of a coded checkpoint, each a function over a :class:`._transport.Transport`.

The checkpoint m is every rank's serialised share laid end to end (rank 0's first), cut into
the k×k block grid M of :class:`._code2d.Code2D` (n = the group's size, k = n − t). Rank i keeps
fragment i: the row C[i, :] and the column R[:, i] of the extended grid P = G M Gᵀ.

- :func:`encode_across`: the ranks build their fragments together. Each data rank a < k gathers
  its row M[a, :] from the ranks whose shares cover it (about |m| bytes move in all, once),
  extends it to P[a, :] and sends block P[a, i] to rank i (its column); each data rank c then
  extends its column P[:, c] and sends P[j, c] to each parity rank j (its row). Blocks are |m|/k²
  bytes, so after the rows those two rounds move 2·(n − 1)·|m|/k² per data rank. The ranks then
  exchange their lines' Merkle leaves, check every crossing (leaf j of rank i's row and leaf i of
  rank j's column hash the same block) and compute the same commitment.
- :func:`agree`: the bytes (metadata with the commitment) that a quorum of ranks holds; a rank
  without them (a wiped disk) receives them from the holders and keeps the first copy that
  hashes to the agreed digest.
- :func:`present_and_repair`: each rank checks the 2k blocks of its fragment against the leaf
  hashes of the grid (kept in the metadata, bound to the commitment: :func:`leaf_matrix`); a rank
  whose fragment is missing or bad is rebuilt from two blocks of each of k helpers (2|m|/k bytes
  in all), more helpers only when blocks fail.
- :func:`fetch_blocks`: each rank receives the blocks M[a, c] (|m|/k² bytes each) that hold its
  items from the ranks holding their rows, checks each against its leaf hash, and decodes a
  missing or bad one from any k verified blocks of its column.
- :func:`report`: who found whose blocks bad.

Every phase ends the same way on every rank that follows it (decisions are taken from messages
all ranks received alike), so one bad rank costs its own vote, symbols or rows, not the phase.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass, field

import numpy as np

from . import _merkle
from ._code2d import Code2D, NotEnoughSymbols
from ._format import Commitment, Fragment, RepairSymbols

log = logging.getLogger(__name__)


def _bounds(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def encode_across(code: Code2D, tp, share, doc: bytes
                  ) -> tuple[Fragment, Commitment, list[bytes], list[int], list[list[bytes]]]:
    """This rank's fragment of the checkpoint whose rank-r share is every rank's `share` (bytes-like),
    the commitment every rank computes alike, every rank's `doc` (a description the caller writes
    with the fragment: its items' names and places), where each rank's share starts in m, and the
    leaf hashes of every block of P (``leaves[i][j]`` = leaf of P[i, j], cross-checked: kept in the
    metadata, they let a reader verify single blocks).
    Raises ``RuntimeError`` on every rank when a rank's sizes are malformed or two ranks'
    lines disagree about a block."""
    n, k, me = code.n, code.k, tp.rank
    if tp.size != n:
        raise ValueError(f"the code has n={n} parties; the group has {tp.size} ranks")
    tp.phase = "encode"
    mine = np.frombuffer(memoryview(share).cast("B"), dtype=np.uint8)
    sizes = tp.gather(struct.pack("<QQ", mine.size, len(doc)), 16)
    if any(s is None for s in sizes):
        raise RuntimeError(f"coded save: ranks {[p for p, s in enumerate(sizes) if s is None]} sent "
                           "malformed sizes")
    lens, doc_lens = zip(*(struct.unpack("<QQ", s) for s in sizes), strict=True)
    got = {p: np.zeros(doc_lens[p], np.uint8) for p in range(n) if p != me}
    tp.swap({p: doc for p in got}, got)
    docs = [doc if p == me else got[p].tobytes() for p in range(n)]

    at = _bounds(list(lens))
    B = code.block_size(at[-1])
    L = k * B
    row = np.zeros((k, B), np.uint8)  # C[me, :]: M's row for a data rank, computed for a parity rank
    flat = row.reshape(-1)
    sends: dict[int, np.ndarray] = {}
    recvs: dict[int, np.ndarray] = {}
    for a in range(k):  # the part of my share in M's row a
        lo, hi = max(at[me], a * L), min(at[me + 1], (a + 1) * L)
        if lo < hi:
            if a == me:
                flat[lo - a * L:hi - a * L] = mine[lo - at[me]:hi - at[me]]
            else:
                sends[a] = mine[lo - at[me]:hi - at[me]]
    if me < k:
        for p in range(n):
            lo, hi = max(at[p], me * L), min(at[p + 1], (me + 1) * L)
            if p != me and lo < hi:
                recvs[p] = flat[lo - me * L:hi - me * L]
    tp.swap(sends, recvs)

    col = np.zeros((k, B), np.uint8)  # R[:, me] = P[0..k−1, me]
    sends, recvs = {}, {}
    row_line = col_line = None
    if me < k:  # P[me, :] from M's row; block i is rank i's column block
        row_line = code._line(flat, B)
        sends = {i: row_line[i] for i in range(n) if i != me}
        col[me] = row_line[me]
    recvs = {r: col[r] for r in range(k) if r != me}
    tp.swap(sends, recvs)

    sends, recvs = {}, {}
    if me < k:  # P[:, me] from the column; block j (a parity row) is rank j's row block
        col_line = code._line(col.reshape(-1), B)
        sends = {j: col_line[j] for j in range(k, n)}
    else:
        recvs = {c: row[c] for c in range(k)}
    tp.swap(sends, recvs)

    frag = Fragment(me, memoryview(flat), memoryview(col.reshape(-1)))
    if row_line is None:  # (a parity rank's lines; a data rank extended both above)
        row_line, col_line = code._line(flat, B), code._line(col.reshape(-1), B)
    mine = [_merkle.leaf(code._h, b) for b in (*row_line, *col_line)]  # each block hashed once
    d = len(mine[0])
    leaves = tp.gather(b"".join(mine), 2 * n * d)
    if any(x is None or len(x) != 2 * n * d for x in leaves):
        raise RuntimeError(f"coded save: ranks {[p for p, x in enumerate(leaves) if x is None]} sent "
                           "malformed Merkle leaves")
    rows = [[x[j * d:(j + 1) * d] for j in range(n)] for x in leaves]
    cols = [[x[(n + j) * d:(n + j + 1) * d] for j in range(n)] for x in leaves]
    if bad := code.crossing_mismatches(rows, cols):
        peers: dict[int, set[int]] = {}
        for i, j in bad:
            peers.setdefault(i, set()).add(j)
            peers.setdefault(j, set()).add(i)
        # a rank that disagrees with more than t peers is the liar (t liars cannot make an honest
        # rank disagree with more than t others); below that, every rank in a mismatch is named
        blamed = sorted(r for r, ps in peers.items() if len(ps) > code.t) or sorted(peers)
        raise RuntimeError(f"coded save: rank(s) {blamed} disagree with their peers about blocks of the "
                           f"grid {bad[:4]}; nothing was committed")
    return frag, code.commitment_from_leaves(at[-1], rows, cols), docs, at[:-1], rows


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def agree(tp, body: bytes | None, limit: int) -> tuple[bytes | None, list[int]]:
    """The bytes that at least n − ⌊(n − 1)/3⌋ ranks hold (t ≤ ⌊(n − 1)/3⌋ bad ranks cannot make
    a quorum, the honest ones always do) and the ranks that hold them; ``(None, [])`` when no
    bytes have a quorum. A rank without them receives every holder's copy (at most `limit` bytes,
    the agreed length) and keeps the first whose SHA-256 is the agreed digest."""
    tp.phase = "agree"
    n = tp.size
    mine = b"" if body is None else struct.pack("<Q", len(body)) + digest(body)
    votes = tp.gather(mine, 40)
    tally: dict[bytes, list[int]] = {}
    for p, v in enumerate(votes):
        if v is not None and len(v) == 40 and struct.unpack_from("<Q", v)[0] <= limit:
            tally.setdefault(v, []).append(p)
    quorum = n - (n - 1) // 3
    agreed = [(v, ps) for v, ps in tally.items() if len(ps) >= quorum]
    if not agreed:
        return None, []
    vote, holders = agreed[0]
    size = struct.unpack_from("<Q", vote)[0]
    lacking = [p for p in range(n) if p not in holders]
    sends = {p: body for p in lacking} if tp.rank in holders and body else {}
    recvs = {h: np.zeros(size, np.uint8) for h in holders} if tp.rank in lacking else {}
    tp.swap(sends, recvs)
    if tp.rank in lacking:
        body = next((b for b in (recvs[h].tobytes() for h in holders) if digest(b) == vote[8:]), None)
        if body is None:
            log.error("coded checkpoint: no holder sent the agreed bytes to rank %d", tp.rank)
    return body, holders


def _flag(tp, on: bool) -> list[int]:
    """The ranks that raised a one-byte flag (a malformed message raises none)."""
    return [p for p, v in enumerate(tp.gather(b"\x01" if on else b"\x00", 1)) if v == b"\x01"]


@dataclass
class Checked:
    """What :func:`present_and_repair` leaves: the `rebuilt` fragment when this rank was repaired
    (the caller writes it back), the ranks that hold a verified fragment afterwards (`holders`),
    the helpers whose blocks reached this rank (`helpers`), those whose blocks failed (`bad`), and
    this rank's fragment when it verified (`verified`)."""

    rebuilt: Fragment | None
    holders: list[int]
    helpers: list[int] = field(default_factory=list)
    bad: set[int] = field(default_factory=set)
    verified: Fragment | None = None  # this rank's fragment, when it verified


def report(tp, bad: set[int]) -> dict[int, list[int]]:
    """Every rank's list of peers whose symbols or rows failed -> rank -> the ranks that
    reported it. Only a target sees its helpers' symbols, so a rank is to be named bad only when
    more than t ranks reported it (t lying reporters cannot name an honest rank)."""
    tp.phase = "report"
    n = tp.size
    out: dict[int, list[int]] = {}
    for r, v in enumerate(tp.gather(bytes(1 if p in bad else 0 for p in range(n)), n)):
        if v is not None and len(v) == n:
            for p in range(n):
                if v[p] and p != r:
                    out.setdefault(p, []).append(r)
    return out


# ---------------------------------------------------------------------- block-level load
def leaf_matrix(code: Code2D, com: Commitment, raw: bytes) -> list[list[bytes]]:
    """The n×n leaf hashes of P from their bytes (row-major), checked against every committed line
    root (``ValueError`` otherwise): bound to the commitment, they verify single blocks."""
    n, d = code.n, len(com.root)
    if len(raw) != n * n * d:
        raise ValueError(f"coded checkpoint metadata: {len(raw)} bytes of leaf hashes where n={n} needs "
                         f"{n * n * d}")
    L = [[raw[(i * n + j) * d:(i * n + j + 1) * d] for j in range(n)] for i in range(n)]
    h = code._h
    for i in range(n):
        column = [L[j][i] for j in range(n)]
        if (_merkle.levels_from_leaves(h, L[i])[-1][0] != com.line_roots[i]
                or _merkle.levels_from_leaves(h, column)[-1][0] != com.line_roots[n + i]):
            raise ValueError("coded checkpoint metadata: its leaf hashes do not give the committed line "
                             "roots")
    return L


def present_and_repair(code: Code2D, tp, com: Commitment, L: list[list[bytes]], frag: Fragment | None,
                       *, present: bool | None = None, load=None) -> Checked:
    """The check: each rank hashes the 2k blocks of its fragment against their leaf hashes (no
    line is extended); then the repair of every rank whose fragment is missing or bad: k helpers
    (the lowest-numbered good ranks; the others only when blocks fail) each send P[target, j] and
    P[j, target] (2|m|/k² bytes), computed from their lines; the target checks each block against
    its leaf hash.

    Without the scrub (`present` given instead of `frag`: the fragment file's size and header are
    right; `load` reads it whole when this rank must help a repair), a damaged fragment is not
    found here: its blocks fail where they are used (:func:`fetch_blocks` decodes around them)."""
    tp.phase = "check"
    me, B, h, k = tp.rank, com.block_size, code._h, code.k
    if present is not None:
        ok = present
    else:
        ok = frag is not None and len(frag.row) == k * B and len(frag.col) == k * B and all(
            _merkle.leaf(h, frag.row[c * B:(c + 1) * B]) == L[me][c]
            and _merkle.leaf(h, frag.col[c * B:(c + 1) * B]) == L[c][me] for c in range(k))
        if frag is not None and not ok:
            log.warning("rank %d: its fragment does not match the commitment; rebuilding it", me)
            frag = None
    good = _flag(tp, ok)
    failed = [p for p in range(code.n) if p not in good]
    verified = frag if present is None else None  # (without the scrub nothing was checked)
    if not failed:
        return Checked(None, good, verified=verified)
    tp.phase = "repair"
    rebuilt: Fragment | None = None
    pairs: dict[int, RepairSymbols] = {}
    bad: set[int] = set()
    used: list[int] = []
    for helpers in (good[:code.k], good[code.k:]):  # k helpers; the rest only if blocks fail
        if not helpers:
            break
        sends: dict[int, np.ndarray] = {}
        if me in helpers:
            if frag is None and load is not None:
                frag = load()  # (without the scrub: a helper reads its whole fragment now)
            if frag is not None:
                row, col = code._line(frag.row, B), code._line(frag.col, B)
                sends = {i: np.concatenate([col[i], row[i]]) for i in failed}  # P[i, me], P[me, i]
            else:  # unreadable after all: blocks that fail, so the targets ask the next helpers
                sends = {i: np.zeros(2 * B, np.uint8) for i in failed}
        recvs = {j: np.zeros(2 * B, np.uint8) for j in helpers} if me in failed else {}
        tp.swap(sends, recvs)
        used += list(recvs)
        for j, buf in recvs.items():
            col_block, row_block = buf[:B], buf[B:]
            if _merkle.leaf(h, col_block) == L[me][j] and _merkle.leaf(h, row_block) == L[j][me]:
                pairs[j] = RepairSymbols(j, me, memoryview(col_block), (), memoryview(row_block), ())
            else:
                bad.add(j)
        if me in failed and rebuilt is None and len(pairs) >= code.k:
            try:
                rebuilt = code.rebuild(me, pairs, com)
            except RuntimeError as e:  # (a saver forged a block only this rank's lines hold)
                log.error("repair of rank %d: %s; this rank decodes from its peers' blocks", me, e)
        if not _flag(tp, me in failed and rebuilt is None):
            break
    if bad:
        log.warning("repair of rank %d: bad blocks from helpers %s", me, sorted(bad))
    tp.phase = "check"
    return Checked(rebuilt, _flag(tp, ok or rebuilt is not None), used, bad, verified)


def fetch_blocks(code: Code2D, tp, com: Commitment, L: list[list[bytes]], row_block, holders: list[int],
                 need: set[int]) -> tuple[dict[int, np.ndarray], set[int]]:
    """The verified blocks M[a, c] (block number b = a·k + c of m) in `need`: each from the rank
    holding row a, checked against its leaf hash; a block that is missing or fails is decoded
    from any k verified blocks P[j, c] of its column, which every holder sends from its row.
    `row_block(c)`: block c of this rank's row C[rank, :], or ``None``. Also returns the ranks whose
    blocks failed. Raises ``NotEnoughSymbols`` on a rank that cannot get k verified blocks of a
    column (the others finish)."""
    tp.phase = "retrieve"
    n, k, B, me, h = code.n, code.k, com.block_size, tp.rank, code._h
    mine = row_block
    cache: dict[int, np.ndarray] = {}

    def block(c: int) -> np.ndarray:
        if c not in cache:
            cache[c] = row_block(c)
        return cache[c]

    asked = tp.gather(bytes(1 if b in need else 0 for b in range(k * k)), k * k)
    wants = [set() if v is None or len(v) != k * k else {b for b in range(k * k) if v[b]} for v in asked]
    sends: dict[int, np.ndarray] = {}
    if mine is not None and me < k:
        for p in range(n):
            cs = sorted(b % k for b in wants[p] if b // k == me)
            if p != me and cs:
                sends[p] = np.concatenate([block(c) for c in cs])
    order = {a: sorted(b % k for b in need if b // k == a) for a in {b // k for b in need}
             if a != me and a in holders}
    recvs = {a: np.zeros(len(cs) * B, np.uint8) for a, cs in order.items()}
    tp.swap(sends, recvs)
    got: dict[int, np.ndarray] = {}
    bad: set[int] = set()
    for b in need:
        a, c = divmod(b, k)
        if a == me and mine is not None and _merkle.leaf(h, block(c)) == L[a][c]:
            got[b] = block(c)
    for a, cs in order.items():
        for i, c in enumerate(cs):
            blk = recvs[a][i * B:(i + 1) * B]
            if _merkle.leaf(h, blk) == L[a][c]:
                got[a * k + c] = blk
            else:
                bad.add(a)
    missing = need - set(got)
    columns = sorted({b % k for b in missing})
    asked = tp.gather(bytes(1 if c in columns else 0 for c in range(k)), k)
    wants2 = [set() if v is None or len(v) != k else {c for c in range(k) if v[c]} for v in asked]
    if not any(wants2):
        return got, bad
    sends = ({p: np.concatenate([block(c) for c in sorted(wants2[p])]) for p in range(n)
              if p != me and wants2[p]} if mine is not None else {})
    more = {j: np.zeros(len(columns) * B, np.uint8) for j in holders if j != me} if columns else {}
    tp.swap(sends, more)
    for c in columns:  # column c of P: an RS codeword of M[:, c]
        blocks: dict[int, np.ndarray] = {}
        if mine is not None and _merkle.leaf(h, block(c)) == L[me][c]:
            blocks[me] = block(c)
        for j, buf in more.items():
            blk = buf[columns.index(c) * B:(columns.index(c) + 1) * B]
            if _merkle.leaf(h, blk) == L[j][c]:
                blocks[j] = blk
            else:
                bad.add(j)
        if len(blocks) < k:
            raise NotEnoughSymbols(len(blocks), k, sorted(bad), "retrieve", f"blocks of column {c}")
        idx = sorted(blocks)[:k]
        M = code.decode_rows(np.stack([blocks[j] for j in idx]), idx, k * B)
        for b in missing:
            a, cc = divmod(b, k)
            if cc == c:
                got[b] = np.frombuffer(M, np.uint8)[a * B:(a + 1) * B]
    return got, bad
