"""How the ranks of a coded checkpoint talk: bounded messages over direct pairs, nothing unpickled.

:class:`Transport` is the one interface the checkpoint's collective phases (:mod:`._phases`)
use. Every message goes from its sender to each receiver over their own pair (never relayed
through a third rank: gloo's all-gather is a ring and its broadcast a tree), and every receive
has a size the receiver fixed beforehand (from the code's geometry or a verified commitment),
into a zeroed buffer. Fault injection in tests subclasses this class (a rank that lies, sends
short messages or stays silent), never the phases.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from . import _wire


def _tensor(buf) -> torch.Tensor:
    """A uint8 tensor sharing `buf`'s memory when it is a writable contiguous array, else a copy."""
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    a = a.reshape(-1)
    if not a.flags.writeable or not a.flags.c_contiguous:
        a = a.copy()
    return torch.from_numpy(a)


class Transport:
    """Messages between the ranks of `group` (its own group: a save that runs in the background
    must not interleave with training's collectives on the default group).

    ``rank``/``size`` are this rank's index and the group's size; ``sent``/``received`` count
    the payload bytes of :meth:`swap` per phase name (set ``phase`` before a phase's messages),
    ``control`` the bytes each rank sent in :meth:`gather` (votes, flags: framing included).
    Nothing is sent to or received from an `absent` rank (one that did not join: :func:`attend`):
    its messages are ``None`` in :meth:`gather` and zeros in :meth:`swap`, like a bad rank's."""

    def __init__(self, group, *, absent: frozenset[int] = frozenset()) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.absent = frozenset(absent) - {self.rank}
        self.phase = "other"
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.control: dict[str, int] = {}

    def gather(self, payload: bytes, size: int) -> list[bytes | None]:
        """Every rank's `payload` (≤ `size` bytes; this rank's included); a peer's malformed
        message (short, overlong, failing its CRC) is ``None`` (:func:`._wire.all_gather_fixed`)."""
        got = _wire.all_gather_fixed(payload, size, self.group, self.absent)
        peers = self.size - 1 - len(self.absent)
        self.control[self.phase] = self.control.get(self.phase, 0) + (8 + size) * peers
        return got

    def swap(self, sends: dict[int, object], recvs: dict[int, np.ndarray]) -> None:
        """Send each peer its buffer (bytes-like or a uint8 array) and receive each peer's message
        into its uint8 array (which the caller sized and zeroed), at once; returns when all are
        done. Empty buffers are skipped on both sides."""
        skip = self.absent | {self.rank}
        out = {p: _tensor(b) for p, b in sends.items() if p not in skip and len(memoryview(b).cast("B"))}
        into = {p: a for p, a in recvs.items() if p not in skip and a.size}
        if not all(a.flags.c_contiguous and a.flags.writeable for a in into.values()):
            raise ValueError("receive buffers must be writable contiguous uint8 arrays")
        tin = {p: torch.from_numpy(a.reshape(-1)) for p, a in into.items()}
        received, sent = _wire.exchange(out, tin, self.group)
        for w in (*received.values(), *sent):
            w.wait()
        self.sent[self.phase] = self.sent.get(self.phase, 0) + sum(t.numel() for t in out.values())
        self.received[self.phase] = self.received.get(self.phase, 0) + sum(a.size for a in into.values())


def attend(group, key: str, seconds: float) -> frozenset[int]:
    """The ranks of `group` that did not join round `key` within `seconds` of this rank joining,
    the same set on every rank that joined in time; a rank that joined late raises
    ``RuntimeError``.

    Each rank marks itself present in the default process group's store and waits until every
    peer has (no wait at all when all are there) or the time is up; the first rank to stop
    waiting writes who it saw with the store's compare-and-set, and every rank takes that one
    answer. `key` must name the round alike on every rank and never repeat within a store."""
    store = dist.distributed_c10d._get_default_store()
    me, n = dist.get_rank(group), dist.get_world_size(group)
    names = [f"rankwise/attend/{key}/{p}" for p in range(n)]
    store.set(names[me], b"1")
    end = time.monotonic() + seconds
    while not store.check(names):
        if time.monotonic() >= end:
            break
        time.sleep(0.02)
    view = bytes(int(store.check([x])) for x in names)
    members = store.compare_set(f"rankwise/attend/{key}/members", "", view)
    if len(members) != n:
        raise RuntimeError(f"the store's members of round {key!r} are malformed ({len(members)} bytes)")
    absent = frozenset(p for p in range(n) if not members[p])
    if me in absent:
        raise RuntimeError(f"rank {me} joined after the others' deadline ({seconds:g} s); ranks "
                           f"{sorted(set(range(n)) - absent)} went on without it")
    return absent
