"""`rankwise ckpt` end to end on the one coded layout (``PATH/rank{i}/fragment.rwck`` and
``.metadata.rwck``): encode, lose and corrupt workers, verify, repair, retrieve, inspect."""

import random
from pathlib import Path

from helpers import run_cli
from rankwise.ckpt import _layout, _store
from rankwise.ckpt._format import METADATA, commitment_root, seal
from rankwise.ckpt._layout import FRAGMENT, META, file_metadata, scan
from rankwise.ckpt._merkle import get_hash
from rankwise.ckpt._store import read_metadata

PARTY = sorted([FRAGMENT, META])


def _encode(tmp_path: Path, data: bytes, n: int = 4, t: int = 1, folder: Path | None = None):
    (tmp_path / "ck.bin").write_bytes(data)
    folder = folder or tmp_path / "d"
    r = run_cli("ckpt", "encode", tmp_path / "ck.bin", "--n", n, "--t", t, "--out", folder)
    assert r.exit_code == 0, r
    return folder, r.output.split("commitment root ")[1].split(" ")[0]


def _metadata(folder: Path, n: int, com, data_len: int) -> None:
    """Every worker's metadata replaced by one that holds `com` (what a writer of the folder does)."""
    for i in range(n):
        (folder / f"rank{i}" / META).write_bytes(seal(METADATA, file_metadata(data_len, com)))


def _resealed(com, *, keep_root: bool, **changes):
    """The commitment with fields changed and its root kept or recomputed (a forger's)."""
    from rankwise.ckpt import Commitment

    fields = {f: getattr(com, f) for f in ("n", "t", "data_len", "block_size", "hash", "codec", "line_roots",
                                           "version")}
    fields.update(changes)
    root = com.root if keep_root else commitment_root(get_hash(fields["hash"]), **fields)
    return Commitment(**{k: v for k, v in fields.items() if k != "version"}, root=root,
                      version=fields["version"])


def _commitment(folder: Path):
    return scan(folder, fragments=False).com


def test_encode_lose_repair_retrieve(tmp_path):
    data = random.Random(5).randbytes(50_000)
    folder, _ = _encode(tmp_path, data, n=7, t=2)
    assert sorted(p.name for p in folder.iterdir()) == [f"rank{i}" for i in range(7)]
    for i in range(7):
        assert sorted(p.name for p in (folder / f"rank{i}").iterdir()) == PARTY
    for f in (folder / "rank6").iterdir():  # a lost parity worker: its folder is gone
        f.unlink()
    (folder / "rank6").rmdir()
    blob = bytearray((folder / "rank1" / FRAGMENT).read_bytes())
    blob[100] ^= 1  # a corrupted systematic worker (a byte of its row)
    (folder / "rank1" / FRAGMENT).write_bytes(bytes(blob))
    r = run_cli("ckpt", "verify", folder)
    assert r.exit_code == 1 and "missing (no rank6 folder)" in r.output, r
    assert "does not match the commitment" in r.output
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "early.bin")  # the bad one is skipped
    assert r.exit_code == 0 and (tmp_path / "early.bin").read_bytes() == data, r
    assert "left out workers [1, 6]" in r.output
    for w in (6, 1):
        r = run_cli("ckpt", "repair", folder, "--worker", w)
        assert r.exit_code == 0, r
        assert "read 20,000 payload bytes" in r.output  # 2·k·B = 2·5·2000
    assert sorted(p.name for p in (folder / "rank6").iterdir()) == PARTY
    assert run_cli("ckpt", "verify", folder).exit_code == 0
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "out.bin")
    assert r.exit_code == 0 and (tmp_path / "out.bin").read_bytes() == data


def test_a_lost_fragment_or_metadata_is_reported_and_repaired(tmp_path):
    """A worker whose fragment file is gone is missing; one whose metadata is gone lost its vote
    (verify says so, exit 1) and `repair` rewrites the metadata alone."""
    data = random.Random(3).randbytes(9_000)
    folder, _ = _encode(tmp_path, data)
    (folder / "rank2" / FRAGMENT).unlink()
    (folder / "rank3" / META).unlink()
    r = run_cli("ckpt", "verify", folder)
    assert r.exit_code == 1 and "missing (no fragment.rwck)" in r.output, r
    assert "fragment ok; metadata: No such file or directory" in r.output
    frag = (folder / "rank3" / FRAGMENT).stat().st_mtime_ns
    r = run_cli("ckpt", "repair", folder, "--worker", 3)
    assert r.exit_code == 0 and "rewrote its metadata" in r.output, r
    assert (folder / "rank3" / FRAGMENT).stat().st_mtime_ns == frag  # the valid fragment stays
    assert (folder / "rank3" / META).read_bytes() == (folder / "rank0" / META).read_bytes()
    assert run_cli("ckpt", "repair", folder, "--worker", 2).exit_code == 0
    assert run_cli("ckpt", "verify", folder).exit_code == 0
    r = run_cli("ckpt", "repair", folder, "--worker", 2, "--force")  # --force rebuilds a valid one
    assert r.exit_code == 0 and "rebuilt worker 2" in r.output, r


def test_clear_errors(tmp_path):
    (tmp_path / "x").write_bytes(b"abc")
    r = run_cli("ckpt", "encode", tmp_path / "x", "--n", 3, "--t", 1, "--out", tmp_path)
    assert r.exit_code == 2 and "3t < n" in r.output
    r = run_cli("ckpt", "verify", tmp_path)
    assert r.exit_code == 1 and "no rank{i} folders in" in r.output


def test_rewritten_or_forged_commitment_is_refused(tmp_path):
    """A header field rewritten in every worker's metadata (root kept) is refused in one line; a
    commitment forged whole (root recomputed) is refused by `--root` with the root `encode` printed."""
    data = random.Random(6).randbytes(10_001)  # data_len − 1 keeps the block size (⌈·/9⌉ = 1112)
    folder, root = _encode(tmp_path, data)
    com = _commitment(folder)
    assert root == com.root.hex()
    pristine = (folder / "rank0" / META).read_bytes()
    _metadata(folder, 4, _resealed(com, keep_root=True, data_len=com.data_len - 1), com.data_len - 1)
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "a.bin")
    assert r.exit_code == 1 and "do not hash to its root" in r.stderr and not (tmp_path / "a.bin").exists()
    forged = _resealed(com, keep_root=False, data_len=com.data_len - 1)
    _metadata(folder, 4, forged, com.data_len - 1)
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "b.bin", "--root", root)
    assert r.exit_code == 1 and "not the --root given" in r.stderr and not (tmp_path / "b.bin").exists()
    for command in (("verify",), ("inspect",), ("repair", "--worker", "1")):  # issue 49: --root for all
        r = run_cli("ckpt", *command, folder, "--root", root)
        assert r.exit_code == 1 and "not the --root given" in r.stderr, (command, r.stderr)
    r = run_cli("ckpt", "verify", folder, "--root", "12")
    assert r.exit_code == 2 and "64 hex digits" in r.stderr, r.stderr
    for i in range(4):
        (folder / f"rank{i}" / META).write_bytes(pristine)
    assert run_cli("ckpt", "verify", folder, "--root", root).exit_code == 0
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "c.bin", "--root", root)
    assert r.exit_code == 0 and (tmp_path / "c.bin").read_bytes() == data


def test_malformed_metadata_held_by_a_quorum_is_refused_in_one_line(tmp_path):
    """Sealed, with a valid commitment, but its storage_data entries malformed."""
    import json

    folder, _ = _encode(tmp_path, random.Random(8).randbytes(5_000))
    doc = json.loads(read_metadata(folder / "rank0" / META))
    for bad in ([[1]], [["file", None], 7]):
        doc["storage_data"] = bad
        for i in range(4):
            (folder / f"rank{i}" / META).write_bytes(seal(METADATA, json.dumps(doc).encode()))
        for command in (("verify",), ("inspect",), ("repair", "--worker", 0)):
            r = run_cli("ckpt", command[0], folder, *command[1:])
            assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "internal error" not in r.stderr, r


def test_a_format_1_commitment_is_refused(tmp_path):
    """A format-1 commitment's root binds no header field (the data cut short goes unnoticed);
    the coded layout is never written with one, so one found there is refused in one line."""
    data = random.Random(9).randbytes(20_000)
    folder, _ = _encode(tmp_path, data)
    com = _commitment(folder)
    v1 = _resealed(com, keep_root=False, version=1)
    short = (v1.block_size - 1) * 9 + 1  # the attack: data cut short, root kept
    _metadata(folder, 4, _resealed(v1, keep_root=True, data_len=short), short)
    for args in (("verify",), ("inspect",), ("retrieve", "--out", tmp_path / "out.bin"),
                 ("repair", "--worker", 1)):
        r = run_cli("ckpt", args[0], folder, *args[1:])
        assert r.exit_code == 1 and "format version 1" in r.stderr and r.stderr.count("\n") == 1, r
    assert not (tmp_path / "out.bin").exists()


def test_without_a_quorum_or_a_checkpoint_nothing_is_read_and_torch_is_never_imported(tmp_path):
    """An empty folder, or one where no metadata has a quorum, is refused in one line by every
    command; and no command (encode, verify, inspect, repair, retrieve) imports torch."""
    import subprocess
    import sys

    empty, broken, good = tmp_path / "empty", tmp_path / "broken", tmp_path / "good"
    empty.mkdir()
    folder, _ = _encode(tmp_path, random.Random(1).randbytes(7_000), folder=broken)
    for i in (0, 1):  # 2 of 4 agree: fewer than the 3 a quorum needs
        (folder / f"rank{i}" / META).write_bytes(b"not metadata")
    (tmp_path / "ck.bin").write_bytes(random.Random(2).randbytes(7_000))
    code = (
        "import sys; from rankwise.cli import main\n"
        "t, ck, out = sys.argv[1], sys.argv[2], sys.argv[3]\n"
        "no = [main(['ckpt', *c.split(), t + '/' + f]) for f in ('empty', 'broken') for c in "
        "('verify', 'inspect', 'repair --worker 0', 'retrieve --out ' + t + '/x.bin')]\n"
        "ok = [main(['ckpt', *c.split()]) for c in ('encode ' + ck + ' --n 4 --t 1 --out ' + out, "
        "'verify ' + out, 'inspect ' + out, 'repair ' + out + ' --worker 1 --force', "
        "'retrieve ' + out + ' --out ' + t + '/back.bin')]\n"
        "print('RESULT', no, ok, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tmp_path / "ck.bin"), str(good)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"RESULT {[1] * 8} {[0] * 5} False", r.stdout
    assert r.stderr.count(f"no rank{{i}} folders in {empty}") == 4, r.stderr
    assert r.stderr.count(f"no coded checkpoint in {broken}: no metadata that a quorum") == 4, r.stderr
    assert len(r.stderr.strip().splitlines()) == 8 and "Traceback" not in r.stderr
    assert list(empty.iterdir()) == [] and not (tmp_path / "x.bin").exists()
    assert (tmp_path / "back.bin").read_bytes() == (tmp_path / "ck.bin").read_bytes()


def test_retrieve_compares_the_pinned_root_before_reading_any_fragment(tmp_path, monkeypatch):
    """Issue 41, attack 5: a forged commitment with large worker files was refused only after
    every worker file was read and verified."""
    from rankwise.ckpt import Code2D

    folder, _ = _encode(tmp_path, random.Random(7).randbytes(5_000))

    def no_reads(*a, **k):
        raise AssertionError("a fragment was read")

    monkeypatch.setattr(_store, "read_fragment", no_reads)
    monkeypatch.setattr(Code2D, "verify", no_reads)
    r = run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "a.bin", "--root", "ab" * 32)
    assert r.exit_code == 1 and "not the --root given" in r.stderr, r


def test_a_dcp_checkpoint_folder_is_verified_repaired_and_retrieved(tmp_path):
    """`dcp.save` with CodedStorageWriter writes the same layout: the commands read it as they
    read one of `encode`, and `retrieve` writes the checkpoint's raw bytes."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from rankwise.ckpt import CodedStorageReader, CodedStorageWriter

    ck = tmp_path / "ck"
    sd = {"w": torch.arange(5000.0), "b": torch.ones(7)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=CodedStorageWriter(ck, t=1, n=4))
    r = run_cli("ckpt", "inspect", ck)
    assert r.exit_code == 0 and "metadata: 2 entries (dcp.save with CodedStorageWriter)" in r.output, r
    assert "problems: none" in r.output and "matching the commitment: [0, 1, 2, 3]" in r.output
    for f in (ck / "rank2").iterdir():
        f.unlink()
    (ck / "rank2").rmdir()  # rank 2 lost its folder
    r = run_cli("ckpt", "verify", ck)
    assert r.exit_code == 1 and "missing" in r.output, r
    r = run_cli("ckpt", "repair", ck, "--worker", 2)
    assert r.exit_code == 0, r
    assert sorted(p.name for p in (ck / "rank2").iterdir()) == PARTY
    assert run_cli("ckpt", "verify", ck).exit_code == 0
    r = run_cli("ckpt", "retrieve", ck, "--out", tmp_path / "blob")
    assert r.exit_code == 0, r
    assert (tmp_path / "blob").stat().st_size == _commitment(ck).data_len
    got = {"w": torch.zeros(5000), "b": torch.zeros(7)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=CodedStorageReader(ck))
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"])


def test_repair_into_a_rank_folder_it_cannot_write_is_one_line(tmp_path):
    """The worker's rank folder is a file, or a symbolic link: the repair names it and exits 1
    (no internal error), and writes nothing through the link."""
    folder, _ = _encode(tmp_path, random.Random(4).randbytes(6_000))
    lost = folder / "rank2"
    for f in lost.iterdir():
        f.unlink()
    lost.rmdir()
    lost.write_text("not a folder")
    r = run_cli("ckpt", "repair", folder, "--worker", 2)
    assert r.exit_code == 1 and "internal error" not in r.stderr, r.stderr
    assert "cannot write worker 2's fragment" in r.stderr and "is not a folder" in r.stderr
    assert lost.read_text() == "not a folder"
    lost.unlink()
    (tmp_path / "elsewhere").mkdir()
    lost.symlink_to(tmp_path / "elsewhere")
    r = run_cli("ckpt", "repair", folder, "--worker", 2)
    assert r.exit_code == 1 and "symbolic link" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_encode_force_drops_the_old_metadata_first_and_only_our_stale_folders(tmp_path, monkeypatch):
    """--force over a 7-worker checkpoint with a 4-worker one: stale rank4…6 holding only a fragment
    and metadata go, one holding a user's file stays (less its metadata); an encode interrupted
    after two workers leaves no checkpoint that looks complete (no quorum)."""
    folder, _ = _encode(tmp_path, random.Random(5).randbytes(30_000), n=7, t=2)
    (folder / "rank5" / "notes.txt").write_text("mine")
    (folder / "notes.txt").write_text("mine too")
    (tmp_path / "new.bin").write_bytes(new := random.Random(6).randbytes(8_000))
    real, calls = _layout.write_party, []

    def interrupted(fd, frag, body):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(frag.index)
        real(fd, frag, body)

    monkeypatch.setattr(_layout, "write_party", interrupted)
    r = run_cli("ckpt", "encode", tmp_path / "new.bin", "--n", 4, "--t", 1, "--out", folder, "--force")
    assert r.exit_code != 0 and calls == [0, 1]
    monkeypatch.setattr(_layout, "write_party", real)
    r = run_cli("ckpt", "verify", folder)
    assert r.exit_code == 1 and "no coded checkpoint in" in r.stderr, r
    r = run_cli("ckpt", "encode", tmp_path / "new.bin", "--n", 4, "--t", 1, "--out", folder, "--force")
    assert r.exit_code == 0 and "removed the stale rank4, rank6" in r.output, r
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", *(f"rank{i}" for i in (0, 1, 2, 3, 5))]
    assert sorted(p.name for p in (folder / "rank5").iterdir()) == [FRAGMENT, "notes.txt"]
    r = run_cli("ckpt", "verify", folder)
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "rank5 (" in text and "party 5 of a checkpoint of 4)" in text, r
    assert run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "back.bin").exit_code == 0
    assert (tmp_path / "back.bin").read_bytes() == new


def test_encode_refuses_part_of_a_checkpoint_without_force(tmp_path):
    """A rank folder holding a fragment but no metadata (an interrupted run's, or the user's) is
    not overwritten without --force; --force replaces it."""
    (tmp_path / "ck.bin").write_bytes(data := random.Random(10).randbytes(5_000))
    folder = tmp_path / "d"
    (folder / "rank1").mkdir(parents=True)
    (folder / "rank1" / FRAGMENT).write_bytes(b"mine")
    args = ("ckpt", "encode", tmp_path / "ck.bin", "--n", 4, "--t", 1, "--out", folder)
    r = run_cli(*args)
    assert r.exit_code == 1 and "rank1/fragment.rwck" in r.stderr and "--force" in r.stderr, r
    assert sorted(p.name for p in folder.iterdir()) == ["rank1"]
    assert (folder / "rank1" / FRAGMENT).read_bytes() == b"mine"
    assert run_cli(*args, "--force").exit_code == 0
    assert run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "back.bin").exit_code == 0
    assert (tmp_path / "back.bin").read_bytes() == data


def test_inspect_of_metadata_whose_entries_are_no_mapping_is_not_an_internal_error(tmp_path):
    import json

    folder, _ = _encode(tmp_path, random.Random(11).randbytes(5_000))
    doc = json.loads(read_metadata(folder / "rank0" / META))
    doc["state_dict_metadata"] = 5
    for i in range(4):
        (folder / f"rank{i}" / META).write_bytes(seal(METADATA, json.dumps(doc).encode()))
    r = run_cli("ckpt", "inspect", folder)
    assert r.exit_code == 0 and "not a mapping" in r.output and "internal error" not in r.stderr, r
