"""Merkle trees over the blocks of one line (row or column) of the extended grid P."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

Hash = Callable[..., bytes]  # h(*buffers) -> digest of their concatenation


def _hasher(new) -> Hash:
    def h(*parts) -> bytes:
        x = new()
        for p in parts:
            x.update(p)  # any buffer (bytes, memoryview, contiguous numpy array): no copies
        return x.digest()

    return h


HASHES: dict[str, Hash] = {"sha256": _hasher(hashlib.sha256)}
try:  # blake3 is the default; sha256 (stdlib) is always available
    import blake3 as _blake3

    HASHES["blake3"] = _hasher(_blake3.blake3)
except ImportError:  # pragma: no cover - blake3 is a declared dependency
    pass


def get_hash(name: str) -> Hash:
    try:
        return HASHES[name]
    except KeyError:
        raise ValueError(f"`hash` must be one of {sorted(HASHES)}; got {name!r}") from None


def leaf(h: Hash, block) -> bytes:
    """Leaf hash of one block (domain-separated from inner nodes)."""
    return h(b"\x00", block)


def _node(h: Hash, a: bytes, b: bytes) -> bytes:
    return h(b"\x01", a, b)


def levels_from_leaves(h: Hash, leaves: list[bytes]) -> list[list[bytes]]:
    """All tree levels over given leaf hashes, leaves first; an odd node at the end of a level
    is carried up."""
    level = list(leaves)
    out = [level]
    while len(level) > 1:
        level = [_node(h, level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
        out.append(level)
    return out


def levels(h: Hash, blocks) -> list[list[bytes]]:
    """All tree levels over the blocks (any buffers), leaves first."""
    return levels_from_leaves(h, [leaf(h, b) for b in blocks])


def root(h: Hash, blocks) -> bytes:
    return levels(h, blocks)[-1][0]


def path(tree: list[list[bytes]], index: int) -> list[bytes]:
    """Sibling hashes from leaf ``index`` up to the root (carried-up nodes have none)."""
    sibs = []
    for level in tree[:-1]:
        sib = index ^ 1
        if sib < len(level):
            sibs.append(level[sib])
        index //= 2
    return sibs


def verify(h, block: bytes, index: int, count: int, sibs: list[bytes], expected_root: bytes) -> bool:
    """Does ``block`` sit at ``index`` of a ``count``-leaf tree with root ``expected_root``?"""
    if not 0 <= index < count:
        return False
    node, width, it = leaf(h, block), count, iter(sibs)
    while width > 1:
        sib = index ^ 1
        if sib < width:
            other = next(it, None)
            if other is None:
                return False
            node = _node(h, node, other) if index % 2 == 0 else _node(h, other, node)
        index //= 2
        width = (width + 1) // 2
    return next(it, None) is None and node == expected_root
