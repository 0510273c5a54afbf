"""Files from disk are read only when they are regular files of a size the geometry allows: a
FIFO, a device, a 1 TiB sparse file or a folder in place of a checkpoint file is a bad file of
that worker, rank or location, never a hang, an unbounded allocation or a stopped restore."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rankwise._io import read_regular


def _plant(path: Path, kind: str) -> None:
    """Replace `path` by a special or oversized file."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(1 << 40)  # 1 TiB, no blocks on disk
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:
        raise ValueError(kind)


KINDS = ["fifo", "sparse", "dev-zero", "folder"]
SAID = {"fifo": "is a FIFO, not a regular file", "sparse": "is 1,099,511,627,776 bytes, more than",
        "dev-zero": "is a device, not a regular file", "folder": "is a folder, not a regular file"}


@pytest.mark.parametrize("kind", KINDS)
def test_read_regular_refuses_special_and_oversized_files_at_once(tmp_path, kind):
    path = tmp_path / "f"
    _plant(path, kind)
    with pytest.raises(ValueError, match=SAID[kind]):
        read_regular(path, 1 << 20)


def test_read_regular_reads_a_regular_file_or_a_link_to_one(tmp_path):
    data = os.urandom(70_000)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "link").symlink_to(tmp_path / "f")
    assert read_regular(tmp_path / "f", len(data)) == data == read_regular(tmp_path / "link", len(data))
    with pytest.raises(ValueError, match="70,000 bytes, more than the 69,999"):
        read_regular(tmp_path / "f", len(data) - 1)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 10)


def _encoded(tmp_path: Path, cli: list[str]) -> tuple[Path, bytes]:
    data = os.urandom(20_000)
    (tmp_path / "ck.bin").write_bytes(data)
    folder = tmp_path / "d"
    subprocess.run([*cli, "ckpt", "encode", str(tmp_path / "ck.bin"), "--n", "4", "--t", "1", "--out",
                    str(folder)], check=True, capture_output=True, timeout=120)
    return folder, data


@pytest.mark.parametrize("kind", KINDS)
def test_ckpt_verify_reports_a_special_worker_file_and_retrieve_still_decodes(tmp_path, kind):
    cli = [sys.executable, "-m", "rankwise"]
    folder, data = _encoded(tmp_path, cli)
    _plant(folder / "rank2" / "fragment.rwck", kind)
    r = subprocess.run([*cli, "ckpt", "verify", str(folder)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    assert re.search(r"│ 2 +│", r.stdout) and not re.search(r"│ 2 +│ ok", r.stdout), r.stdout  # 2: not ok
    assert SAID[kind].split(",")[0] in " ".join(r.stdout.split()), r.stdout
    r = subprocess.run([*cli, "ckpt", "retrieve", str(folder), "--out", str(tmp_path / "out.bin")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.bin").read_bytes() == data


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_metadata_file_costs_one_vote_and_in_every_worker_a_one_line_refusal(tmp_path, kind):
    """In one worker's folder it costs that worker's vote (verify says so; the other three are a
    quorum and retrieve decodes); in every worker's folder no metadata has a quorum: one line."""
    cli = [sys.executable, "-m", "rankwise"]
    folder, data = _encoded(tmp_path, cli)
    _plant(folder / "rank1" / ".metadata.rwck", kind)
    r = subprocess.run([*cli, "ckpt", "verify", str(folder)], capture_output=True, text=True, timeout=60)
    said = " ".join(r.stdout.split())
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    assert "fragment ok; metadata:" in said and SAID[kind].split(",")[0] in said, r.stdout
    r = subprocess.run([*cli, "ckpt", "retrieve", str(folder), "--out", str(tmp_path / "out.bin")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and (tmp_path / "out.bin").read_bytes() == data, r.stderr
    for i in (0, 2, 3):
        _plant(folder / f"rank{i}" / ".metadata.rwck", kind)
    r = subprocess.run([*cli, "ckpt", "verify", str(folder)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no coded checkpoint in" in r.stderr and SAID[kind].split(",")[0] in r.stderr
    assert "internal error" not in r.stderr


PLANTED = [("fragment", "fifo"), ("fragment", "sparse"), ("fragment", "dev-zero"), ("metadata", "fifo"),
           ("metadata", "sparse"), ("metadata", "folder")]


def _restore_with_planted(rank: int, root: str):
    """Every case of PLANTED in turn, each on a store of its own: rank 2's file of step 7
    (``store/step_0000000007/rank2/fragment.rwck`` or ``.metadata.rwck``) replaced by a special
    or oversized file, then a restore. Each case runs on a side group of its own with a short
    timeout (test plumbing: a case that leaves a rank waiting fails in seconds, and the next
    one starts in step)."""
    import torch
    import torch.distributed as dist

    from distributed import fresh_side_group
    from rankwise.ckpt import CodedCheckpointer

    state = {"w": torch.arange(3000.0), "step": 7}
    out = {}
    for which, kind in PLANTED:
        fresh_side_group(10)
        store = Path(root) / f"{which}-{kind}"
        try:
            ck = CodedCheckpointer(t=1, store_dir=store)
            ck.save(state, 7)
            dist.barrier()
            if rank == 2:
                name = "fragment.rwck" if which == "fragment" else ".metadata.rwck"
                _plant(store / "step_0000000007" / "rank2" / name, kind)
            dist.barrier()
            got, step = ck.restore()
            out[which, kind] = step, torch.equal(got["w"], state["w"]), ck.stats()["repaired"]
        except BaseException as e:  # (a CheckpointException is a BaseException)
            out[which, kind] = f"{type(e).__name__}: {e}"[-600:]
    return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from distributed import run_world

    root = tmp_path_factory.mktemp("planted")
    return run_world(_restore_with_planted, 4, root, str(root), timeout=300)


@pytest.mark.parametrize("which, kind", [
    *PLANTED,
])
def test_a_special_file_on_one_rank_neither_hangs_nor_stops_a_restore(planted, which, kind):
    for r in planted:
        got = r[which, kind]
        assert isinstance(got, tuple), got
        step, same, repaired = got
        assert step == 7 and same
        assert repaired == ([2] if which == "fragment" else [])  # a bad metadata copy costs a vote only


@pytest.mark.parametrize("name, kind", [(".metadata.rwck", "fifo"), (".metadata.rwck", "sparse"),
                                        ("fragment.rwck", "fifo"), ("fragment.rwck", "sparse"),
                                        ("fragment.rwck", "dev-zero")])
def test_a_special_file_in_one_dcp_rank_folder_neither_hangs_nor_stops_a_load(tmp_path, name, kind):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from rankwise.ckpt import CodedStorageReader, CodedStorageWriter

    ck = tmp_path / "ck"
    sd = {"w": torch.arange(5000.0), "b": torch.ones(7)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=CodedStorageWriter(ck, t=1, n=4))
        _plant(ck / "rank1" / name, kind)
        got = {"w": torch.zeros(5000), "b": torch.zeros(7)}
        reader = CodedStorageReader(ck)
        dcp.load(got, storage_reader=reader)
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"])
    assert "rank1" in reader.skipped
