"""The checkpoint store is a tree rankwise owns (issues 41 and 49, on the one layout
``store/step_{N:010d}/rank{i}/``). A symbolic link in place of a rank's folder (or, on a
node-local store, of a step folder) costs that rank's vote only: the restore finishes with the
right state, and no honest rank's file or outside file is written through the link; a save
beside a planted link commits and writes nothing through it; prune removes real folders only;
what changes on a disk after the vote costs nothing; only the store's own step names are steps.

One four-rank world runs every scenario in turn (each on its own store), each on a side group of
its own with a short timeout, so that a scenario that leaves a rank waiting fails in seconds and
the next starts in step; the tests read its record.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from distributed import fresh_side_group, run_world
from rankwise.ckpt import _layout, _store
from rankwise.ckpt._store import StoreError, opened_folder

STEP = "step_0000000010"
FRAGMENT, META = _layout.FRAGMENT, _layout.META
SIDE_TIMEOUT = 10.0  # seconds a scenario's collectives wait for a silent rank


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 24, generator=g), "b": torch.randn(24, generator=g), "step": step}


def _same(state, step: int) -> bool:
    want = _state(step)
    return (isinstance(state, dict) and state.keys() == want.keys() and state["step"] == step
            and torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"]))


def _restore(ck):
    """`ck.restore()`, or the error it raised as a string (caught, so that every rank goes on to
    the scenario's next barrier alike)."""
    try:
        return ck.restore()
    except BaseException as e:  # (a CheckpointException is a BaseException)
        return f"{type(e).__name__}: {e}"[-600:]


def _tree(root: Path) -> dict[str, str]:
    """Every file and folder below `root` (links not followed) -> a digest of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*")) if not p.is_symlink()}


def _node(root: Path, attack: str, rank: int) -> Path:
    """The store of `rank`: one store shared by every rank, or, for the step-folder attacks, a
    node-local store per rank (a step folder is then one rank's own)."""
    return root / attack / (f"node{rank}" if attack.startswith("step-") else "shared")


# ---------------------------------------------------------------------- scenarios
LINKED = ["rank-to-peer", "rank-outside", "step-to-peer", "step-outside"]


def _linked_then_restore(rank: int, root: Path, outside: Path, attack: str) -> dict:
    """Rank 1's folder of step 10 replaced by a link after the save: to a peer's folder or to a
    folder outside the store (the rank folder on a shared store; the step folder on a
    node-local one)."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    store = _node(root, attack, rank)
    ck = CodedCheckpointer(t=1, store_dir=store)
    ck.save(_state(10), 10)
    dist.barrier()
    if rank == 1:
        if attack == "rank-to-peer":  # step_10/rank1 -> step_10/rank0
            shutil.rmtree(store / STEP / "rank1")
            (store / STEP / "rank1").symlink_to(store / STEP / "rank0", target_is_directory=True)
        elif attack == "rank-outside":  # step_10/rank1 -> a folder outside the store
            shutil.rmtree(store / STEP / "rank1")
            (store / STEP / "rank1").symlink_to(outside, target_is_directory=True)
        elif attack == "step-to-peer":  # node1/step_10 -> node0/step_10
            shutil.rmtree(store / STEP)
            (store / STEP).symlink_to(_node(root, attack, 0) / STEP, target_is_directory=True)
        else:  # node1/step_10 -> a folder outside the store
            shutil.rmtree(store / STEP)
            (store / STEP).symlink_to(outside, target_is_directory=True)
    dist.barrier()
    peer = _node(root, attack, 0) / STEP
    watched = {"rank0": peer if attack.startswith("step-") else peer / "rank0", "outside": outside}
    before = {k: _tree(p) for k, p in watched.items()}
    dist.barrier()
    restored = _restore(ck)
    dist.barrier()
    after = {k: _tree(p) for k, p in watched.items()}
    if isinstance(restored, str):
        return {"error": restored}
    return dict(ok=_same(restored.state, 10), step=restored.step, repaired=restored.repaired,
                skipped=restored.skipped, unchanged=before == after,
                still_link=(_node(root, attack, 1) / STEP / "rank1").is_symlink()
                or (_node(root, attack, 1) / STEP).is_symlink())


def _save_into_a_link(rank: int, root: Path, elsewhere: Path, what: str) -> dict:
    """A link planted before the save where rank 2's folder of step 10 goes: at the rank folder's
    own name (shared store), or at the step folder's (node-local store)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from rankwise.ckpt import CodedCheckpointer

    store = root / f"save-{what}" / (f"node{rank}" if what == "step" else "shared")
    ck = CodedCheckpointer(t=1, store_dir=store)
    if rank == 2 and what == "rank":
        (store / STEP).mkdir(parents=True, exist_ok=True)
        (store / STEP / "rank2").symlink_to(elsewhere, target_is_directory=True)
    if rank == 2 and what == "step":
        store.mkdir(parents=True)
        (store / STEP).symlink_to(elsewhere, target_is_directory=True)
    dist.barrier()
    try:
        ck.save(_state(10), 10)
    except (RuntimeError, OSError, CheckpointException) as e:
        return {"error": f"{type(e).__name__}: {e}"[-600:]}
    mine = store / STEP / "rank2"
    return dict(link=mine.is_symlink(), fragment=(mine / FRAGMENT).is_file() and not mine.is_symlink())


def _prune_beside_links(rank: int, root: Path, elsewhere: Path) -> dict:
    """keep=1 on a shared store where rank 0 planted an old-looking rank folder that is a link to
    the user's folder (step_1/rank0), and an old-looking step folder that is a link to another
    run's checkpoint step (step_2 -> other/step_5)."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    store, other = root / "prune" / "store", root / "prune" / "other"
    CodedCheckpointer(t=1, store_dir=other).save(_state(5), 5)
    ck = CodedCheckpointer(t=1, store_dir=store, keep=1)
    ck.save(_state(10), 10)
    if rank == 0:
        (store / "step_0000000001").mkdir()
        (store / "step_0000000001" / "rank0").symlink_to(elsewhere, target_is_directory=True)
        (store / "step_0000000002").symlink_to(other / "step_0000000005", target_is_directory=True)
    dist.barrier()
    ck.save(_state(20), 20)
    dist.barrier()
    return dict(steps=sorted(p.name for p in store.iterdir()),
                other=sorted(p.name for p in (other / "step_0000000005").iterdir()))


AFTER_THE_VOTE = ["forged-metadata", "unreadable-metadata", "swapped-folder", "forged-before-the-vote"]


def _forge(path: Path) -> None:
    """A sealed metadata holding a tiny commitment that claims n = 65535 parties."""
    import json
    import struct

    from rankwise.ckpt._format import COMMITMENT, METADATA, seal

    names = b"".join(len(x).to_bytes(1, "little") + x for x in (b"sha256", b"cauchy-gf256"))
    com = seal(COMMITMENT, struct.pack("<HHQQB", 65535, 1, 100, 12, 0) + names)
    doc = json.loads(_store.read_metadata(path))
    doc["commitment"] = com.hex()
    path.write_bytes(seal(METADATA, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()))


def _after_vote(rank: int, root: Path, attack: str) -> dict:
    """Rank 1's step-25 folder changed between the vote and the phases after it (a rewrite, a
    disk error, a swapped folder), by a transport that edits the disk once its vote is cast."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer
    from rankwise.ckpt._transport import Transport

    store = root / "after" / attack
    mine = store / "step_0000000025" / "rank1"

    class Edits(Transport):
        def gather(self, payload, size):
            got = super().gather(payload, size)
            if self.phase == "vote" and not getattr(Edits, "done", False):
                Edits.done = True
                if attack == "forged-metadata":
                    _forge(mine / META)
                elif attack == "unreadable-metadata":  # EISDIR on any read or write
                    (mine / META).unlink()
                    (mine / META).mkdir()
                elif attack == "swapped-folder":  # the rank folder now a link to rank 0's
                    mine.rename(mine.with_name("moved"))
                    mine.symlink_to(store / "step_0000000025" / "rank0", target_is_directory=True)
            return got

    ck = CodedCheckpointer(t=1, store_dir=store, keep=3, transport=Edits if rank == 1 else Transport)
    ck.save(_state(20), 20)
    ck.save(_state(25), 25)
    if rank == 1 and attack == "forged-before-the-vote":
        _forge(mine / META)
    dist.barrier()
    rank0 = store / "step_0000000025" / "rank0"
    before = _tree(rank0)
    dist.barrier()
    restored = _restore(ck)
    dist.barrier()
    if isinstance(restored, str):
        return {"error": restored}
    return dict(step=restored.step, ok=_same(restored.state, 25), repaired=restored.repaired,
                skipped=restored.skipped, rank0_unchanged=before == _tree(rank0))


def _world(rank: int, root: str) -> dict:
    root_ = Path(root)
    scenarios = {("prune",): lambda: _prune_beside_links(rank, root_, root_ / "elsewhere-prune")}
    for what in ("rank", "step"):
        scenarios[("save", what)] = lambda what=what: _save_into_a_link(
            rank, root_, root_ / f"elsewhere-{what}", what)
    for attack in AFTER_THE_VOTE:
        scenarios[("after", attack)] = lambda attack=attack: _after_vote(rank, root_, attack)
    for attack in LINKED:
        scenarios[("linked", attack)] = lambda attack=attack: _linked_then_restore(
            rank, root_, root_ / f"outside-{attack}", attack)
    out = {}
    for key, run in scenarios.items():
        fresh_side_group(SIDE_TIMEOUT)
        try:
            out[key] = run()
        except BaseException as e:  # (a CheckpointException is a BaseException)
            out[key] = {"error": f"{type(e).__name__}: {e}"[-600:]}
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("rules")
    for name in ("elsewhere-prune", "elsewhere-rank", "elsewhere-step"):
        (root / name).mkdir()
    (root / "elsewhere-prune" / "keep.txt").write_text("mine")
    for attack in LINKED:
        (root / f"outside-{attack}").mkdir()
        for f in (FRAGMENT, META):  # the user's own files, which must stay as they are
            (root / f"outside-{attack}" / f).write_bytes(b"the user's own file")
    return root, run_world(_world, 4, root, str(root), timeout=420)


def _linked_ok(out: list, attack: str) -> None:
    for r in out:
        got = r[("linked", attack)]
        assert "error" not in got, got
        assert got["ok"] and got["step"] == 10 and got["skipped"] == [] and got["repaired"] == [1], got
        assert got["unchanged"] and got["still_link"], got


@pytest.mark.parametrize("attack", ["rank-to-peer", "rank-outside", "step-to-peer", "step-outside"])
def test_a_linked_folder_costs_its_rank_only_and_nothing_is_written_through_it(world, attack):
    root, out = world
    _linked_ok(out, attack)
    outside = root / f"outside-{attack}"
    assert sorted(p.name for p in outside.iterdir()) == sorted([FRAGMENT, META])
    assert all(p.read_bytes() == b"the user's own file" for p in outside.iterdir())


@pytest.mark.parametrize("what", ["rank", "step"])
def test_a_save_beside_a_planted_link_commits_and_writes_nothing_through_it(world, what):
    """Issue 49: a link at a rank's own folder name is removed (the entry, never its target) and
    the step written; at most t ranks that cannot write fail alone and the others commit."""
    root, out = world
    results = [r[("save", what)] for r in out]
    assert all("error" not in r for r in results), results  # no rank raised
    if what == "rank":
        assert results[2] == {"link": False, "fragment": True}  # a real folder holds rank 2's fragment
    assert list((root / f"elsewhere-{what}").iterdir()) == []


def test_prune_leaves_a_linked_rank_folder_and_its_target(world):
    root, out = world
    assert all("error" not in r[("prune",)] for r in out), out
    assert (root / "elsewhere-prune" / "keep.txt").read_text() == "mine"
    assert "step_0000000001" in out[0][("prune",)]["steps"]  # the link is left, and its target


def test_prune_never_removes_through_a_linked_step_folder(world):
    _, out = world
    for r in out:
        assert r[("prune",)]["other"] == ["rank0", "rank1", "rank2", "rank3"], r[("prune",)]


@pytest.mark.parametrize("attack", [
    "forged-metadata",
    "unreadable-metadata",
    "swapped-folder",
    "forged-before-the-vote",
])
def test_what_changes_after_the_vote_costs_nothing(world, attack):
    """Issue 49, item 2: a rank's metadata rewritten after the vote (a forged n = 65535), one that
    now fails to read or write (EISDIR), or its folder swapped for a link to a peer's costs that
    rank's copy at most: the step restores on every rank, nothing is rebuilt, rank 0 unchanged."""
    _, out = world
    for r in out:
        got = r[("after", attack)]
        assert "error" not in got, got
        assert got["step"] == 25 and got["ok"] and got["skipped"] == [] and got["rank0_unchanged"], got
        # rank 1's own fragment is good; a folder swapped for a link before the load opened it (the
        # step vote comes first) is rebuilt in memory, nothing written through the link
        assert got["repaired"] == ([1] if attack == "swapped-folder" else []), got


# ---------------------------------------------------------------------- one process
NAMES = [("step_0000000025", 25), ("step_25", None), ("step_" + "9" * 20, None), ("step_²", None),
         ("step_000000002５", None), ("step_-000000025", None), ("step_0000000025 ", None),
         ("step_10000000000", 10**10), ("step_18446744073709551615", 2**64 - 1)]


@pytest.mark.parametrize("name, step", NAMES)
def test_only_the_stores_own_step_names_are_steps(tmp_path, name, step):
    """A step folder is exactly step_{s:010d} in ASCII digits with s < 2⁶⁴: `step_25` was read as
    step 25 by the vote and then not found; twenty nines raised struct.error; `step_²` passed
    isdigit() and failed int() (in _prune too, failing every save)."""
    from rankwise.ckpt import CodedCheckpointer

    _store.write_metadata(tmp_path / name / "rank0" / META, b"{}")
    ck = CodedCheckpointer.__new__(CodedCheckpointer)
    ck.root_dir, ck.rank, ck.keep, ck.scan_seconds = tmp_path, 0, 2, 60.0
    assert list(ck._local_steps()) == ([] if step is None else [step])


def _pruner(root: Path, steps: list[int]):
    from rankwise.ckpt import CodedCheckpointer

    ck = CodedCheckpointer.__new__(CodedCheckpointer)
    ck.root_dir, ck.rank, ck.keep = root, 0, 1
    ck._local_steps = lambda: dict.fromkeys(steps, b"")
    return ck._prune


def _deep_tree(top: Path, levels: int) -> None:
    """`levels` nested folders "d" under `top`, made through descriptors (the path is too long)."""
    top.mkdir(parents=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(levels):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def _remove_deep_tree(top: Path) -> None:
    """Remove a tree of nested "d" folders without recursion (pytest's own cleanup recurses)."""
    if not top.exists():
        return
    fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    while "d" in os.listdir(fds[-1]):
        fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
    os.close(fds.pop())
    while fds:
        os.rmdir("d", dir_fd=fds[-1])
        os.close(fds.pop())
    os.rmdir(top)


def test_prune_survives_a_deep_tree(tmp_path, caplog):
    """A 3,000-level tree in an old step's rank folder made _prune's rmtree raise RecursionError
    after the commit (that rank alone failed, its peers waited): it is removed, or left and
    logged, and the save goes on."""
    store = tmp_path / "store"
    deep = store / "step_0000000001" / "rank0"
    _deep_tree(deep, 3000)
    (store / "step_0000000010" / "rank0").mkdir(parents=True)
    try:
        _pruner(store, [1, 10])(10)  # no exception
    finally:
        _remove_deep_tree(deep)
    assert "could not remove" in caplog.text or not (store / "step_0000000001").exists()
    assert (store / "step_0000000010" / "rank0").is_dir()


def test_prune_never_follows_a_rank_folder_swapped_for_a_link(tmp_path):
    """`rank0` of an old step swapped for a link between the scan and rmtree: the link may go, its
    target (a folder outside the store) stays."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    (outside / "rank0").mkdir(parents=True)
    (outside / "rank0" / "mine.txt").write_text("mine")
    (store / "step_0000000001").mkdir(parents=True)
    (store / "step_0000000001" / "rank0").symlink_to(outside / "rank0", target_is_directory=True)
    _pruner(store, [1, 10])(10)
    assert (outside / "rank0" / "mine.txt").read_text() == "mine"


def test_prune_never_follows_a_step_folder_swapped_for_a_link(tmp_path):
    store, outside = tmp_path / "store", tmp_path / "outside"
    (outside / "rank0").mkdir(parents=True)
    (outside / "rank0" / "mine.txt").write_text("mine")
    store.mkdir()
    (store / "step_0000000001").symlink_to(outside, target_is_directory=True)
    _pruner(store, [1, 10])(10)
    assert (outside / "rank0" / "mine.txt").read_text() == "mine"


def test_opened_folder_names_the_component_and_creates_real_folders(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "store" / STEP).mkdir(parents=True)
    (tmp_path / "store" / STEP / "rank0").symlink_to(tmp_path / "target", target_is_directory=True)
    with pytest.raises(StoreError, match=rf"store/{STEP}/rank0 is a symbolic link"), \
            opened_folder(tmp_path / "store", STEP, "rank0", create=True):
        pass
    assert list((tmp_path / "target").iterdir()) == []
    (tmp_path / "store" / STEP / "rank1").write_text("x")
    with pytest.raises(StoreError, match=r"rank1 is not a folder"), \
            opened_folder(tmp_path / "store", STEP, "rank1"):
        pass
    with pytest.raises(FileNotFoundError), opened_folder(tmp_path / "store", STEP, "rank2"):
        pass
    with opened_folder(tmp_path / "new" / "store", STEP, "rank2", create=True):
        pass
    made = tmp_path / "new" / "store" / STEP / "rank2"
    assert made.is_dir() and not made.is_symlink()
    # the store's root is the user's choice, and may be a link
    (tmp_path / "via").symlink_to(tmp_path / "new" / "store", target_is_directory=True)
    with opened_folder(tmp_path / "via", STEP, "rank2") as fd:
        assert os.path.samestat(os.fstat(fd), os.stat(made))


def test_a_write_lands_in_the_folder_that_was_checked_even_if_a_link_is_swapped_in(tmp_path):
    """The folder is opened component by component without following links, and the files are
    written through that descriptor: a link put in its place after the check cannot redirect the
    write (the race a path-based check leaves open)."""
    from rankwise.ckpt import Code2D

    disp = Code2D(4, 1).encode(b"y" * 500)
    body = _layout.file_metadata(500, disp.commitment)
    (tmp_path / "victim").mkdir()
    with opened_folder(tmp_path / "store", STEP, "rank1", create=True) as fd:
        mine = tmp_path / "store" / STEP / "rank1"
        mine.rename(tmp_path / "moved")  # swapped for a link to another folder after the check
        mine.symlink_to(tmp_path / "victim", target_is_directory=True)
        _layout.write_party(fd, disp.fragments[1], body)
        got_body, frag, why = _layout.read_party(fd, disp.commitment)
        assert got_body == body and why is None and bytes(frag.row) == bytes(disp.fragments[1].row)
    assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == sorted([FRAGMENT, META])
    assert list((tmp_path / "victim").iterdir()) == []
    with pytest.raises(StoreError, match="is a symbolic link"), \
            opened_folder(tmp_path / "store", STEP, "rank1"):
        pass
