"""Versioned binary format of fragments and commitments.

Layout (little endian): magic ``b"RWCK"``, format version (u16), kind (u8: 1 fragment,
2 commitment, 3 repair symbols), the body, then a SHA-256 of everything before it. A truncated,
corrupted or foreign file raises ``ValueError`` naming the problem.

The SHA-256 catches accidents only: whoever writes a file can recompute it. What a bad party
cannot forge is the commitment's root, which from version 2 binds every field decoding uses
(see :func:`rankwise.ckpt._code2d.commitment_root`); version 1 files (roots over the line roots
only) are still read.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC, VERSION = b"RWCK", 2
READABLE = (1, 2)
FRAGMENT, COMMITMENT, SYMBOLS = 1, 2, 3
_HEAD = struct.Struct("<4sHB")
_DIGEST = 32


def seal(kind: int, body: bytes, version: int = VERSION) -> bytes:
    """Header + body + checksum."""
    head = _HEAD.pack(MAGIC, version, kind) + body
    return head + hashlib.sha256(head).digest()


def unseal(blob: bytes, kind: int, what: str) -> memoryview:
    """Check header and checksum; return the body."""
    return unseal_versioned(blob, kind, what)[1]


def unseal_versioned(blob: bytes, kind: int, what: str) -> tuple[int, memoryview]:
    """Check header and checksum; return the format version and the body."""
    blob = bytes(blob)
    if len(blob) < _HEAD.size + _DIGEST:
        raise ValueError(f"{what}: truncated ({len(blob)} bytes)")
    magic, version, got = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError(f"{what}: not a rankwise checkpoint file (magic {magic!r})")
    if version not in READABLE:
        raise ValueError(f"{what}: format version {version}, this rankwise reads {READABLE}")
    if got != kind:
        raise ValueError(f"{what}: file holds kind {got}, expected {kind}")
    if hashlib.sha256(blob[:-_DIGEST]).digest() != blob[-_DIGEST:]:
        raise ValueError(f"{what}: checksum mismatch (corrupted or truncated)")
    return version, memoryview(blob)[_HEAD.size:-_DIGEST]


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
