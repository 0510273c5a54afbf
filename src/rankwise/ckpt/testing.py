"""Test doubles for the checkpoint layer: a rank that sends its peers bad data.

Fault injection goes through the one interface the ranks talk through (:class:`._transport.Transport`),
never through overridden phases: the tests and ``rankwise ckpt demo`` use these to show that a lying
rank is named and excluded.
"""

from __future__ import annotations

from typing import Any

from ._checkpointer import CodedCheckpointer
from ._transport import Transport


def flip(blob: bytes, at: int) -> bytes:
    """`blob` with one bit flipped at byte `at`."""
    b = bytearray(blob)
    b[at] ^= 0x01
    return bytes(b)


class LyingTransport(Transport):
    """A rank whose repair symbols and rows are corrupted (one bit at the end of each message, of
    the expected size): what its peers must detect, name and exclude."""

    lie_in = ("repair", "retrieve")

    def swap(self, sends: dict[int, Any], recvs: dict) -> None:
        if self.phase in self.lie_in:
            sends = {p: flip(bytes(memoryview(b).cast("B")), len(memoryview(b).cast("B")) - 1)
                     for p, b in sends.items()}
        super().swap(sends, recvs)


class LyingCheckpointer(CodedCheckpointer):
    """A :class:`CodedCheckpointer` whose rank talks through :class:`LyingTransport`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(transport=LyingTransport, **kwargs)
