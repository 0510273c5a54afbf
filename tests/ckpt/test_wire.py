"""The checkpoint wire's fixed-format messages: a peer's short or overlong message is malformed
(``None``), never read from memory it did not send."""

from __future__ import annotations

import torch
from tests.distributed import run_world

from rankwise.ckpt import _wire

SIZE = 400  # a status message's agreed bound


def _short_sender(rank: int) -> list:
    """Rank 0 gathers a status the usual way; rank 1 answers with 4 bytes where 4 + 400 + 4 are
    agreed (a length field claiming 400), and a full message with an overlong length field."""
    import struct

    import torch.distributed as dist

    group = dist.group.WORLD
    if rank == 0:
        return [_wire.all_gather_fixed(b"ok", SIZE, group) for _ in range(2)]
    for claim in ("short", "overlong"):
        short = torch.frombuffer(bytearray(struct.pack("<I", 400)), dtype=torch.uint8)
        full = bytearray(4 + SIZE + 4)
        full[:4] = struct.pack("<I", SIZE + 1)
        message = short if claim == "short" else torch.frombuffer(full, dtype=torch.uint8)
        inbox = torch.zeros(4 + SIZE + 4, dtype=torch.uint8)
        received, sent = _wire.exchange({0: message}, {0: inbox}, group)
        for w in (*received.values(), *sent):
            w.wait()
    return []


def test_a_short_or_overlong_message_is_malformed_not_read_from_stale_memory(tmp_path):
    got = run_world(_short_sender, 2, tmp_path, timeout=60.0)[0]
    for status in got:
        assert status[0] == b"ok" and status[1] is None
