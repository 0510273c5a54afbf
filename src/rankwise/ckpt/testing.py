"""Test doubles for the checkpoint layer: a rank that sends its peers bad data.

Fault injection lives here, not in the production classes: the tests and ``rankwise ckpt demo``
use these to show that a lying rank is named and excluded.
"""

from __future__ import annotations

from ._checkpointer import CodedCheckpointer
from ._code2d import Lines
from ._format import Fragment


def flip(blob: bytes, at: int) -> bytes:
    """`blob` with one bit flipped at byte `at`."""
    b = bytearray(blob)
    b[at] ^= 0x01
    return bytes(b)


class LyingCheckpointer(CodedCheckpointer):
    """A :class:`CodedCheckpointer` whose repair symbols and retrieval rows are corrupted (one
    bit each, in messages of the expected size): what its peers must detect, name and exclude."""

    def _helper_payload(self, lines: Lines, target: int) -> list:
        payload = b"".join(bytes(p) for p in super()._helper_payload(lines, target))
        return [flip(payload, len(payload) - 1)]  # in the row block: a valid header, a bad symbol

    def _row_payload(self, frag: Fragment) -> bytes:
        return flip(super()._row_payload(frag), 7)
