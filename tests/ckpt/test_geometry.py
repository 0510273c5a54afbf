"""Issue 41, round 3: a commitment's header is bounded before anything proportional to it is
computed (n ≤ 255 for a GF(2⁸) code, digest sizes of the known hashes, the body's length)."""

from __future__ import annotations

import struct
import time

import pytest

from rankwise.ckpt._format import COMMITMENT, Commitment, seal


def _forged(n: int, d: int, roots: bytes = b"") -> bytes:
    names = b"".join(len(x).to_bytes(1, "little") + x for x in (b"sha256", b"cauchy-gf256"))
    return seal(COMMITMENT, struct.pack("<HHQQB", n, 1, 100, 12, d) + names + roots)


def test_a_costly_header_is_refused_at_once():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"n=65535 parties, outside \[1, 255\]"):
        Commitment.from_bytes(_forged(65535, 0))
    with pytest.raises(ValueError, match="digest size 0"):
        Commitment.from_bytes(_forged(200, 0))
    with pytest.raises(ValueError, match=r"bytes of roots where n=4 and digest size 32 need 288"):
        Commitment.from_bytes(_forged(4, 32, b"\0" * 40))
    assert time.perf_counter() - t0 < 0.05


def test_error_texts_quote_no_file_content(tmp_path):
    """Issue 41, attack 7: a fragment file linked to any readable file put that file's first
    bytes into the status a restore sends to every peer."""
    from rankwise.ckpt._format import Fragment, RepairSymbols

    secret = b"SECRETKEY=hunter2-" * 8
    for parse in (Fragment.from_bytes, RepairSymbols.from_bytes, Commitment.from_bytes):
        with pytest.raises(ValueError) as e:
            parse(secret)
        assert "SECR" not in str(e.value) and "hunter" not in str(e.value)
    names = b"".join(len(x).to_bytes(1, "little") + x for x in (b"\xffSECRET", b"cauchy-gf256"))
    blob = seal(COMMITMENT, struct.pack("<HHQQB", 4, 1, 100, 12, 32) + names + b"\0" * 288)
    with pytest.raises(ValueError, match="not ASCII") as e:
        Commitment.from_bytes(blob)
    assert "SECRET" not in str(e.value) and "xff" not in str(e.value)


def test_the_step_scan_reads_only_the_newest_folders(tmp_path, monkeypatch):
    """Issue 41, attack 3: 60 `step_*` links to a costly commitment outlasted the group timeout;
    a rank now reads at most keep + SCAN_SLACK step folders, the newest."""
    from rankwise.ckpt import Code2D, _checkpointer, _store

    com = Code2D(4, 1, hash="sha256").encode(b"x" * 1000).commitment
    for step in range(60):
        _store.write(_store.step_dir(tmp_path, 0, step) / _store.STEP_COMMITMENT, com)
    reads = []
    real = _store.read_commitment
    monkeypatch.setattr(_store, "read_commitment", lambda p, **kw: reads.append(p) or real(p, **kw))
    ck = _checkpointer.CodedCheckpointer.__new__(_checkpointer.CodedCheckpointer)
    ck.root_dir, ck.rank, ck.keep, ck.scan_seconds = tmp_path, 0, 2, 60.0
    held = ck._local_steps()
    assert len(reads) == 2 + _checkpointer.SCAN_SLACK
    assert sorted(held) == list(range(60 - len(reads), 60))


def test_the_step_scan_has_its_own_time_bound(tmp_path, monkeypatch):
    """Issue 41, item 2: the scan runs before the first collective "with its own time bound": on a
    slow disk a rank votes with the newest steps it read in time instead of missing the vote."""
    import types

    from rankwise.ckpt import Code2D, _checkpointer, _store

    com = Code2D(4, 1, hash="sha256").encode(b"x" * 1000).commitment
    for step in range(6):
        _store.write(_store.step_dir(tmp_path, 0, step) / _store.STEP_COMMITMENT, com)
    clock = [0.0]
    real = _store.read_commitment

    def slow(p, **kw):  # each read takes one second of a fake clock
        clock[0] += 1.0
        return real(p, **kw)

    monkeypatch.setattr(_store, "read_commitment", slow)
    monkeypatch.setattr(_checkpointer, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    ck = _checkpointer.CodedCheckpointer.__new__(_checkpointer.CodedCheckpointer)
    ck.root_dir, ck.rank, ck.keep, ck.scan_seconds = tmp_path, 0, 2, 2.5
    assert sorted(ck._local_steps()) == [3, 4, 5]  # the newest three, read by t = 3 > 2.5
