"""CodedStorageWriter / CodedStorageReader under torch.distributed.checkpoint."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from distributed import run_world
from rankwise.ckpt import CodedStorageReader, CodedStorageWriter, read_commitment


def _sd(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": nn.Linear(40, 30).state_dict(), "step": 5, "extra": {"a": torch.arange(7.0)}}


def _fresh(sd: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0,
            "extra": {"a": torch.zeros(7)}}


def _same(a: dict, b: dict) -> bool:
    return (a["step"] == b["step"] and torch.equal(a["extra"]["a"], b["extra"]["a"])
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def test_single_process_round_trip_tolerates_t_lost_locations(tmp_path):
    locs = [tmp_path / f"disk{i}" for i in range(5)]  # n = 5, t = 1
    sd = _sd(0)
    dcp.save(sd, storage_writer=CodedStorageWriter(locs, t=1))
    frags = sum((loc / "__0.frag.rwck").stat().st_size for loc in locs)
    m = read_commitment(locs[0] / "__0.commit.rwck").data_len
    shutil.move(locs[1], tmp_path / "away")  # a lost location
    got = _fresh(sd)
    dcp.load(got, storage_reader=CodedStorageReader(locs))
    assert _same(got, sd)
    k = 4
    assert 2 * 5 / k * m <= frags < 2 * 5 / k * m + 5 * (2 * k * k + 100)  # 2n/k = 2.5×, not 5 replicas

    frag = locs[3] / "__0.frag.rwck"  # and, instead, a corrupted one
    shutil.move(tmp_path / "away", locs[1])
    b = bytearray(frag.read_bytes())
    b[100] ^= 1
    frag.write_bytes(bytes(b))
    got = _fresh(sd)
    reader = CodedStorageReader(locs)
    dcp.load(got, storage_reader=reader)
    assert _same(got, sd) and any("disk3" in k for k in reader.skipped)

    shutil.rmtree(locs[4])  # two bad locations > t = 1: a clear error, no wrong data
    with pytest.raises(CheckpointException, match="cannot be decoded"):
        dcp.load(_fresh(sd), storage_reader=CodedStorageReader(locs))


class _Planted:
    """A non-tensor value whose unpickling writes a marker file (stands for planted code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("unpickled",))


def test_non_tensor_entries_load_with_weights_only_and_planted_objects_never_run(tmp_path):
    locs = [tmp_path / f"disk{i}" for i in range(4)]
    sd = {**_sd(0), "meta": {"epoch": 3, "name": "run", "lrs": [0.1, 0.01]}}
    dcp.save(sd, storage_writer=CodedStorageWriter(locs, t=1))
    got = {**_fresh(sd), "meta": {"epoch": 0, "name": "", "lrs": [0.0, 0.0]}}
    dcp.load(got, storage_reader=CodedStorageReader(locs))
    assert got["meta"] == {"epoch": 3, "name": "run", "lrs": [0.1, 0.01]} and _same(got, sd)

    marker = tmp_path / "ran"
    other = [tmp_path / f"other{i}" for i in range(4)]  # a writer that stored an object
    dcp.save({**_sd(0), "meta": _Planted(str(marker))}, storage_writer=CodedStorageWriter(other, t=1))
    assert not marker.exists()
    with pytest.raises(CheckpointException, match=r"DCP entry 'meta' is a non-tensor value that "
                                                  r"torch.load\(weights_only=True\) refuses"):
        dcp.load({**_fresh(sd), "meta": None}, storage_reader=CodedStorageReader(other))
    assert not marker.exists()  # DCP's default planner would have run it (weights_only=False)


def test_checkpoint_id_selects_a_subfolder(tmp_path):
    locs = [tmp_path / f"disk{i}" for i in range(4)]
    dcp.save(_sd(1), checkpoint_id="step_1", storage_writer=CodedStorageWriter(locs, t=1))
    dcp.save(_sd(2), checkpoint_id="step_2", storage_writer=CodedStorageWriter(locs, t=1))
    got = _fresh(_sd(1))
    dcp.load(got, checkpoint_id="step_1", storage_reader=CodedStorageReader(locs))
    assert _same(got, _sd(1)) and (locs[0] / "step_2" / ".metadata.rwck").exists()
    with pytest.raises(ValueError, match="relative"):
        dcp.save(_sd(1), checkpoint_id="/abs", storage_writer=CodedStorageWriter(locs, t=1))


def _dcp_ranks(rank: int, root: str):
    locs = [Path(root) / f"disk{i}" for i in range(4)]
    # same key = the same (replicated) tensor to DCP, written once; per-rank data needs own keys
    sd = {"model": _sd(0)["model"], f"mine{rank}": torch.full((3,), float(rank)), "step": 5}
    dcp.save(sd, storage_writer=CodedStorageWriter(locs, t=1))
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.rmtree(locs[2])
    dist.barrier()
    got = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, f"mine{rank}": torch.zeros(3),
           "step": 0}
    dcp.load(got, storage_reader=CodedStorageReader(locs))
    return bool(torch.equal(got[f"mine{rank}"], sd[f"mine{rank}"]) and got["step"] == 5
                and all(torch.equal(got["model"][k], sd["model"][k]) for k in sd["model"]))


def test_multi_rank_round_trip_with_a_lost_location(tmp_path):
    assert run_world(_dcp_ranks, 2, tmp_path, str(tmp_path)) == [True, True]


def test_interrupted_overwrite_reads_the_save_the_metadata_names(tmp_path):
    """Save A to 4 locations; an overwrite by B reaches only location 0 (a crash): the reader
    must skip location 0's foreign files and decode A from the other three (k = 3)."""
    locs = [tmp_path / f"disk{i}" for i in range(4)]
    a, b = _sd(1), _sd(2)
    dcp.save(a, storage_writer=CodedStorageWriter(locs, t=1))
    other = [tmp_path / f"b{i}" for i in range(4)]
    dcp.save(b, storage_writer=CodedStorageWriter(other, t=1))
    for name in ("__0.frag.rwck", "__0.commit.rwck"):
        shutil.copy(other[0] / name, locs[0] / name)
    got = _fresh(a)
    reader = CodedStorageReader(locs)
    dcp.load(got, storage_reader=reader)
    assert _same(got, a) and "another save" in reader.skipped[f"{locs[0]}/0"]


def test_dcp_async_save_with_the_coded_writer(tmp_path):
    """``dcp.async_save`` stages the state and writes through CodedStorageWriter in the
    background; the result loads with a location lost."""
    locs = [tmp_path / f"disk{i}" for i in range(4)]
    sd = _sd(3)
    fut = dcp.async_save(sd, storage_writer=CodedStorageWriter(locs, t=1))
    fut.result()
    shutil.rmtree(locs[2])
    got = _fresh(sd)
    dcp.load(got, storage_reader=CodedStorageReader(locs))
    assert _same(got, sd)


def test_locations_that_are_one_folder_are_refused_by_identity(tmp_path):
    """Issue 41, attack 2: one location a symbolic link to another was accepted (the path strings
    differ), so both wrote one folder: 3 distinct fragments for n = 4, and no further location
    could be lost."""
    locs = [tmp_path / f"disk{i}" for i in range(4)]
    locs[0].mkdir()
    (tmp_path / "alias").symlink_to(locs[0], target_is_directory=True)
    with pytest.raises(ValueError, match=r"distinct folders; .*disk0 and .*alias are the same folder"):
        CodedStorageWriter([locs[0], tmp_path / "alias", locs[2], locs[3]], t=1)
    with pytest.raises(ValueError, match="are the same folder"):  # spelled apart, not yet made
        CodedStorageWriter([locs[1], tmp_path / "x" / ".." / "disk1", locs[2], locs[3]], t=1)
    # a link made after the writer was built is caught when the save makes the folders
    writer = CodedStorageWriter([locs[0], tmp_path / "late", locs[2], locs[3]], t=1)
    locs[2].mkdir()
    (tmp_path / "late").symlink_to(locs[2], target_is_directory=True)
    with pytest.raises(CheckpointException, match="are the same folder"):
        dcp.save(_sd(0), storage_writer=writer)
    # and a reader would count one folder's metadata twice towards its quorum
    with pytest.raises(ValueError, match="are the same folder"):
        CodedStorageReader([locs[0], locs[2], tmp_path / "late", locs[3]])
