"""One bad location or rank out of n never runs code, never changes the restored state and never
stops a restore (CodedCheckpointer, gloo ranks in spawned processes)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

from distributed import run_world
from rankwise.ckpt import Code2D, CodedCheckpointer, Commitment, _format, read_commitment
from rankwise.ckpt._format import commitment_root
from rankwise.ckpt._merkle import get_hash
from rankwise.ckpt._serial import serialize
from rankwise.ckpt._store import read_metadata

MARKER = "pwned"  # a file the planted pickles create when (and only when) they are unpickled


class _Plant:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def _pickle(marker: str) -> bytes:
    return pickle.dumps({"state": _Plant(marker)})


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(300, 40), "step": step, "rng": torch.get_rng_state()}


def _reseal(com: Commitment, **changes) -> bytes:
    """The commitment with fields changed, re-sealed (a valid checksum) and, unless
    ``keep_root``, with its root recomputed: what an attacker with write access produces."""
    keep = changes.pop("keep_root", False)
    fields = {f: getattr(com, f) for f in ("n", "t", "data_len", "block_size", "hash", "codec", "line_roots",
                                           "version")}
    fields.update(changes)
    root = com.root if keep else commitment_root(get_hash(fields["hash"]), **fields)
    return Commitment(**{k: v for k, v in fields.items() if k != "version"}, root=root,
                      version=fields["version"]).to_bytes()


def _attacks(step_dir: Path, other_dir: Path, marker: str) -> dict[str, dict[str, bytes]]:
    """What one bad location (rank 0's disk) holds instead of its files, per attack."""
    com = read_commitment(step_dir / "commitment.rwck")
    frag = (step_dir / "fragment.rwck").read_bytes()
    other = {n: (other_dir / n).read_bytes() for n in ("commitment.rwck", "fragment.rwck")}
    planted = _pickle(marker)
    out = {
        "pickle in the commitment": {"commitment.rwck": planted},
        "pickle in the fragment": {"fragment.rwck": planted},
        "pickle sealed as a fragment": {"fragment.rwck": _format.seal(_format.FRAGMENT, planted)},
        "files of another checkpoint": other,
        "garbage": {"commitment.rwck": os.urandom(300), "fragment.rwck": os.urandom(len(frag))},
    }
    for field, value in (("data_len", com.data_len - 1), ("data_len", com.data_len + 1),
                         ("block_size", com.block_size + 1), ("t", com.t + 1), ("hash", "sha256"),
                         ("codec", "xor"), ("version", 1)):
        for keep in (True, False):
            out[f"{field}={value!r} re-sealed, root {'kept' if keep else 'recomputed'}"] = {
                "commitment.rwck": _reseal(com, **{field: value, "keep_root": keep})}
    return out


def _one_bad_location(rank: int, store: str, marker: str, t: int):
    import torch.distributed as dist

    ck = CodedCheckpointer(t=t, store_dir=store)
    ck.save(_state(2), 2)
    ck.save(_state(3), 3)
    mine = Path(store) / f"rank{rank}"
    pristine = Path(store) / f"pristine{rank}"
    shutil.copytree(mine, pristine)
    dist.barrier()
    names = list(_attacks(mine / "step_0000000003", mine / "step_0000000002", marker)) if rank == 0 else None
    box = [names]
    dist.broadcast_object_list(box, src=0)  # (the test's own plumbing, between honest test ranks)
    results = {}
    for name in box[0]:
        if rank == 0:
            for f, data in _attacks(pristine / "step_0000000003", pristine / "step_0000000002",
                                    marker)[name].items():
                (mine / "step_0000000003" / f).write_bytes(data)
        dist.barrier()
        state, step = ck.restore()
        results[name] = (step, serialize(state) == serialize(_state(3)), ck.stats()["repaired"])
        dist.barrier()
        shutil.rmtree(mine)
        shutil.copytree(pristine, mine)
        dist.barrier()
    # a checkpoint of format 1 (every rank's commitment as v1: root over the line roots only)
    path = mine / "step_0000000003" / "commitment.rwck"
    c = read_commitment(path)
    v1 = dataclasses.replace(c, version=1, root=commitment_root(
        Code2D(c.n, c.t)._h, n=c.n, t=c.t, data_len=c.data_len, block_size=c.block_size, hash=c.hash,
        codec=c.codec, line_roots=c.line_roots, version=1))
    path.write_bytes(v1.to_bytes())
    dist.barrier()
    state, step = ck.restore()
    results["format 1 checkpoint"] = (step, serialize(state) == serialize(_state(3)), ck.stats()["repaired"])
    return results


@pytest.mark.parametrize("n,t", [(4, 1), (7, 2)])
def test_one_bad_location_never_runs_code_changes_state_or_stops_a_restore(tmp_path, n, t):
    marker = str(tmp_path / MARKER)
    out = run_world(_one_bad_location, n, tmp_path, str(tmp_path / "store"), marker, t, timeout=300)
    assert not Path(marker).exists(), "a planted pickle ran"
    names = list(out[0])
    assert len(names) == 20
    for r in out:
        for name, (step, same, repaired) in r.items():
            assert step == 3 and same, (name, step, same)
            assert repaired in ([], [0]), (name, repaired)
    # a rewritten or foreign fragment is rebuilt from the peers
    assert out[1]["pickle in the fragment"][2] == [0] and out[1]["files of another checkpoint"][2] == [0]


class _LyingRank(CodedCheckpointer):
    """A bad rank: announces a 2⁴⁰-byte block in its repair symbols (in a message of the
    expected length) and sends a pickle as its copy of the commitment."""

    def __init__(self, *args, marker: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.marker = marker

    def _helper_payload(self, lines, target: int) -> list:
        size = sum(len(memoryview(p).cast("B")) for p in super()._helper_payload(lines, target))
        meta = (struct.pack("<4sHB", _format.MAGIC, _format.FRAGMENT_VERSION, _format.SYMBOLS)
                + struct.pack("<IIQBHH", self.rank, target, 1 << 40, 32, 1, 1) + bytes(64))
        msg = meta + hashlib.sha256(meta).digest() + _pickle(self.marker)  # a valid header checksum
        return [msg.ljust(size, b"\0")]

    def _commitment_copy(self, com) -> bytes:
        honest = super()._commitment_copy(com)
        return _pickle(self.marker).ljust(len(honest), b"\0")


def _lying_rank(rank: int, store: str, marker: str, liar: int, lost: int):
    import torch.distributed as dist

    cls = _LyingRank if rank == liar else CodedCheckpointer
    ck = cls(t=2, store_dir=store, **({"marker": marker} if rank == liar else {}))
    ck.save(_state(5), 5)
    dist.barrier()
    if rank == lost:
        shutil.rmtree(Path(store) / f"rank{rank}")
    dist.barrier()
    state, step = ck.restore()
    return step, serialize(state) == serialize(_state(5)), ck.stats()


def test_one_lying_rank_is_reported_and_excluded_and_runs_no_code(tmp_path):
    """n = 7, t = 2: rank 3 lost its disk; rank 0 — the lowest holder of the commitment — sends a
    pickle as its copy and, as a helper, symbols announcing a 1 TiB block. Nothing is
    unpickled or allocated from them; rank 3's report against rank 0 is recorded; the state
    restores on every rank."""
    marker = str(tmp_path / MARKER)
    out = run_world(_lying_rank, 7, tmp_path, str(tmp_path / "store"), marker, 0, 3, timeout=180)
    assert not Path(marker).exists()
    for step, same, stats in out:
        assert step == 5 and same
        assert stats["repaired"] == [3]
        # its symbols were bad, but only rank 3 saw them: reported by one rank, named by none
        # (t = 2; its rows were good, so retrieval had nothing against it)
        assert stats["reported"] == {0: [3]} and stats["bad_helpers"] == []


class _AccusingTarget(CodedCheckpointer):
    """A bad rank that claims its fragment is missing (so it is repaired) and then reports
    every helper's symbols as bad."""

    def _check_local(self, folders, step, com):
        return "missing", None, None

    def _repair_report(self, failed):
        return [r for r in range(self.n) if r != self.rank]


def _accusing_target(rank: int, store: str, n: int, t: int, liar: int):
    cls = _AccusingTarget if rank == liar else CodedCheckpointer
    ck = cls(t=t, store_dir=store)
    ck.save(_state(5), 5)
    state, step = ck.restore()
    return step, serialize(state) == serialize(_state(5)), ck.stats()


@pytest.mark.parametrize("n, t", [(4, 1), (7, 2)])
def test_a_repair_target_that_accuses_every_helper_gets_no_honest_rank_named(tmp_path, n, t):
    liar = n - 1
    out = run_world(_accusing_target, n, tmp_path, str(tmp_path / "store"), n, t, liar, timeout=180)
    honest = [r for r in range(n) if r != liar]
    for step, same, stats in out:
        assert step == 5 and same and stats["repaired"] == [liar]
        assert stats["bad_helpers"] == []  # one rank's word names nobody
        assert stats["reported"] == {h: [liar] for h in honest}  # but what it said is on record


def _v1_downgrade(rank: int, store: str, liar: int, n: int, t: int):
    import torch.distributed as dist

    ck = CodedCheckpointer(t=t, store_dir=store)
    ck.save(_state(5), 5)
    dist.barrier()
    path = Path(store) / f"rank{rank}" / "step_0000000005" / "commitment.rwck"
    v1 = read_commitment(path)
    v1 = Commitment.from_bytes(_reseal(v1, version=1))  # every rank holds format 1 (root recomputed)
    path.write_bytes(v1.to_bytes())
    if rank == liar:  # the lowest holder cuts the data short and keeps the root (v1 does not bind it),
        k = n - t  # as far as the block size still fits, so that the copy is self-consistent
        short = (v1.block_size - 1) * k * k + 1
        assert short < v1.data_len
        path.write_bytes(_reseal(v1, data_len=short, keep_root=True))
    dist.barrier()
    state, step = ck.restore()
    return step, serialize(state) == serialize(_state(5)), path.read_bytes() == v1.to_bytes()


@pytest.mark.parametrize("n, t", [(4, 1), (7, 2)])
def test_a_forged_format_1_commitment_is_outvoted_and_never_copied_to_honest_disks(tmp_path, n, t):
    out = run_world(_v1_downgrade, n, tmp_path, str(tmp_path / "store"), 0, n, t, timeout=180)
    for step, same, disk_holds_the_honest_copy in out:
        assert step == 5 and same
        assert disk_holds_the_honest_copy  # the liar's disk repaired, no honest disk rewritten


class _LyingSaver(CodedCheckpointer):
    """A bad writer: from step 6 on it sends other leaf hashes for its lines than it computed
    ("row": its whole row; "diagonal": only block P[r, r], in its row and its column alike,
    which no peer holds)."""

    def __init__(self, *args, lie: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lie, self.step_now = lie, 0

    def _save(self, state, step, extra, t0, group):
        self.step_now = step
        super()._save(state, step, extra, t0, group)

    def _leaves_sent(self, row, col):
        if self.step_now < 6:
            return row, col
        bogus = hashlib.sha256(b"bogus").digest()[:len(row[0])]
        if self.lie == "row":
            return [bogus] * len(row), col
        row, col = list(row), list(col)
        row[self.rank] = col[self.rank] = bogus
        return row, col


def _lying_saver(rank: int, store: str, liar: int, t: int, lie: str):
    cls = _LyingSaver if rank == liar else CodedCheckpointer
    ck = cls(t=t, store_dir=store, **({"lie": lie} if rank == liar else {}))
    ck.save(_state(5), 5)
    try:
        ck.save(_state(6), 6)
        error = None
    except RuntimeError as e:
        error = str(e)
    state, step = ck.restore()
    return error, step, serialize(state) == serialize(_state(step)), ck.stats()


@pytest.mark.parametrize("n, t", [(4, 1), (7, 2)])
def test_a_saver_lying_about_its_line_is_named_and_the_step_not_committed(tmp_path, n, t):
    liar = 1
    out = run_world(_lying_saver, n, tmp_path, str(tmp_path / "store"), liar, t, "row", timeout=180)
    for error, step, same, _ in out:
        assert error is not None and f"rank(s) [{liar}] sent line hashes that disagree" in error
        assert step == 5 and same  # the previous step is the newest, and restores


@pytest.mark.parametrize("n, t", [(4, 1), (7, 2)])
def test_a_saver_lying_where_no_peer_can_check_leaves_a_restorable_step(tmp_path, n, t):
    """The one block no peer hashes, P[r, r], forged in both of rank r's lines: the save
    commits, rank r's own fragment then fails its line, its rebuild fails too, and every rank
    (rank r included) restores from the k rows that verify."""
    liar = 1
    out = run_world(_lying_saver, n, tmp_path, str(tmp_path / "store"), liar, t, "diagonal", timeout=180)
    for error, step, same, stats in out:
        assert error is None and step == 6 and same
        assert stats["repaired"] == [liar]


def test_v1_commitment_still_restores_with_a_warning(caplog):
    code = Code2D(4, 1)
    data = os.urandom(5000)
    disp = code.encode(data)
    c = disp.commitment
    root = commitment_root(code._h, n=c.n, t=c.t, data_len=c.data_len, block_size=c.block_size, hash=c.hash,
                           codec=c.codec, line_roots=c.line_roots, version=1)
    v1 = Commitment(c.n, c.t, c.data_len, c.block_size, c.hash, c.codec, c.line_roots, root, version=1)
    back = Commitment.from_bytes(v1.to_bytes())
    assert back.version == 1 and back.root != c.root
    with caplog.at_level(logging.WARNING, logger="rankwise.ckpt._code2d"):
        assert code.retrieve(disp.fragments[1:], back) == data
    assert "not tamper-evident" in caplog.text


@pytest.mark.parametrize("field", ["data_len", "block_size", "t", "hash", "codec", "version"])
def test_every_header_field_is_bound_to_the_root(field):
    """Changing any field decoding uses, even by re-sealing the file, breaks the root (and
    recomputing the root gives another root, which the vote of the k honest ranks outweighs)."""
    code = Code2D(4, 1)
    c = code.encode(os.urandom(5000)).commitment
    changed = {"data_len": c.data_len - 1, "block_size": c.block_size + 1, "t": 2, "hash": "sha256",
               "codec": "xor", "version": 1}[field]
    forged = Commitment.from_bytes(_reseal(c, **{field: changed, "keep_root": True}))
    with pytest.raises(ValueError, match=r"inconsistent|this code is"):
        code._check(forged)
    recomputed = Commitment.from_bytes(_reseal(c, **{field: changed}))
    assert recomputed.root != c.root


# ---------------------------------------------------------------------- DCP storage (one bad location)
def _dcp_sd(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"a": torch.randn(6, 5), "b": torch.randn(6, 5), "step": seed}


def _dcp_fresh() -> dict:
    return {"a": torch.zeros(6, 5), "b": torch.zeros(6, 5), "step": -1}


def test_one_bad_dcp_location_never_runs_code_or_changes_the_state(tmp_path):
    import hashlib
    import json
    import warnings

    import torch.distributed.checkpoint as dcp

    from rankwise.ckpt import CodedStorageReader, CodedStorageWriter

    warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
    locs = [tmp_path / f"disk{i}" for i in range(4)]  # n = 4, t = 1
    dcp.save(_dcp_sd(1), storage_writer=CodedStorageWriter(locs, t=1))
    other = [tmp_path / f"other{i}" for i in range(4)]
    dcp.save(_dcp_sd(2), storage_writer=CodedStorageWriter(other, t=1))
    doc = json.loads(read_metadata(locs[0] / ".metadata.rwck"))
    swapped = dict(doc)  # a and b's storage entries exchanged, re-sealed: same shapes, wrong data
    entries = {e[0][0]: e for e in doc["storage_data"]}
    swapped["storage_data"] = [[entries["a"][0], entries["b"][1]], [entries["b"][0], entries["a"][1]]] + [
        e for e in doc["storage_data"] if e[0][0] not in ("a", "b")]
    body = json.dumps(swapped, sort_keys=True, separators=(",", ":")).encode()
    marker = str(tmp_path / MARKER)
    planted = _pickle(marker)
    attacks = {
        "pickled metadata (format 1)": {".metadata.rwck": b"RWDCPMD1" + hashlib.sha256(planted).digest()
                                        + planted},
        "entries swapped, re-sealed": {".metadata.rwck": _format.seal(_format.METADATA, body)},
        "metadata of another checkpoint": {".metadata.rwck": (other[0] / ".metadata.rwck").read_bytes()},
        "another checkpoint's files": {f: (other[0] / f).read_bytes() for f in
                                       (".metadata.rwck", "__0.frag.rwck", "__0.commit.rwck")},
        "pickles in the fragment and commitment": {"__0.frag.rwck": planted, "__0.commit.rwck": planted},
        "garbage": {".metadata.rwck": os.urandom(500), "__0.commit.rwck": os.urandom(400)},
    }
    pristine = {f.name: f.read_bytes() for f in locs[0].iterdir()}
    for name, files in attacks.items():
        for f, data in files.items():
            (locs[0] / f).write_bytes(data)
        got = _dcp_fresh()
        reader = CodedStorageReader(locs)
        dcp.load(got, storage_reader=reader)
        want = _dcp_sd(1)
        assert got["step"] == 1 and torch.equal(got["a"], want["a"]), name
        assert torch.equal(got["b"], want["b"]), name
        assert reader.skipped, name  # the bad location is named
        for f, data in pristine.items():
            (locs[0] / f).write_bytes(data)
    assert not Path(marker).exists()
