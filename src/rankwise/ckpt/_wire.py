"""Fixed-format byte exchange between ranks: what :class:`CodedCheckpointer` sends its peers.

Nothing received from a peer is unpickled: every message is a byte tensor of a size every rank
knows in advance (from the code's geometry, or from the verified commitment), parsed with
bounds checks. A peer that sends something else is treated like a peer that sends bad symbols.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

TEXT_BYTES = 400  # an error or status message (longer ones are cut)
MAX_VOTES = 16  # checkpoint steps one rank reports (its newest)
MAX_PER_RANK = 1 << 20  # a rank's per-rank extras (RNG states: ~10 KB)


def all_gather_fixed(payload: bytes, size: int, group) -> list[bytes | None]:
    """Every rank's `payload` (at most `size` bytes, this rank's included); a peer's message
    whose length field exceeds `size` comes back as ``None``."""
    if len(payload) > size:
        raise ValueError(f"message of {len(payload)} bytes exceeds its bound of {size}")
    buf = bytearray(4 + size)
    buf[:4] = struct.pack("<I", len(payload))
    buf[4:4 + len(payload)] = payload
    mine = torch.frombuffer(buf, dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    got: list[bytes | None] = []
    for t in out:
        raw = t.numpy().tobytes()
        n = struct.unpack_from("<I", raw)[0]
        got.append(raw[4:4 + n] if n <= size else None)
    return got


def text(s: str | None) -> bytes:
    """A short message (``None``: empty), cut to :data:`TEXT_BYTES` bytes of UTF-8."""
    return b"" if s is None else s.encode("utf-8")[:TEXT_BYTES]


def untext(b: bytes | None) -> str | None:
    """The message of :func:`text` (``None`` for empty); a malformed one is named as such."""
    if b is None:
        return "(malformed message)"
    return b.decode("utf-8", "replace") or None


def votes(steps: dict[int, bytes], digest: int) -> bytes:
    """A rank's newest :data:`MAX_VOTES` (step, commitment root) pairs."""
    items = sorted(steps.items(), reverse=True)[:MAX_VOTES]
    return b"".join(struct.pack("<Q", s) + r for s, r in items if len(r) == digest)


def unvotes(b: bytes | None, digest: int) -> dict[int, bytes]:
    """The pairs of :func:`votes`; a malformed message counts as no votes."""
    if b is None or len(b) % (8 + digest):
        return {}
    w = 8 + digest
    return {struct.unpack_from("<Q", b, i)[0]: b[i + 8:i + w] for i in range(0, len(b), w)}


def votes_size(digest: int) -> int:
    return MAX_VOTES * (8 + digest)


def bitmap(members: list[int], n: int) -> bytes:
    return bytes(1 if i in members else 0 for i in range(n))


def unbitmap(b: bytes) -> list[int]:
    return [i for i, x in enumerate(b) if x]
