"""The wire formats: fragments, commitments, repair symbols and the sealed envelope around them.

Layout (little endian): magic ``b"RWCK"``, format version (u16), kind (u8: 1 fragment,
2 commitment, 3 repair symbols, 4 DCP metadata), the body, then a SHA-256 of everything before
it. A truncated, corrupted or foreign file raises ``ValueError`` naming the problem.

Fragment files (and repair symbols) are version 3: header, the sizes, a SHA-256 of those two,
then the row and the column. The checksum covers the header only; the row and the
column are hashed once, by the Merkle trees that every reader checks them against (the
commitment's line roots), instead of a second time by a checksum over the same bytes.

The SHA-256 catches accidents only: whoever writes a file can recompute it. What a bad party
cannot forge is the commitment's root, which binds every field decoding uses
(:func:`commitment_root`). Only these versions are read: earlier ones never left development.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from . import _merkle

MAGIC, VERSION = b"RWCK", 2
READABLE = (VERSION,)  # commitments and DCP metadata
FRAGMENT_VERSION = 3  # fragment files and repair symbols: the checksum covers the header only
FRAGMENT, COMMITMENT, SYMBOLS, METADATA = 1, 2, 3, 4
_HEAD = struct.Struct("<4sHB")
_SIZES = struct.Struct("<IQQ")  # a fragment's index, row length, column length
_SYM = struct.Struct("<IIQBHH")  # repair symbols: helper, target, block size, digest size, path lengths
_DIGEST = 32
FRAGMENT_HEAD = _HEAD.size + _SIZES.size + _DIGEST  # what precedes a fragment's row


def seal(kind: int, body: bytes, version: int = VERSION) -> bytes:
    """Header + body + a SHA-256 of both."""
    head = _HEAD.pack(MAGIC, version, kind) + bytes(body)
    return head + hashlib.sha256(head).digest()


def unseal(blob: bytes, kind: int, what: str) -> memoryview:
    """Check header and checksum; return the body."""
    return unseal_versioned(blob, kind, what)[1]


def unseal_versioned(blob: bytes, kind: int, what: str) -> tuple[int, memoryview]:
    """Check header and checksum; return the format version and the body."""
    blob = memoryview(blob).cast("B")
    if len(blob) < _HEAD.size + _DIGEST:
        raise ValueError(f"{what}: truncated ({len(blob)} bytes)")
    magic, version, got = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError(f"{what}: not a rankwise checkpoint file (no rankwise magic at its start)")
    if version not in READABLE:
        raise ValueError(f"{what}: format version {version}, this rankwise reads {READABLE}")
    if got != kind:
        raise ValueError(f"{what}: file holds kind {got}, expected {kind}")
    if hashlib.sha256(blob[:-_DIGEST]).digest() != blob[-_DIGEST:]:
        raise ValueError(f"{what}: checksum mismatch (corrupted or truncated)")
    return version, blob[_HEAD.size:-_DIGEST]


class Reader:
    """Bounds-checked reads from a body."""

    def __init__(self, body: memoryview, what: str) -> None:
        self.body, self.pos, self.what = body, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.body):
            raise ValueError(f"{self.what}: body ends early")
        out = bytes(self.body[self.pos:self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(s.size))

    def done(self) -> None:
        if self.pos != len(self.body):
            raise ValueError(f"{self.what}: {len(self.body) - self.pos} trailing bytes")


MAX_PARTIES = 255  # a systematic MDS code over GF(2⁸) has at most 256 symbols: n ≤ 255 parties
DIGEST_SIZES = frozenset({32})  # sha256 and blake3, the hashes of _merkle.HASHES


@dataclass(frozen=True)
class Commitment:
    """What every party agrees on: geometry, and Merkle roots of the 2n lines of P (rows 0..n−1,
    then columns 0..n−1) under one top ``root``.

    From format version 2 ``root`` also binds `n`, `t`, `data_len`, `block_size`, `hash`,
    `codec` and the version (:func:`commitment_root`): two commitments with the same root agree
    on everything decoding uses. Version 1 roots cover the line roots only."""

    n: int
    t: int
    data_len: int
    block_size: int
    hash: str
    codec: str
    line_roots: tuple[bytes, ...]
    root: bytes
    version: int = VERSION

    def to_bytes(self) -> bytes:
        names = b"".join(len(x).to_bytes(1, "little") + x for x in (self.hash.encode(), self.codec.encode()))
        d = len(self.root)
        body = struct.pack("<HHQQB", self.n, self.t, self.data_len, self.block_size, d) + names
        return seal(COMMITMENT, body + b"".join(self.line_roots) + self.root, self.version)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Commitment:
        version, body = unseal_versioned(blob, COMMITMENT, "commitment")
        r = Reader(body, "commitment")
        n, t, data_len, block_size, d = r.unpack("HHQQB")
        # geometry first: nothing proportional to n is done before n and d are known to be sane
        if not 1 <= n <= MAX_PARTIES:
            raise ValueError(f"commitment: n={n} parties, outside [1, {MAX_PARTIES}] (a GF(2⁸) code)")
        if d not in DIGEST_SIZES:
            raise ValueError(f"commitment: digest size {d}, not one of the known hashes' "
                             f"{sorted(DIGEST_SIZES)}")
        try:
            hash_name = r.take(r.unpack("B")[0]).decode("ascii", "strict")
            codec = r.take(r.unpack("B")[0]).decode("ascii", "strict")
        except UnicodeDecodeError:  # (its message would quote the file's bytes)
            raise ValueError("commitment: its hash or codec name is not ASCII") from None
        if len(r.body) - r.pos != (2 * n + 1) * d:
            raise ValueError(f"commitment: {len(r.body) - r.pos} bytes of roots where n={n} and digest "
                             f"size {d} need {(2 * n + 1) * d}")
        roots = tuple(r.take(d) for _ in range(2 * n))
        root = r.take(d)
        r.done()
        return cls(n, t, data_len, block_size, hash_name, codec, roots, root, version)


CODEC = "cauchy-gf256"


def commitment_root(h, *, n: int, t: int, data_len: int, block_size: int, hash: str, codec: str,
                    line_roots: tuple[bytes, ...], version: int = VERSION) -> bytes:
    """The commitment's root: the header fields (version, n, t, data_len, block_size, hash,
    codec) hashed with the Merkle root of the 2n line roots."""
    top = _merkle.root(h, list(line_roots))
    head = struct.pack("<HHHQQ", version, n, t, data_len, block_size)
    names = b"".join(len(x).to_bytes(1, "little") + x for x in (hash.encode(), codec.encode()))
    return h(b"\x02rwck-commitment", head, names, top)


def block_size(data_len: int, k: int) -> int:
    """B = ⌈data_len / k²⌉ (at least 1): the block size of a k×k grid holding data_len bytes."""
    return max(1, -(-data_len // (k * k)))


def check_consistent(com: Commitment) -> None:
    """Raise ``ValueError`` unless the commitment's own fields fit together: a valid geometry
    (1 ≤ t, 3t < n), a block size that fits its length, and a root that its fields hash to
    under its own hash (:func:`commitment_root`)."""
    if not (com.t >= 1 and 3 * com.t < com.n and len(com.line_roots) == 2 * com.n):
        raise ValueError(f"commitment is inconsistent: n={com.n}, t={com.t}, "
                         f"{len(com.line_roots)} line roots")
    expected = block_size(com.data_len, com.n - com.t)
    if com.block_size != expected:
        raise ValueError(f"commitment is inconsistent: block_size {com.block_size} does not fit "
                         f"data_len {com.data_len} (expected {expected})")
    if com.root != commitment_root(_merkle.get_hash(com.hash), n=com.n, t=com.t, data_len=com.data_len,
                                   block_size=com.block_size, hash=com.hash, codec=com.codec,
                                   line_roots=com.line_roots, version=com.version):
        raise ValueError("commitment is inconsistent: its fields do not hash to its root")


@dataclass(frozen=True)
class Fragment:
    """Worker ``index``'s share: ``row`` = C[index, :] and ``col`` = R[:, index] (k blocks each;
    bytes, or memoryviews of an encoder's or a reader's buffer)."""

    index: int
    row: bytes
    col: bytes

    def to_parts(self) -> list:
        """The file as a list of buffers, without concatenating the fragment's bytes
        (``b"".join(parts) == to_bytes()``): header, sizes, their SHA-256, row, column."""
        sizes = _SIZES.pack(self.index, len(self.row), len(self.col))
        head = _HEAD.pack(MAGIC, FRAGMENT_VERSION, FRAGMENT)
        return [head, sizes, hashlib.sha256(head + sizes).digest(), self.row, self.col]

    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts())

    def file_size(self) -> int:
        """The length of :meth:`to_bytes`, without building it."""
        return _HEAD.size + _SIZES.size + _DIGEST + len(self.row) + len(self.col)

    @classmethod
    def from_bytes(cls, blob) -> Fragment:
        """Parse a fragment file. The row and the column are memoryviews of `blob` (no copy);
        the caller checks them against the commitment."""
        mv = memoryview(blob).cast("B")
        check_fragment_head(mv[:FRAGMENT_HEAD], None)
        index, nrow, ncol = _SIZES.unpack_from(mv, _HEAD.size)
        start = FRAGMENT_HEAD
        if len(mv) != start + nrow + ncol:
            raise ValueError(f"fragment: {len(mv)} bytes where the header says {start + nrow + ncol} "
                             "(truncated or extended)")
        return cls(index, mv[start:start + nrow], mv[start + nrow:])


def fragment_size(line_bytes: int) -> int:
    """The exact length of a fragment file whose row and column hold `line_bytes` each."""
    return FRAGMENT_HEAD + 2 * line_bytes


def check_fragment_head(first: bytes, line_bytes: int | None) -> None:
    """Check the first :data:`FRAGMENT_HEAD` bytes of a fragment file whose lines should hold
    `line_bytes` each (any size when ``None``), before its body is read: ``ValueError`` naming
    what is wrong (no rankwise magic, another kind or version, a header checksum that fails,
    other sizes)."""
    mv = memoryview(first).cast("B")
    if len(mv) < FRAGMENT_HEAD:
        raise ValueError(f"fragment: truncated ({len(mv)} bytes)")
    magic, version, kind = _HEAD.unpack_from(mv)
    if magic != MAGIC:
        raise ValueError("fragment: not a rankwise checkpoint file (no rankwise magic at its start)")
    if kind != FRAGMENT:
        raise ValueError(f"fragment: file holds kind {kind}, expected {FRAGMENT}")
    if version != FRAGMENT_VERSION:
        raise ValueError(f"fragment: format version {version}, this rankwise reads {FRAGMENT_VERSION}")
    sizes = _HEAD.size + _SIZES.size
    if hashlib.sha256(mv[:sizes]).digest() != mv[sizes:FRAGMENT_HEAD]:
        raise ValueError("fragment: header checksum mismatch (corrupted)")
    _, nrow, ncol = _SIZES.unpack_from(mv, _HEAD.size)
    if line_bytes is not None and (nrow != line_bytes or ncol != line_bytes):
        raise ValueError(f"fragment: lines of {nrow:,} and {ncol:,} bytes where the commitment's geometry "
                         f"has {line_bytes:,}")


@dataclass(frozen=True)
class RepairSymbols:
    """Helper ``helper``'s two blocks for worker ``target``: ``col_block`` = P[target, helper]
    (leaf ``target`` of column ``helper``) and ``row_block`` = P[helper, target] (leaf
    ``target`` of row ``helper``), each with its Merkle path."""

    helper: int
    target: int
    col_block: bytes
    col_path: tuple[bytes, ...]
    row_block: bytes
    row_path: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        """Payload: the two blocks."""
        return len(self.col_block) + len(self.row_block)

    @property
    def wire_bytes(self) -> int:
        """Everything sent: the length of :meth:`to_bytes` (blocks, paths, indices, sizes,
        header and its checksum)."""
        return _HEAD.size + _SYM.size + sum(map(len, self.col_path + self.row_path)) + _DIGEST + self.nbytes

    def to_parts(self) -> list:
        """The wire form (version 3) as buffers, the blocks not copied: header, indices and
        sizes, the Merkle paths, a SHA-256 of all that, then the two blocks (checked by their
        Merkle paths, not by the checksum)."""
        d = len(self.col_path[0]) if self.col_path else 0
        meta = b"".join([_HEAD.pack(MAGIC, FRAGMENT_VERSION, SYMBOLS),
                         _SYM.pack(self.helper, self.target, len(self.col_block), d, len(self.col_path),
                                   len(self.row_path)), *self.col_path, *self.row_path])
        return [meta, hashlib.sha256(meta).digest(), self.col_block, self.row_block]

    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts())

    @classmethod
    def from_bytes(cls, blob) -> RepairSymbols:
        """Parse the wire form; the blocks are views of `blob` (no copy)."""
        mv = memoryview(blob).cast("B")
        what = "repair symbols"
        if len(mv) < _HEAD.size + _SYM.size + _DIGEST:
            raise ValueError(f"{what}: truncated ({len(mv)} bytes)")
        magic, version, kind = _HEAD.unpack_from(mv)
        if magic != MAGIC or version != FRAGMENT_VERSION or kind != SYMBOLS:
            raise ValueError(f"{what}: not repair symbols of version {FRAGMENT_VERSION} (magic "
                             f"{'ok' if magic == MAGIC else 'wrong'}, version {version}, kind {kind})")
        helper, target, B, d, nc, nr = _SYM.unpack_from(mv, _HEAD.size)
        end = _HEAD.size + _SYM.size + (nc + nr) * d
        if len(mv) != end + _DIGEST + 2 * B:
            raise ValueError(f"{what}: {len(mv)} bytes where the header says {end + _DIGEST + 2 * B}")
        if hashlib.sha256(mv[:end]).digest() != mv[end:end + _DIGEST]:
            raise ValueError(f"{what}: header checksum mismatch (corrupted)")
        pos = _HEAD.size + _SYM.size
        paths = [bytes(mv[pos + i * d:pos + (i + 1) * d]) for i in range(nc + nr)]
        blocks = end + _DIGEST
        return cls(helper, target, mv[blocks:blocks + B], tuple(paths[:nc]), mv[blocks + B:],
                   tuple(paths[nc:]))
