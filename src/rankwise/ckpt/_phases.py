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
- :func:`check_and_repair`: each rank verifies its fragment; a rank whose fragment is missing or
  fails is rebuilt from two blocks of k helpers (2|m|/k bytes in all), more helpers only when
  symbols fail their Merkle paths.
- :func:`fetch_rows`: each rank receives the systematic rows C[a, :] = M[a, :] that hold its
  items (|m|/k bytes each), verifies each against the commitment, and, when one is missing or
  bad, decodes from any k verified rows.

Every phase ends the same way on every rank that follows it (decisions are taken from messages
all ranks received alike), so one bad rank costs its own vote, symbols or rows, not the phase.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass, field

import numpy as np

from ._code2d import Code2D, Lines, NotEnoughSymbols
from ._format import Commitment, Fragment, RepairSymbols

log = logging.getLogger(__name__)


def _bounds(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def encode_across(code: Code2D, tp, share, doc: bytes
                  ) -> tuple[Fragment, Commitment, list[bytes], list[int]]:
    """This rank's fragment of the checkpoint whose rank-r share is every rank's `share` (bytes-like),
    the commitment every rank computes alike, every rank's `doc` (a description the caller writes
    with the fragment: its items' names and places) and where each rank's share starts in m.
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
    if me < k:  # P[me, :] from M's row; block i is rank i's column block
        line = code._line(flat, B)
        sends = {i: line[i] for i in range(n) if i != me}
        col[me] = line[me]
    recvs = {r: col[r] for r in range(k) if r != me}
    tp.swap(sends, recvs)

    sends, recvs = {}, {}
    if me < k:  # P[:, me] from the column; block j (a parity row) is rank j's row block
        line = code._line(col.reshape(-1), B)
        sends = {j: line[j] for j in range(k, n)}
    else:
        recvs = {c: row[c] for c in range(k)}
    tp.swap(sends, recvs)

    frag = Fragment(me, memoryview(flat), memoryview(col.reshape(-1)))
    lines = code.lines(frag, B)
    d = len(lines.row_tree[0][0])
    leaves = tp.gather(b"".join(lines.row_tree[0] + lines.col_tree[0]), 2 * n * d)
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
    return frag, code.commitment_from_leaves(at[-1], rows, cols), docs, at[:-1]


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
    """What :func:`check_and_repair` leaves: this rank's verified `lines` (``None`` when its
    fragment could not be rebuilt), the `rebuilt` fragment when it was repaired (the caller writes
    it back), the ranks that hold a verified fragment afterwards (`holders`), the helpers whose
    symbols reached this rank (`helpers`) and those whose symbols failed (`bad`)."""

    lines: Lines | None
    rebuilt: Fragment | None
    holders: list[int]
    helpers: list[int] = field(default_factory=list)
    bad: set[int] = field(default_factory=set)


def check_and_repair(code: Code2D, tp, com: Commitment, frag: Fragment | None) -> Checked:
    """Verify this rank's fragment; rebuild every rank's that is missing or bad from its peers
    (k helpers: the lowest-numbered good ranks; the others only when symbols fail)."""
    lines = code.verified_lines(frag, com) if frag is not None else None
    tp.phase = "check"
    good = _flag(tp, lines is not None)
    failed = [p for p in range(code.n) if p not in good]
    if not failed:
        return Checked(lines, None, good)
    tp.phase = "repair"
    rebuilt: Fragment | None = None
    symbols: list[RepairSymbols] = []
    bad: set[int] = set()
    used: list[int] = []
    rounds = [good[:code.k], good[code.k:]]  # k helpers; the rest only if symbols fail
    for helpers in rounds:
        if not helpers:
            break
        sends: dict[int, bytes] = {}
        if tp.rank in helpers and lines is not None:
            sends = {i: code.helper_symbols(lines, i).to_bytes() for i in failed}
        size = code.symbols_size(tp.rank, com.block_size)
        recvs = {j: np.zeros(size, np.uint8) for j in helpers} if tp.rank in failed else {}
        tp.swap(sends, recvs)
        used += list(recvs)
        for j, buf in recvs.items():
            try:
                symbols.append(RepairSymbols.from_bytes(buf.tobytes()))
            except (ValueError, struct.error):
                log.warning("repair of rank %d: helper %d sent symbols that do not parse", tp.rank, j)
                bad.add(j)
        if tp.rank in failed and rebuilt is None:
            good_symbols, failing = code.verified_symbols(tp.rank, symbols, com)
            bad.update(failing)
            if len(good_symbols) >= code.k:
                try:
                    rebuilt = code.rebuild(tp.rank, good_symbols, com)
                except RuntimeError as e:  # (a saver forged a block only this rank's lines hold)
                    log.error("repair of rank %d: %s; this rank decodes from its peers' rows", tp.rank, e)
            else:
                log.warning("repair of rank %d: %s", tp.rank,
                            NotEnoughSymbols(len(good_symbols), code.k, sorted(bad)))
        if not _flag(tp, tp.rank in failed and rebuilt is None):
            break
    if rebuilt is not None:
        lines = code.lines(rebuilt, com.block_size)
    if bad:
        log.warning("repair of rank %d: bad symbols from helpers %s", tp.rank, sorted(bad))
    tp.phase = "check"
    return Checked(lines, rebuilt, _flag(tp, lines is not None), used, bad)


def fetch_rows(code: Code2D, tp, com: Commitment, lines: Lines | None, holders: list[int],
               need: set[int]) -> tuple[dict[int, memoryview], set[int]]:
    """The verified rows C[a, :] = M[a, :] for every a in `need` (a < k), sent by their holders
    directly; when one is missing or fails its root, every holder's row is requested and the
    needed rows are decoded from any k that verify. Also returns the holders whose rows failed.
    Raises ``NotEnoughSymbols`` on a rank that cannot get k verified rows (the others finish)."""
    tp.phase = "retrieve"
    n, k, R = code.n, code.k, code.k * com.block_size
    own = None if lines is None else np.concatenate(lines.row[:k])
    asked = tp.gather(bytes(1 if a in need else 0 for a in range(k)), k)
    wants = [set() if v is None else {a for a in range(min(k, len(v))) if v[a]} for v in asked]
    sends = ({p: own for p in range(n) if tp.rank in wants[p] and p != tp.rank}
             if own is not None and tp.rank < k else {})
    recvs = {a: np.zeros(R, np.uint8) for a in need if a in holders and a != tp.rank}
    tp.swap(sends, recvs)
    rows: dict[int, memoryview] = {}
    bad: set[int] = set()
    if own is not None:
        rows[tp.rank] = memoryview(own)
    for a, buf in recvs.items():
        if code.verify_row(a, buf, com):
            rows[a] = memoryview(buf)
        else:
            log.warning("rank %d: row %d from rank %d does not match the commitment", tp.rank, a, a)
            bad.add(a)
    missing = {a for a in need if a not in rows}
    decoders = _flag(tp, bool(missing))
    if not decoders:
        return {a: rows[a] for a in need}, bad
    # second round: every holder sends its row to each decoder that did not get it in the first
    sent_before = {p: (wants[p] if tp.rank < k else set()) for p in range(n)}
    sends = ({p: own for p in decoders if p != tp.rank and tp.rank not in sent_before[p]}
             if own is not None else {})
    more = ({h: np.zeros(R, np.uint8) for h in holders if h != tp.rank and h not in recvs}
            if missing else {})
    tp.swap(sends, more)
    if not missing:
        return {a: rows[a] for a in need}, bad
    for h, buf in more.items():
        if code.verify_row(h, buf, com):
            rows[h] = memoryview(buf)
        else:
            bad.add(h)
    if len(rows) < k:
        raise NotEnoughSymbols(len(rows), k, [], "retrieve", "rows")
    idx = sorted(rows)[:k]
    M = code.decode_rows(np.stack([np.frombuffer(rows[i], np.uint8) for i in idx]), idx, k * R)
    return {a: M[a * R:(a + 1) * R] for a in need}, bad


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
