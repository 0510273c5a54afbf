"""The 2-D code against brute-force references: GF(2^8), generator, erasure patterns, repair."""

import dataclasses
import itertools
import os
import random

import numpy as np
import pytest

from rankwise.ckpt import (
    Code2D,
    NotEnoughSymbols,
    RepairSymbols,
    _backends,
    _gf,
    read_commitment,
    read_fragment,
)
from rankwise.ckpt._store import write


def _slow_mul(a: int, b: int) -> int:
    """Carry-less multiply reduced by x⁸+x⁴+x³+x²+1, bit by bit (an independent oracle)."""
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
        b >>= 1
    return r


def test_gf_tables_match_bitwise_multiplication():
    for a in range(256):
        for b in range(0, 256, 7):
            assert int(_gf.MUL[a, b]) == _slow_mul(a, b)
    for a in range(1, 256):
        assert _slow_mul(a, int(_gf.INV[a])) == 1


def test_generator_is_systematic_cauchy_and_mds():
    n, k = 9, 6
    G = _gf.cauchy_generator(n, k)
    assert (G[:k] == np.eye(k, dtype=np.uint8)).all()
    for i in range(k, n):
        for j in range(k):
            assert _slow_mul(int(G[i, j]), i ^ j) == 1  # 1 / (i xor j), as ISA-L's cauchy1
    for rows in itertools.combinations(range(n), k):  # every k×k submatrix is invertible
        A = G[list(rows)]
        assert (_gf.matmul(A, _gf.inverse(A)) == np.eye(k, dtype=np.uint8)).all()


def _repair_from(code, disp, target, helpers):
    syms = [code.helper_symbols(disp.fragments[j], target) for j in helpers]
    return code.repair(target, syms, disp.commitment), syms


@pytest.mark.parametrize("n,t", [(4, 1), (7, 2), (10, 3)])
def test_every_erasure_pattern_retrieves_and_repairs(n, t):
    code = Code2D(n, t)
    k = n - t
    data = random.Random(n).randbytes(k * k * 3 + 5)
    disp = code.encode(data)
    for lost in range(t + 1):
        for gone in itertools.combinations(range(n), lost):
            alive = [f for f in disp.fragments if f.index not in gone]
            assert code.retrieve(alive, disp.commitment) == data
            for target in gone:
                helpers = [f.index for f in alive]
                frag, syms = _repair_from(code, disp, target, helpers)
                assert frag == disp.fragments[target]
                assert all(s.nbytes == 2 * disp.commitment.block_size for s in syms)


@pytest.mark.parametrize("n,t", [(16, 5), (31, 10), (64, 21)])
def test_random_erasures_large_n(n, t):
    code = Code2D(n, t)
    rng = random.Random(n)
    data = rng.randbytes(5000)
    disp = code.encode(data)
    for _ in range(3):
        gone = rng.sample(range(n), t)
        alive = [f for f in disp.fragments if f.index not in gone]
        assert code.retrieve(alive, disp.commitment) == data
        target = gone[0]
        frag, _ = _repair_from(code, disp, target, rng.sample([f.index for f in alive], n - t))
        assert frag == disp.fragments[target]


@pytest.mark.parametrize("size_of", [lambda k: 0, lambda k: 1, lambda k: k * k - 1, lambda k: k * k + 1])
def test_edge_sizes(size_of):
    code = Code2D(5, 1)
    data = bytes(range(256)) * 2
    data = data[: size_of(code.k)]
    disp = code.encode(data)
    assert code.retrieve(disp.fragments[1:], disp.commitment) == data
    frag, _ = _repair_from(code, disp, 0, range(1, 5))
    assert frag == disp.fragments[0]


def test_lying_helpers_are_excluded_and_named():
    n, t = 10, 3
    code = Code2D(n, t)
    data = random.Random(1).randbytes(2000)
    disp = code.encode(data)
    target, liars = 4, [0, 7]  # t − 1 liars
    syms = []
    for f in disp.fragments:
        if f.index == target:
            continue
        s = code.helper_symbols(f, target)
        if f.index in liars:
            bad = bytearray(s.col_block)
            bad[0] ^= 1
            s = RepairSymbols(s.helper, s.target, bytes(bad), s.col_path, s.row_block, s.row_path)
        syms.append(s)
    assert code.repair(target, syms, disp.commitment) == disp.fragments[target]
    assert code.verified_symbols(target, syms, disp.commitment)[1] == liars
    honest = [s for s in syms if s.helper not in liars][: code.k - 1]
    with pytest.raises(NotEnoughSymbols, match="needs 7 verified symbols") as e:
        code.repair(target, honest + [s for s in syms if s.helper in liars], disp.commitment)
    assert e.value.bad_helpers == liars and e.value.have == code.k - 1


def test_bit_flips_in_stored_fragments_are_detected():
    code = Code2D(7, 2)
    data = random.Random(2).randbytes(777)
    disp = code.encode(data)
    for i, f in enumerate(disp.fragments):
        assert code.verify(f, disp.commitment)
        for field in ("row", "col"):
            buf = bytearray(getattr(f, field))
            buf[i % len(buf)] ^= 0x10
            bad = dataclasses.replace(f, **{field: bytes(buf)})
            assert not code.verify(bad, disp.commitment)
    bad0 = type(disp.fragments[0])(0, bytes(len(disp.fragments[0].row)), disp.fragments[0].col)
    assert code.retrieve([bad0, *disp.fragments[1:]], disp.commitment) == data  # skipped
    with pytest.raises(NotEnoughSymbols, match="retrieve needs 5 verified fragments; got 4"):
        code.retrieve([bad0, *disp.fragments[1:5]], disp.commitment)


def test_bad_arguments():
    with pytest.raises(ValueError, match="3t < n"):
        Code2D(3, 1)
    with pytest.raises(ValueError, match="hash"):
        Code2D(4, 1, hash="md5")
    code = Code2D(4, 1)
    disp = Code2D(5, 1).encode(b"abc")
    with pytest.raises(ValueError, match="commitment is for n=5"):
        code.retrieve(disp.fragments, disp.commitment)


def test_binary_format_round_trips_and_rejects_damage(tmp_path):
    from rankwise.ckpt import Commitment, Fragment

    code = Code2D(7, 2, hash="sha256")
    disp = code.encode(random.Random(3).randbytes(999))
    f, c = disp.fragments[5], disp.commitment
    assert Fragment.from_bytes(f.to_bytes()) == f and Commitment.from_bytes(c.to_bytes()) == c
    write(tmp_path / "f5", f)
    write(tmp_path / "com", c)
    assert read_fragment(tmp_path / "f5") == f and read_commitment(tmp_path / "com") == c
    assert sorted(p.name for p in tmp_path.iterdir()) == ["com", "f5"]  # no temporary files left
    blob = f.to_bytes()
    for cut in (0, 5, len(blob) // 2, len(blob) - 1):
        with pytest.raises(ValueError, match=r"fragment: (truncated|\d+ bytes where the header says)"):
            Fragment.from_bytes(blob[:cut])
    with pytest.raises(ValueError, match="header says"):
        Fragment.from_bytes(blob + b"\0")
    head = 7 + 20 + 32  # magic, version, kind; index and sizes; their checksum
    for pos in (0, 7, 40, head - 1):  # the header is checksummed
        bad = bytearray(blob)
        bad[pos] ^= 0xFF
        with pytest.raises(ValueError, match="fragment"):
            Fragment.from_bytes(bytes(bad))
    for pos in (head, len(blob) - 3):  # the body is checked against the commitment's Merkle roots
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        assert code.verify(f, c) and not code.verify(Fragment.from_bytes(bytes(bad)), c)
    with pytest.raises(ValueError, match="expected 1"):
        Fragment.from_bytes(c.to_bytes())


def _v2_file(f) -> bytes:
    """A fragment file of version 2 (a development format, never released): header, sizes, row,
    column and a SHA-256 of all of it."""
    import hashlib
    import struct

    body = (struct.pack("<4sHB", b"RWCK", 2, 1) + struct.pack("<IQQ", f.index, len(f.row), len(f.col))
            + bytes(f.row) + bytes(f.col))
    return body + hashlib.sha256(body).digest()


def test_a_fragment_file_of_another_version_is_refused_naming_it():
    from rankwise.ckpt import Fragment

    f = Code2D(4, 1).encode(random.Random(4).randbytes(3000)).fragments[2]
    with pytest.raises(ValueError, match="format version 2, this rankwise reads 3"):
        Fragment.from_bytes(_v2_file(f))


def test_a_read_fragment_is_a_view_of_the_file_bytes():
    """No copy of the row and column when a fragment file is read."""
    from rankwise.ckpt import Fragment

    f = Code2D(4, 1).encode(random.Random(6).randbytes(30_000)).fragments[1]
    blob = f.to_bytes()
    g = Fragment.from_bytes(blob)
    assert g == f and g.row.obj is blob and g.col.obj is blob


def _naive_repairable(n: int, t: int) -> int:
    """The seed's literal layout: worker i < k stores M[i, :] and M[:, i] raw; the t extra
    workers duplicate the assignments of workers 0..t−1. A worker is repairable iff every block
    it holds is also held by someone else."""
    k = n - t
    holds = [{(i, b) for b in range(k)} | {(a, i) for a in range(k)} for i in range(k)]
    holds += [holds[d] for d in range(t)]
    return sum(all(any(blk in holds[w] for w in range(n) if w != v) for blk in holds[v])
               for v in range(n))


def test_naive_layout_repairs_only_2t_workers_as_the_seed_found():
    found = {n: _naive_repairable(n, (n - 1) // 3) for n in (4, 8, 16, 32, 64)}
    assert found == {4: 2, 8: 4, 16: 10, 32: 20, 64: 42}  # the seed's 2/4 … 42/64


@pytest.mark.skipif(not _backends.isal_available(), reason="ISA-L (libisal2) not installed")
def test_backends_are_byte_identical():
    from rankwise.ckpt import _isal

    assert (_isal.cauchy_generator(12, 8) == _gf.cauchy_generator(12, 8)).all()
    rng = np.random.default_rng(0)
    for L in (1, 2, 15, 33, 4097):
        A = rng.integers(0, 256, (5, 7), dtype=np.uint8)
        X = rng.integers(0, 256, (7, L), dtype=np.uint8)
        assert (_isal.matmul(A, X) == _gf.matmul(A, X)).all()
    data = random.Random(9).randbytes(12345)
    a, b = Code2D(10, 3, backend="numpy"), Code2D(10, 3, backend="isal")
    da, db = a.encode(data), b.encode(data)
    assert da == db
    syms = [b.helper_symbols(f, 2) for f in db.fragments if f.index != 2]
    assert a.repair(2, syms, da.commitment) == b.repair(2, syms, db.commitment) == da.fragments[2]


def test_64_mib_blob_round_trip():
    code = Code2D(4, 1)  # ISA-L when installed
    data = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    disp = code.encode(data)
    assert code.retrieve(disp.fragments[1:], disp.commitment) == data
    syms = [code.helper_symbols(f, 3) for f in disp.fragments[:3]]
    assert code.repair(3, syms, disp.commitment) == disp.fragments[3]


@pytest.mark.parametrize("backend", ["numpy", "auto"])
def test_encode_share_equals_encode(backend):
    """Each worker's own share and line roots, assembled, give encode()'s bytes exactly."""
    code = Code2D(7, 2, backend=backend)
    data = bytes(range(256)) * 37 + b"tail"
    full = code.encode(data)
    shares = [code.encode_share(data, i) for i in range(7)]
    assert [s[0] for s in shares] == full.fragments
    com = code.commitment_from_roots(len(data), [s[1] for s in shares], [s[2] for s in shares])
    assert com == full.commitment
    with pytest.raises(ValueError, match="index"):
        code.encode_share(data, 7)


def test_retrieve_rows_skips_and_names_bad_rows():
    code = Code2D(5, 1, backend="numpy")
    data = bytes(random.Random(3).randbytes(1000))
    disp = code.encode(data)
    rows = {f.index: f.row for f in disp.fragments}
    assert code.retrieve_rows(rows, disp.commitment) == data
    assert code.verified_rows(rows, disp.commitment)[1] == []
    rows[1] = bytes([rows[1][0] ^ 1]) + rows[1][1:]
    assert code.retrieve_rows(rows, disp.commitment) == data
    assert code.verified_rows(rows, disp.commitment)[1] == [1]
    del rows[4]
    with pytest.raises(NotEnoughSymbols, match="needs 4 verified rows; got 3"):
        code.retrieve_rows(rows, disp.commitment)


# digests of every fragment and commitment written by the previous encoder (format 2, before
# the zero-copy grid), for the same inputs: the new encoder must give the same bytes
_GOLDEN = {
    (4, 1, 0, "numpy"): "85a2803dde770cf1a5a12acce0a2b59d972c46bac3f407979d81e48807d12282",
    (4, 1, 1, "numpy"): "e3ea7c265d03a2dad835f98b317158c3610e5646ce09f063ce6540a9414a9d6f",
    (4, 1, 5000, "numpy"): "75789d48804b2a2e3b9fcaf317a1ca8ebf866f80cb8c5ee9c8a3c90f75f3b7e9",
    (7, 2, 12345, "numpy"): "15f8d012a151935f03828f032c95416c14266f913843ec022f2bc61fc088b10d",
    (10, 3, 100_003, "isal"): "aec94db65072388f74396dffb851d23c731fcd27a3f3c078280fa6e900624fe6",
    (10, 3, 100_003, "numpy"): "aec94db65072388f74396dffb851d23c731fcd27a3f3c078280fa6e900624fe6",
    (31, 10, 77_777, "isal"): "b7769a4e70d224ed98302474ac84c0da019105b890f4d9093230f9892b7b6078",
}


@pytest.mark.parametrize("case", list(_GOLDEN))
def test_encoder_gives_the_previous_encoders_bytes(case):
    import hashlib

    n, t, size, backend = case
    if backend == "isal" and not _backends.isal_available():
        pytest.skip("ISA-L not installed")
    d = Code2D(n, t, backend=backend).encode(random.Random(size + n).randbytes(size))
    files = b"".join(_v2_file(f) for f in d.fragments)  # the format the digests were taken in
    got = hashlib.sha256(files + d.commitment.to_bytes()).hexdigest()
    assert got == _GOLDEN[case]
    for i, f in enumerate(d.fragments):  # and each agrees with the per-worker encoder
        assert Code2D(n, t, backend=backend).encode_share(random.Random(size + n).randbytes(size), i)[0] == f


def test_fragment_rows_are_views_of_one_grid():
    """No copy of fragment rows on the encode path: row i + 1 starts n·B bytes after row i."""
    code = Code2D(7, 2, backend="numpy")
    d = code.encode(random.Random(9).randbytes(50_000))
    B = d.commitment.block_size
    addr = [np.frombuffer(f.row, dtype=np.uint8).ctypes.data for f in d.fragments]
    assert all(b - a == 7 * B for a, b in itertools.pairwise(addr))
    grid = d.fragments[0].row.obj.base  # the (n, n, B) grid every row is a view of
    assert grid.shape == (7, 7, B) and all(np.shares_memory(grid, f.row.obj) for f in d.fragments)


def test_encode_share_into_a_reused_buffer():
    code = Code2D(7, 2, backend="numpy")
    a, b = random.Random(1).randbytes(40_000), random.Random(2).randbytes(39_990)  # the same block size
    buf = code.share_buffer(len(a))
    assert code.share_buffer(len(b), buf) is buf and code.share_buffer(10, buf) is not buf
    for i in (0, 6):
        for data in (a, b):
            frag, r, c = code.encode_share(data, i, out=buf)
            assert (frag, r, c) == code.encode_share(data, i)
            assert np.shares_memory(np.frombuffer(frag.row, np.uint8), buf)
    with pytest.raises(ValueError, match="shape"):
        code.encode_share(a, 0, out=np.empty((2, 7, 3), np.uint8))
    strided = np.empty((2, 7, 2 * buf.shape[2]), np.uint8)[..., ::2]  # the right shape, not contiguous
    with pytest.raises(ValueError, match="not contiguous"):
        code.encode_share(a, 0, out=strided)


def test_repair_symbols_wire_form_round_trips_without_copying_the_blocks():
    from rankwise.ckpt import Fragment, RepairSymbols

    code = Code2D(7, 2)
    d = code.encode(random.Random(8).randbytes(20_000))
    sym = code.helper_symbols(d.fragments[4], 1)
    wire = bytearray(sym.to_bytes())
    assert len(wire) == code.symbols_size(1, d.commitment.block_size) == sym.wire_bytes
    with pytest.raises(ValueError, match="expected 1"):  # a version-3 file of another kind
        Fragment.from_bytes(bytes(wire))
    got = RepairSymbols.from_bytes(wire)
    assert got == sym and got.col_block.obj is wire and got.row_block.obj is wire
    for pos in (0, 9, len(wire) - 2 * len(sym.col_block) - 1):  # header, sizes, the header's checksum
        bad = bytearray(wire)
        bad[pos] ^= 1
        with pytest.raises(ValueError, match="repair symbols"):
            RepairSymbols.from_bytes(bad)
    with pytest.raises(ValueError, match="header says"):
        RepairSymbols.from_bytes(wire[:-1])
    bad = bytearray(wire)
    bad[-1] ^= 1  # a block: caught by its Merkle path, and the helper named
    good, failed = code.verified_symbols(1, [RepairSymbols.from_bytes(bad)], d.commitment)
    assert not good and failed == [4]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="the encoder uses no pool on one core")
def test_encode_in_a_forked_child_after_the_parent_encoded():
    """The encoder's thread pool is per process: a child forked after an encode must not wait
    on the parent's threads."""
    import multiprocessing as mp

    data = random.Random(11).randbytes(100_000)
    want = Code2D(7, 2).encode(data).commitment.root  # the parent's pool exists now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_encode_root, (data,)).get(timeout=60)
    assert got == want


def _encode_root(data: bytes) -> bytes:
    return Code2D(7, 2).encode(data).commitment.root


def test_shares_leaves_cross_check_and_give_encodes_commitment():
    code = Code2D(7, 2)
    data = random.Random(11).randbytes(9_999)
    shares = [code.encode_share_leaves(data, i) for i in range(7)]
    rows, cols = [s[1] for s in shares], [s[2] for s in shares]
    assert code.crossing_mismatches(rows, cols) == []
    assert code.commitment_from_leaves(len(data), rows, cols) == code.encode(data).commitment  # the reference
    rows[3] = list(rows[3])
    rows[3][5] = bytes(len(rows[3][5]))  # worker 3's row disagrees with worker 5's column about P[3, 5]
    assert code.crossing_mismatches(rows, cols) == [(3, 5)]
