"""Issues 41 and 49: geometry before cost. A commitment's header is bounded before anything
proportional to it is computed (n ≤ 255 for a GF(2⁸) code, digest sizes of the known hashes, the
body's length); a fragment is sized by its commitment and its header checked before its body is
read; a rank reads a bounded number of step folders before the vote; errors quote no file
content; the checkpointer names what n is."""

from __future__ import annotations

import os
import struct
import time

import pytest

from rankwise.ckpt import Commitment, _layout, _store
from rankwise.ckpt._format import CODEC, COMMITMENT, METADATA, commitment_root, fragment_size, seal


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
    bytes into the status a restore sends to every peer. The parsers of what one rank's folder
    holds (fragment, repair symbols, commitment, sealed metadata and the metadata's JSON) name
    the problem, never the bytes."""
    from rankwise.ckpt import Fragment, RepairSymbols

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
    (tmp_path / "m").write_bytes(secret)
    (tmp_path / "sealed").write_bytes(seal(METADATA, secret))
    with pytest.raises(ValueError) as e:
        _store.read_metadata(tmp_path / "m")
    assert "SECR" not in str(e.value) and "hunter" not in str(e.value)
    for body in (_store.read_metadata(tmp_path / "sealed"), b'{"format": "SECRETKEY=hunter2"}',
                 b'{"commitment": "SECRETKEY=hunter2"}', b'{"commitment": ["SECRETKEY=hunter2"]}',
                 b"\xffSECRETKEY=hunter2", b'{"commitment": "00", "format": "SECRETKEY=hunter2"}'):
        with pytest.raises(ValueError, match="malformed") as e:
            _layout.commitment_of(body)
        assert "SECR" not in str(e.value) and "hunter" not in str(e.value), str(e.value)


def _metadata_in_steps(root, steps) -> None:
    for step in steps:
        _store.write_metadata(root / f"step_{step:010d}" / "rank0" / _layout.META, b"{}")


def _bare_checkpointer(root, keep: int = 2):
    from rankwise.ckpt import CodedCheckpointer

    ck = CodedCheckpointer.__new__(CodedCheckpointer)
    ck.root_dir, ck.rank, ck.keep, ck.scan_seconds = root, 0, keep, 60.0
    return ck


def test_the_step_scan_reads_only_the_newest_folders(tmp_path, monkeypatch):
    """Issue 41, attack 3: 60 `step_*` links to a costly commitment outlasted the group timeout;
    a rank reads at most keep + 4 step folders' metadata, the newest."""
    _metadata_in_steps(tmp_path, range(60))
    reads = []
    real = _store.read_metadata
    monkeypatch.setattr(_store, "read_metadata", lambda p, **kw: reads.append(p) or real(p, **kw))
    held = _bare_checkpointer(tmp_path)._local_steps()
    assert len(reads) == 2 + 4
    assert sorted(held) == list(range(60 - len(reads), 60))


def test_the_step_scan_has_its_own_time_bound(tmp_path, monkeypatch):
    """Issue 41, item 2: the scan runs before the first collective "with its own time bound": on a
    slow disk a rank votes with the newest steps it read in time instead of missing the vote."""
    import types

    from rankwise.ckpt import _checkpointer

    _metadata_in_steps(tmp_path, range(6))
    clock = [0.0]
    real = _store.read_metadata

    def slow(p, **kw):  # each read takes one second of a fake clock
        clock[0] += 1.0
        return real(p, **kw)

    monkeypatch.setattr(_store, "read_metadata", slow)
    monkeypatch.setattr(_checkpointer, "time", types.SimpleNamespace(monotonic=lambda: clock[0],
                                                                    perf_counter=lambda: clock[0]))
    ck = _bare_checkpointer(tmp_path)
    ck.scan_seconds = 2.5
    assert sorted(ck._local_steps()) == [3, 4, 5]  # the newest three, read by t = 3 > 2.5


def _forged_whole(block: int) -> Commitment:
    """A commitment forged whole: consistent in itself (its fields hash to its root) for a state of
    9 blocks of `block` bytes (n = 4, t = 1, k = 3), with made-up line roots."""
    from rankwise.ckpt import _merkle

    roots = tuple(bytes([i]) * 32 for i in range(8))
    fields = dict(n=4, t=1, data_len=9 * block, block_size=block, hash="sha256", codec=CODEC)
    return Commitment(**fields, line_roots=roots,
                      root=commitment_root(_merkle.get_hash("sha256"), **fields, line_roots=roots))


def test_a_fragment_is_sized_and_its_header_checked_before_its_body_is_read(tmp_path, monkeypatch):
    """Issue 49, item 5: a commitment forged whole (1 GiB blocks) let `ckpt verify` read a 1.5 GiB
    sparse fragment into memory before it found no header. Every folder's metadata holding that
    commitment (a quorum), a fragment must still have exactly its geometry's size and a header
    that fits it, both checked before any of its body is read."""
    com = _forged_whole(1 << 30)
    body = _layout.file_metadata(com.data_len, com)
    for i in range(4):
        _store.write_metadata(tmp_path / f"rank{i}" / _layout.META, body)
    with open(tmp_path / "rank0" / _layout.FRAGMENT, "wb") as f:  # sparse: costs no disk
        f.truncate(3 << 29)
    with open(tmp_path / "rank1" / _layout.FRAGMENT, "wb") as f:  # the exact size, but no header
        f.truncate(fragment_size(3 << 30))
    read = []
    real = os.readv
    monkeypatch.setattr(os, "readv", lambda fd, bufs: read.append(sum(map(len, bufs))) or real(fd, bufs))
    found = _layout.scan(tmp_path)
    sealed = (tmp_path / "rank0" / _layout.META).stat().st_size
    assert found.com == com and found.fragments == {}
    assert read and set(read) == {sealed}  # the metadata files only: no fragment's body
    assert f"1,610,612,736 bytes where {fragment_size(3 << 30):,} are expected" in found.skipped["rank0"]
    assert "no rankwise magic" in found.skipped["rank1"]
    assert all("fragment:" in found.skipped[f"rank{i}"] for i in (2, 3)), found.skipped


def test_good_fragments_read_and_a_changed_size_fails_the_header_checksum(tmp_path):
    from rankwise.ckpt import Code2D

    data = os.urandom(5000)
    disp = Code2D(4, 1, hash="sha256").encode(data)
    body = _layout.file_metadata(len(data), disp.commitment)
    for f in disp.fragments:
        _store.write_metadata(tmp_path / f"rank{f.index}" / _layout.META, body)
        (tmp_path / f"rank{f.index}" / _layout.FRAGMENT).write_bytes(f.to_bytes())
    found = _layout.scan(tmp_path)
    assert found.skipped == {} and sorted(found.fragments) == [0, 1, 2, 3]
    assert all(bytes(found.fragments[i].row) == bytes(disp.fragments[i].row) for i in range(4))
    path = tmp_path / "rank1" / _layout.FRAGMENT
    header = bytearray(path.read_bytes())
    header[10] ^= 1  # a size byte: the header checksum catches it before the body
    path.write_bytes(bytes(header))
    assert "header checksum" in _layout.scan(tmp_path).skipped["rank1"]


def test_coded_checkpointer_says_n_is_the_world_size(tmp_path):
    """Issue 41's newcomer round: a checkpointer on too few ranks says that n is the world size."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"on 1 rank\(s\) \(n is the world size: one party per rank\)"):
            CodedCheckpointer(t=1, store_dir=tmp_path / "store")
    finally:
        dist.destroy_process_group()
