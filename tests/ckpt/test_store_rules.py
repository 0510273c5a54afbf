"""Issue 41, round 3, attacks 1 and 2: the checkpoint store is a tree rankwise owns. A symbolic
link in place of a ``rank{i}`` or ``step_*`` folder costs that rank's vote only: the restore
finishes with the right state, and no honest rank's file or outside file is written through the
link; a save into a linked folder is refused naming it. DCP locations are compared by identity."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from distributed import run_world
from rankwise.ckpt import CodedCheckpointer
from rankwise.ckpt._serial import serialize
from rankwise.ckpt._store import StoreError, real_folder

STEP = "step_0000000010"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g), "step": step}


def _tree(root: Path) -> dict[str, str]:
    """Every file below `root` (links not followed) -> a digest of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _link_then_restore(rank: int, store: str, outside: str, attack: str):
    import torch.distributed as dist

    ck = CodedCheckpointer(t=1, store_dir=store)
    ck.save(_state(10), 10)
    dist.barrier()
    root = Path(store)
    if rank == 1:
        if attack == "step-to-peer":  # rank1/step_10 -> rank0/step_10
            shutil.rmtree(root / "rank1" / STEP)
            (root / "rank1" / STEP).symlink_to(root / "rank0" / STEP, target_is_directory=True)
        elif attack == "rank-to-peer":  # rank1 -> rank0 (a shared store)
            shutil.rmtree(root / "rank1")
            (root / "rank1").symlink_to(root / "rank0", target_is_directory=True)
        elif attack == "step-outside":  # rank1/step_10 -> a folder outside the store
            shutil.rmtree(root / "rank1" / STEP)
            (root / "rank1" / STEP).symlink_to(outside, target_is_directory=True)
    dist.barrier()
    before = {"rank0": _tree(root / "rank0"), "outside": _tree(Path(outside))}
    dist.barrier()
    restored = ck.restore()
    dist.barrier()
    after = {"rank0": _tree(root / "rank0"), "outside": _tree(Path(outside))}
    return dict(ok=serialize(restored.state) == serialize(_state(10)), step=restored.step,
                repaired=restored.repaired, unchanged=before == after,
                still_link=(root / "rank1" / STEP).is_symlink() or (root / "rank1").is_symlink())


@pytest.mark.parametrize("attack", ["step-to-peer", "rank-to-peer", "step-outside"])
def test_a_linked_folder_costs_its_rank_only_and_nothing_is_written_through_it(tmp_path, attack):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "commitment.rwck").write_bytes(b"the user's own file")  # must stay as it is
    out = run_world(_link_then_restore, 4, tmp_path, str(tmp_path / "store"), str(outside), attack,
                    timeout=180)
    for r in out:
        assert r["ok"] and r["step"] == 10 and r["repaired"] == [1], r
        assert r["unchanged"] and r["still_link"], r
    assert (outside / "commitment.rwck").read_bytes() == b"the user's own file"
    assert sorted(p.name for p in outside.iterdir()) == ["commitment.rwck"]


def _save_into_a_link(rank: int, store: str, elsewhere: str, what: str):
    import torch.distributed as dist

    ck = CodedCheckpointer(t=1, store_dir=store)
    if rank == 2 and what == "step":  # a link planted at the step's own name
        (Path(store) / "rank2").mkdir(parents=True)
        (Path(store) / "rank2" / STEP).symlink_to(elsewhere, target_is_directory=True)
    if rank == 2 and what == "rank":  # the whole rank folder a link
        Path(store).mkdir(parents=True, exist_ok=True)
        (Path(store) / "rank2").symlink_to(elsewhere, target_is_directory=True)
    dist.barrier()
    try:
        ck.save(_state(10), 10)
    except RuntimeError as e:
        return str(e)
    mine = Path(store) / "rank2" / STEP
    return mine.is_symlink(), (mine / "fragment.rwck").exists()


@pytest.mark.parametrize("what", ["step", "rank"])
def test_a_save_beside_a_planted_link_commits_and_writes_nothing_through_it(tmp_path, what):
    """Issue 49: a link at a rank's own step name is removed (the entry, never its target) and
    the step written; a rank whose folder is a link fails alone, the others commit (at most t
    ranks failed): before, every rank raised, and under torchrun every later save crashed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_world(_save_into_a_link, 4, tmp_path, str(tmp_path / "store"), str(elsewhere), what,
                    timeout=120)
    assert all(isinstance(r, tuple) for r in out), out  # no rank raised
    if what == "step":
        assert out[2] == (False, True)  # a real folder holds rank 2's fragment now
    assert list(elsewhere.iterdir()) == []


def _prune_beside_a_link(rank: int, store: str, elsewhere: str):
    ck = CodedCheckpointer(t=1, store_dir=store, keep=1)
    ck.save(_state(10), 10)
    if rank == 0:  # an old-looking step folder that is a link to the user's folder
        (Path(store) / "rank0" / "step_0000000001").symlink_to(elsewhere, target_is_directory=True)
    ck.save(_state(20), 20)
    return sorted(p.name for p in (Path(store) / f"rank{rank}").iterdir())


def test_prune_removes_real_folders_only(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    out = run_world(_prune_beside_a_link, 4, tmp_path, str(tmp_path / "store"), str(elsewhere), timeout=120)
    assert out[1] == ["step_0000000020"]
    assert out[0] == ["step_0000000001", "step_0000000020"]  # the link is left, and its target
    assert (elsewhere / "keep.txt").read_text() == "mine"


def test_real_folder_names_the_component_and_creates_real_folders(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "rank0").symlink_to(tmp_path / "target", target_is_directory=True)
    with pytest.raises(StoreError, match=r"store/rank0 is a symbolic link"):
        real_folder(tmp_path / "store", "rank0", "step_1", create=True)
    assert list((tmp_path / "target").iterdir()) == []
    (tmp_path / "store" / "rank1").write_text("x")
    with pytest.raises(StoreError, match=r"rank1 is not a folder"):
        real_folder(tmp_path / "store", "rank1")
    with pytest.raises(FileNotFoundError):
        real_folder(tmp_path / "store", "rank2")
    made = real_folder(tmp_path / "new" / "store", "rank2", "step_1", create=True)
    assert made.is_dir() and not made.is_symlink()
    # the store's root is the user's choice, and may be a link
    (tmp_path / "via").symlink_to(tmp_path / "new" / "store", target_is_directory=True)
    assert real_folder(tmp_path / "via", "rank2", "step_1") == tmp_path / "via" / "rank2" / "step_1"


def test_a_write_lands_in_the_folder_that_was_checked_even_if_a_link_is_swapped_in(tmp_path):
    """The folder is opened component by component without following links, and the files are
    written through that descriptor: a link put in its place after the check cannot redirect the
    write (the race the path-based check left open)."""
    from rankwise.ckpt import Code2D
    from rankwise.ckpt._store import STEP_COMMITMENT, holds, opened_folder, write

    com = Code2D(4, 1).encode(b"y" * 500).commitment
    (tmp_path / "victim").mkdir()
    with opened_folder(tmp_path / "store", "rank1", STEP, create=True) as fd:
        step = tmp_path / "store" / "rank1" / STEP
        step.rename(tmp_path / "moved")  # swapped for a link to another folder after the check
        step.symlink_to(tmp_path / "victim", target_is_directory=True)
        write(STEP_COMMITMENT, com, dir_fd=fd)
        assert holds(STEP_COMMITMENT, com, dir_fd=fd)
    assert (tmp_path / "moved" / STEP_COMMITMENT).is_file() and list((tmp_path / "victim").iterdir()) == []
    store = tmp_path / "store"
    with pytest.raises(StoreError, match="is a symbolic link"), opened_folder(store, "rank1", STEP):
        pass
