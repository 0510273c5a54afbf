"""CodedStorageWriter / CodedStorageReader under torch.distributed.checkpoint: one 2-D code across
the ranks, rank i's row and column in PATH/rank{i}."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from distributed import run_world
from rankwise.ckpt import (
    Code2D,
    CodedStorageReader,
    CodedStorageWriter,
    Commitment,
    _dcp,
    _dcp_meta,
    _format,
    _store,
    read_fragment,
)


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


def _metadata(folder: Path) -> tuple:
    return _dcp_meta.decode_file(_store.read_metadata(folder / _dcp.META))


def _commitment(folder: Path) -> Commitment:
    return Commitment.from_bytes(_metadata(folder)[1])


def test_one_process_writes_n_folders_and_reads_past_t_lost_or_damaged_ones(tmp_path):
    ck = tmp_path / "ck"
    sd = _sd(0)
    dcp.save(sd, storage_writer=CodedStorageWriter(ck, t=1, n=5))
    assert sorted(os.listdir(ck)) == [f"rank{i}" for i in range(5)]
    frags = sum((ck / f"rank{i}" / _dcp.FRAGMENT).stat().st_size for i in range(5))
    m, k = _commitment(ck / "rank0").data_len, 4
    assert 2 * 5 / k * m <= frags < 2 * 5 / k * m + 5 * (2 * k * k + 100)  # 2n/k = 2.5×, not 5 replicas
    shutil.move(ck / "rank1", tmp_path / "away")  # a lost folder
    got = _fresh(sd)
    dcp.load(got, storage_reader=CodedStorageReader(ck))
    assert _same(got, sd)

    shutil.move(tmp_path / "away", ck / "rank1")  # and, instead, a damaged fragment
    frag = ck / "rank3" / _dcp.FRAGMENT
    b = bytearray(frag.read_bytes())
    b[200] ^= 1
    frag.write_bytes(bytes(b))
    got, reader = _fresh(sd), CodedStorageReader(ck)
    dcp.load(got, storage_reader=reader)
    assert _same(got, sd) and "does not match the commitment" in reader.skipped["rank3"]

    shutil.rmtree(ck / "rank4")  # two bad folders > t = 1: a clear error, no wrong data
    with pytest.raises(CheckpointException, match="cannot be decoded"):
        dcp.load(_fresh(sd), storage_reader=CodedStorageReader(ck))


def test_a_world_below_four_ranks_or_a_missing_n_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="give n"):
        CodedStorageWriter(tmp_path, t=1)
    with pytest.raises(ValueError, match="3t < n"):
        CodedStorageWriter(tmp_path, t=1, n=3)


class _Planted:
    """A non-tensor value whose unpickling writes a marker file (stands for planted code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("unpickled",))


def test_non_tensor_entries_load_with_weights_only_and_planted_objects_never_run(tmp_path):
    sd = {**_sd(0), "meta": {"epoch": 3, "name": "run", "lrs": [0.1, 0.01]}}
    dcp.save(sd, storage_writer=CodedStorageWriter(tmp_path / "a", t=1, n=4))
    got = {**_fresh(sd), "meta": {"epoch": 0, "name": "", "lrs": [0.0, 0.0]}}
    dcp.load(got, storage_reader=CodedStorageReader(tmp_path / "a"))
    assert got["meta"] == {"epoch": 3, "name": "run", "lrs": [0.1, 0.01]} and _same(got, sd)

    marker = tmp_path / "ran"  # a writer that stored an object
    dcp.save({**_sd(0), "meta": _Planted(str(marker))},
             storage_writer=CodedStorageWriter(tmp_path / "b", t=1, n=4))
    assert not marker.exists()
    with pytest.raises(CheckpointException, match=r"DCP entry 'meta' is a non-tensor value that "
                                                  r"torch.load\(weights_only=True\) refuses"):
        dcp.load({**_fresh(sd), "meta": None}, storage_reader=CodedStorageReader(tmp_path / "b"))
    assert not marker.exists()  # DCP's default planner would have run it (weights_only=False)


def test_checkpoint_id_is_the_checkpoint_folder(tmp_path):
    w = CodedStorageWriter(tmp_path / "unused", t=1, n=4)
    dcp.save(_sd(1), checkpoint_id=tmp_path / "step_1", storage_writer=w)
    dcp.save(_sd(2), checkpoint_id=tmp_path / "step_2", storage_writer=w)
    got = _fresh(_sd(1))
    dcp.load(got, checkpoint_id=tmp_path / "step_1", storage_reader=CodedStorageReader(tmp_path / "x"))
    assert _same(got, _sd(1)) and not (tmp_path / "unused").exists()


def test_a_resealed_metadata_in_any_folder_is_outvoted(tmp_path):
    """Round 5: a commitment re-sealed in the last location (its root kept, a field changed, the
    file's checksum recomputed) made every load fail, though the same file in location 0 was
    skipped. Here each folder's copy is one vote; a changed copy anywhere is a minority."""
    ck = tmp_path / "ck"
    sd = _sd(0)
    dcp.save(sd, storage_writer=CodedStorageWriter(ck, t=1, n=4))
    for bad in (0, 3):
        md, raw = _metadata(ck / f"rank{bad}")
        com = Commitment.from_bytes(raw)
        forged = Commitment(com.n, com.t, com.data_len + 1, com.block_size, com.hash, com.codec,
                            com.line_roots, com.root)  # the root kept, a field changed
        body = _dcp_meta.encode_file(md, forged.to_bytes())
        saved = (ck / f"rank{bad}" / _dcp.META).read_bytes()
        _store.write_metadata(ck / f"rank{bad}" / _dcp.META, body)  # sealed anew
        got, reader = _fresh(sd), CodedStorageReader(ck)
        dcp.load(got, storage_reader=reader)
        assert _same(got, sd)
        (ck / f"rank{bad}" / _dcp.META).write_bytes(saved)


def test_metadata_nested_deeper_than_the_stack_is_malformed_not_a_crash(tmp_path):
    """Two folders' metadata (the first the reader tries) nested deeper than the interpreter's
    stack: refused as malformed, so the load ends in the one clear error (two good copies < the
    quorum of 3), not a RecursionError out of the scan."""
    ck = tmp_path / "ck"
    dcp.save(_sd(0), storage_writer=CodedStorageWriter(ck, t=1, n=4))
    for i in (0, 1):
        _store.write_metadata(ck / f"rank{i}" / _dcp.META, b"[" * 200_000)  # json.loads: RecursionError
    reader = CodedStorageReader(ck)
    with pytest.raises(CheckpointException, match="no coded DCP metadata that a quorum"):
        dcp.load(_fresh(_sd(0)), storage_reader=reader)
    assert "malformed: RecursionError" in reader.skipped["rank0"]


def test_a_folder_linked_to_another_is_counted_once(tmp_path):
    """Round 5: a location replaced by a link to another made the reader refuse the whole set;
    it is one party (the link is skipped) and the other k decode."""
    ck = tmp_path / "ck"
    sd = _sd(0)
    dcp.save(sd, storage_writer=CodedStorageWriter(ck, t=1, n=4))
    shutil.rmtree(ck / "rank2")
    (ck / "rank2").symlink_to(ck / "rank0", target_is_directory=True)
    got, reader = _fresh(sd), CodedStorageReader(ck)
    dcp.load(got, storage_reader=reader)
    assert _same(got, sd) and "symbolic link" in reader.skipped["rank2"]


def test_writes_go_to_the_folders_opened_when_the_plan_was_made(tmp_path, monkeypatch):
    """Round 5: a folder swapped for a link between the plan's check and the write must not
    redirect the write (it left n − 1 distinct fragments)."""
    ck, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = _dcp._serialise

    def swap_then_serialise(plan, planner):
        os.rename(ck / "rank1", tmp_path / "moved")
        (ck / "rank1").symlink_to(elsewhere, target_is_directory=True)
        return real(plan, planner)

    monkeypatch.setattr(_dcp, "_serialise", swap_then_serialise)
    dcp.save(_sd(0), storage_writer=CodedStorageWriter(ck, t=1, n=4))
    assert os.listdir(elsewhere) == []
    assert sorted(os.listdir(tmp_path / "moved")) == [_dcp.META, _dcp.FRAGMENT]


def _shares(rank: int) -> dict:
    """Replicated (the model: DCP writes each tensor once) and per-rank entries of unequal sizes."""
    torch.manual_seed(0)
    return {"model": nn.Linear(64, 48).state_dict(),
            f"mine{rank}": torch.full((700 * (rank + 1),), float(rank)), "step": 5}


def _zeros(sd: dict) -> dict:
    return {k: (0 if k == "step" else {n: torch.zeros_like(v) for n, v in v.items()} if isinstance(v, dict)
                else torch.zeros_like(v)) for k, v in sd.items()}


def _equal(a: dict, b: dict) -> bool:
    return all((a[k] == b[k]) if k == "step" else
               all(torch.equal(a[k][n], b[k][n]) for n in a[k]) if isinstance(a[k], dict) else
               torch.equal(a[k], b[k]) for k in b)


def _four_ranks(rank: int, root: str):
    import torch.distributed as dist

    ck, bg = Path(root) / "ck", Path(root) / "bg"
    sd = _shares(rank)
    w = CodedStorageWriter(ck, t=1)
    dcp.save(sd, storage_writer=w)
    dcp.async_save(sd, storage_writer=CodedStorageWriter(bg, t=1)).result()
    dist.barrier()
    if rank == 0:
        shutil.copytree(ck / "rank2", Path(root) / "rank2_before")
        shutil.rmtree(ck / "rank2")  # a replaced machine: its disk wiped
    dist.barrier()
    got, reader = _zeros(sd), CodedStorageReader(ck)
    dcp.load(got, storage_reader=reader)
    got_bg = _zeros(sd)
    dcp.load(got_bg, storage_reader=CodedStorageReader(bg))
    dist.barrier()
    if rank == 1:  # a damaged block of rank 1's row (block 0: every rank's items start there)
        frag = ck / "rank1" / _dcp.FRAGMENT
        b = bytearray(frag.read_bytes())
        b[_format.FRAGMENT_HEAD + 5] ^= 1
        frag.write_bytes(bytes(b))
    dist.barrier()
    got_lazy, lazy = _zeros(sd), CodedStorageReader(ck, scrub=False)  # reads only the blocks asked for
    dcp.load(got_lazy, storage_reader=lazy)
    ok = _equal(got, sd) and _equal(got_bg, sd) and _equal(got_lazy, sd) and not lazy.stats["repaired"]
    sub, refused = dist.new_group([0, 1, 2]), None  # a save on a part of the world: refused, no hang
    if rank < 3:
        try:
            dcp.save(sd, storage_writer=CodedStorageWriter(Path(root) / "sub", t=1), process_group=sub)
        except (CheckpointException, ValueError) as e:
            refused = str(e)
    dist.barrier()
    return ok and (rank == 3 or "a part of it" in str(refused)), reader.collective, reader.stats


def _two_ranks(rank: int, root: str):
    sd = {**_shares(0), **_shares(1), **_shares(2), **_shares(3)}
    got = _zeros(sd)
    reader = CodedStorageReader(Path(root) / "ck")
    dcp.load(got, storage_reader=reader)
    return _equal(got, sd), reader.collective


def test_four_ranks_code_their_shares_rebuild_a_wiped_rank_from_2m_over_k_and_load_at_two_and_one(tmp_path):
    out = run_world(_four_ranks, 4, tmp_path, str(tmp_path), timeout=240)
    ck = tmp_path / "ck"
    assert all(ok and collective for ok, collective, _ in out)
    com = _commitment(ck / "rank0")
    # the encode across ranks gives the bytes one process gives for the same checkpoint
    code = Code2D(4, 1)
    frags = [read_fragment(ck / f"rank{i}" / _dcp.FRAGMENT, com) for i in range(4)]
    m = code.retrieve(frags, com)
    ref = code.encode(m)
    assert ref.commitment.root == com.root
    same = [bytes(f.row) == bytes(r.row) and bytes(f.col) == bytes(r.col)
            for f, r in zip(frags, ref.fragments, strict=True)]
    assert same == [True, False, True, True]  # (rank 1's block, damaged at the end, stays so: no scrub)
    # rank 2 was rebuilt into its folder, byte for byte, from k helpers' symbols: 2|m|/k
    for name in (_dcp.FRAGMENT, _dcp.META):
        assert (ck / "rank2" / name).read_bytes() == (tmp_path / "rank2_before" / name).read_bytes()
    stats = [s for _, _, s in out]
    assert [s["repaired"] for s in stats] == [False, False, True, False]
    k, B = 3, com.block_size
    received = stats[2]["received"]["repair"]
    assert received == 2 * k * B  # k helpers' two blocks, checked against the leaf hashes
    assert 0 <= 2 * k * B - 2 * com.data_len / k < 2 * k  # = 2|m|/k, |m| rounded up to k² blocks
    # each rank received only the blocks holding its items (|m|/k² each), not the whole checkpoint
    assert all(s["received"]["retrieve"] <= len(s["blocks"]) * B for s in stats)
    # saved at 4, loaded at 2 and at 1 (each reading every folder: another world size)
    assert run_world(_two_ranks, 2, tmp_path, str(tmp_path)) == [(True, False), (True, False)]
    sd = {**_shares(0), **_shares(3)}
    got = _zeros(sd)
    dcp.load(got, storage_reader=CodedStorageReader(ck))
    assert _equal(got, sd)


def _side_group_freed_by_destroy(rank: int) -> tuple[bool, bool]:
    import gc
    import weakref

    import torch.distributed as dist

    side = _dcp.side_group()
    again = _dcp.side_group() is side
    ref = weakref.ref(side)
    del side
    dist.destroy_process_group()
    gc.collect()
    return again, ref() is None


def test_the_side_group_is_made_once_and_freed_by_destroy_process_group(tmp_path):
    """A module global that kept the gloo side group past ``destroy_process_group`` freed it at
    interpreter exit, which aborted a rank now and then ("terminate called without an active
    exception", 4 of 30 four-rank runs under load): only torch's registry may keep it."""
    assert run_world(_side_group_freed_by_destroy, 2, tmp_path) == [(True, True), (True, True)]
