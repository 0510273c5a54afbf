"""Fixed-format byte exchange between ranks: what a coded checkpoint's ranks send each other
(through :class:`._transport.Transport`).

Nothing received from a peer is unpickled: every message is a byte tensor of a size every rank
knows in advance (from the code's geometry, or from the verified commitment), parsed with
bounds checks. A peer that sends something else is treated like a peer that sends bad symbols.

Every message goes from its sender to each receiver over their own pair (point-to-point sends
and receives), never through a third rank. The backend's collectives relay: gloo's all-gather
is a ring (rank r receives every message but r − 1's from r − 1, which forwards it) and its
broadcast a binomial tree, so one bad rank in the middle could change what the honest ranks see
of each other's votes, reports and rows. Over direct pairs a bad rank can only lie about its
own message (which the protocol's rules bound: at most t voices); the bytes on the wire per
rank are the same as the ring's, (n − 1) messages sent and received.
"""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from ..dist import global_rank

MAX_VOTES = 16  # checkpoint steps one rank reports (its newest)


def exchange(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group
             ) -> tuple[dict[int, dist.Work], list[dist.Work]]:
    """Post every send (peer -> tensor) and receive (peer -> tensor) at once, peers being
    ranks of `group`, each over the direct pair of this rank and the peer -> (peer -> the work
    of its receive: wait on it before reading the tensor, the sends' works: wait on them before
    the tensors are changed or freed)."""
    ops = [dist.P2POp(dist.isend, t, global_rank(group, p), group) for p, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, t, global_rank(group, p), group) for p, t in recvs.items()]
    works = dist.batch_isend_irecv(ops) if ops else []
    return dict(zip(recvs, works[len(sends):], strict=True)), works[:len(sends)]


def all_gather_fixed(payload: bytes, size: int, group, absent: frozenset[int] = frozenset()
                     ) -> list[bytes | None]:
    """Every rank's `payload` (at most `size` bytes, this rank's included), each received from
    its sender directly (:func:`exchange`, never relayed). A message is its length, the payload
    padded to `size`, and a CRC-32 of both: a peer's message whose length field exceeds `size`, or
    that arrived short (gloo fills a receive buffer only as far as the sender sent; the buffers
    start zeroed, so a short message never exposes old memory and fails its check), comes back as
    ``None``; so does an `absent` peer's (nothing is sent to or received from it)."""
    if len(payload) > size:
        raise ValueError(f"message of {len(payload)} bytes exceeds its bound of {size}")
    buf = bytearray(4 + size + 4)
    buf[:4] = struct.pack("<I", len(payload))
    buf[4:4 + len(payload)] = payload
    buf[-4:] = struct.pack("<I", zlib.crc32(buf[:-4]))
    mine = torch.frombuffer(buf, dtype=torch.uint8)
    me, n = dist.get_rank(group), dist.get_world_size(group)
    out = {p: torch.zeros_like(mine) for p in range(n) if p != me and p not in absent}
    received, sent = exchange({p: mine for p in out}, out, group)
    for w in (*received.values(), *sent):
        w.wait()
    got: list[bytes | None] = []
    for p in range(n):
        if p in absent and p != me:
            got.append(None)
            continue
        raw = (mine if p == me else out[p]).numpy().tobytes()
        m = struct.unpack_from("<I", raw)[0]
        whole = struct.unpack_from("<I", raw, len(raw) - 4)[0] == zlib.crc32(raw[:-4])
        got.append(raw[4:4 + m] if m <= size and whole else None)
    return got


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
