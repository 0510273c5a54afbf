"""Issue 49 (hardening, round 4): the attacks fixed so far, each a test that failed before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankwise.ckpt import _store

NAMES = [("step_0000000025", 25), ("step_25", None), ("step_" + "9" * 20, None), ("step_²", None),
         ("step_000000002５", None), ("step_-000000025", None), ("step_18446744073709551615", 2**64 - 1),
         ("step_0000000025 ", None)]


@pytest.mark.parametrize("name, step", NAMES)
def test_only_the_stores_own_step_names_are_steps(name, step):
    """A step folder is exactly step_{s:010d} in ASCII digits with s < 2⁶⁴: `step_25` was read as
    step 25 by the vote and then not found; twenty nines raised struct.error; `step_²` passed
    isdigit() and failed int() (in _prune too, failing every save)."""
    assert _store.step_of(Path(name)) == step


def test_the_out_lock_follows_no_link_and_opens_only_a_regular_file(tmp_path):
    """`open(".rankwise.lock", "a+")` followed a link planted as the lock file and created its
    target (any path, as the user running the command); a FIFO there would hang."""
    from rankwise.cli._common import UserError, lock_output, release_outputs

    out, target = tmp_path / "out", tmp_path / "elsewhere" / "created"
    out.mkdir()
    target.parent.mkdir()
    (out / ".rankwise.lock").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        lock_output(out)
    assert not target.exists()
    (out / ".rankwise.lock").unlink()
    os.mkfifo(out / ".rankwise.lock")
    with pytest.raises(UserError, match="not a regular file"):
        lock_output(out)
    (out / ".rankwise.lock").unlink()
    lock_output(out)  # and a plain folder still locks
    release_outputs(False)
    assert (out / ".rankwise.lock").is_file()


def test_small_files_are_read_bounded_and_deep_json_is_named(tmp_path):
    """`run.json` was read with read_text(): a FIFO hung the command, a link to /dev/zero read
    until MemoryError; 1 MiB of `[` in an adapter config raised RecursionError."""
    from rankwise._io import read_json

    fifo, zero, deep = tmp_path / "fifo.json", tmp_path / "zero.json", tmp_path / "deep.json"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    deep.write_text("[" * (1 << 20))
    with pytest.raises(ValueError, match="FIFO"):
        read_json(fifo)
    with pytest.raises(ValueError, match="a device"):
        read_json(zero)
    with pytest.raises(ValueError, match="nested too deep"):
        read_json(deep)


def test_a_run_json_that_is_a_fifo_is_refused_in_one_line(tmp_path):
    from rankwise.cli._common import UserError
    from rankwise.cli._train_dp import check_checkpoint_dir
    from rankwise.train_config import TrainConfig

    config = TrainConfig(checkpoint_dir=tmp_path / "ck", checkpoint_every=1)
    config.checkpoint_dir.mkdir()
    os.mkfifo(config.checkpoint_dir / "run.json")
    with pytest.raises(UserError, match=r"run\.json is unreadable .*FIFO"):
        check_checkpoint_dir(config, 2)


def _deep_tree(top: Path, levels: int) -> None:
    """`levels` nested folders "d" under `top`, made through descriptors (the path is too long)."""
    top.mkdir()
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


def _pruner(root: Path, steps: list[int]):
    from types import SimpleNamespace

    from rankwise.ckpt._checkpointer import CodedCheckpointer

    me = SimpleNamespace(root_dir=root, rank=0, keep=1, _local_steps=lambda: steps)
    return lambda newest: CodedCheckpointer._prune(me, newest)


def test_prune_survives_a_deep_tree_and_never_follows_a_swapped_rank_folder(tmp_path, caplog):
    """A 3,000-level tree in an old step folder made _prune's rmtree raise RecursionError after
    the commit (that rank alone failed, its peers waited); `rank0` swapped for a link between
    the check and rmtree deleted a step folder outside the store."""
    store = tmp_path / "store"
    (store / "rank0").mkdir(parents=True)
    deep = store / "rank0" / "step_0000000001"
    _deep_tree(deep, 3000)
    (store / "rank0" / "step_0000000010").mkdir()
    try:
        _pruner(store, [1, 10])(10)  # no exception
    finally:
        _remove_deep_tree(deep)
    assert "left in place" in caplog.text
    outside = tmp_path / "outside"
    (outside / "step_0000000001").mkdir(parents=True)
    (outside / "step_0000000001" / "mine.txt").write_text("mine")
    os.rename(store / "rank0", tmp_path / "old_rank0")
    (store / "rank0").symlink_to(outside, target_is_directory=True)
    _pruner(store, [1, 10])(10)
    assert (outside / "step_0000000001" / "mine.txt").read_text() == "mine"


# ----------------------------------------------------------------------- load_adapter
def _adapter_case(tmp_path, save_modules):
    from rankwise.peft import AdapterConfig, get_adapter_model, save_adapter
    from test_peft import QKV, tiny_bert

    model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=4, tau=0.05, modules_to_save=save_modules))
    save_adapter(model, tmp_path / "a")
    fresh = get_adapter_model(tiny_bert(1), AdapterConfig(QKV, r=4, tau=0.05, modules_to_save=save_modules))
    return tmp_path / "a", fresh


def _unchanged_after_refusal(fresh, directory, match):
    import torch

    from rankwise.peft import load_adapter

    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_adapter(fresh, directory)
    after = fresh.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_load_adapter_refuses_a_config_that_saves_the_base_or_a_block(tmp_path):
    """The adapter's own config added `base` to modules_to_save and shipped query.base.weight:
    it replaced the frozen W0; with modules_to_save ["layer"] (holding adapters) it changed S and
    the base weights, then raised."""
    import json

    from safetensors.torch import load_file, save_file

    d, fresh = _adapter_case(tmp_path, ["classifier"])
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["config"]["modules_to_save"] = ["classifier", "base"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    state = load_file(str(d / "adapter_model.safetensors"))
    W0 = fresh.get_submodule("bert.encoder.layer.0.attention.self.query.base").weight
    state["bert.encoder.layer.0.attention.self.query.base.weight"] = W0.detach() + 1
    save_file(state, str(d / "adapter_model.safetensors"))
    _unchanged_after_refusal(fresh, d, "modules_to_save .* differ from the model's")
    d2, block = _adapter_case(tmp_path / "b", ["layer"])
    _unchanged_after_refusal(block, d2, "is, holds or lies inside the adapted layer")


def test_load_adapter_refuses_non_finite_factors_by_name(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    d, fresh = _adapter_case(tmp_path, ["classifier"])
    state = load_file(str(d / "adapter_model.safetensors"))
    key = next(k for k in state if k.endswith(".S"))
    state[key] = state[key].clone()
    state[key][0, 0] = torch.nan
    save_file(state, str(d / "adapter_model.safetensors"))
    _unchanged_after_refusal(fresh, d, f"non-finite values .*{key}")


def test_load_adapter_puts_the_model_back_when_applying_fails(tmp_path, monkeypatch):
    """A failure after the checks (here: raised once everything was written) restores the
    factors and the saved modules as they were."""
    from rankwise.peft import _model

    d, fresh = _adapter_case(tmp_path, ["classifier"])
    apply = _model._apply

    def fails_after_writing(model, layers, state):
        apply(model, layers, state)
        raise RuntimeError("disk gone")

    monkeypatch.setattr(_model, "_apply", fails_after_writing)
    import torch

    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match="disk gone"):
        _model.load_adapter(fresh, d)
    after = fresh.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


AFTER_THE_VOTE = ("forged-commitment", "unreadable-commitment", "swapped-folder", "forged-before-the-vote")


def _after_vote(rank: int, root: str):
    """Every attack of AFTER_THE_VOTE in one world, each on a store of its own."""
    return {attack: _after_vote_one(rank, f"{root}/{attack}", attack) for attack in AFTER_THE_VOTE}


def _after_vote_one(rank: int, store: str, attack: str):
    """Rank 1's step-25 files changed between the vote and the phases after it (a rewrite, a
    disk error, a swapped folder), by a checkpointer that edits its disk once its vote is cast."""
    import shutil

    import torch
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer
    from rankwise.ckpt._serial import serialize

    def forge(path):  # a tiny commitment claiming n = 65535 parties
        import struct

        from rankwise.ckpt._format import COMMITMENT, seal

        names = b"".join(len(x).to_bytes(1, "little") + x for x in (b"sha256", b"cauchy-gf256"))
        path.write_bytes(seal(COMMITMENT, struct.pack("<HHQQB", 65535, 1, 100, 12, 0) + names))

    def state(step):
        return {"w": torch.randn(32, 24, generator=torch.Generator().manual_seed(step)), "step": step}

    class Edited(CodedCheckpointer):
        def _vote(self, *args):
            votes = super()._vote(*args)
            mine = Path(store) / "rank1" / "step_0000000025"
            if self.rank == 1 and attack == "forged-commitment":
                forge(mine / "commitment.rwck")
            if self.rank == 1 and attack == "unreadable-commitment":  # EISDIR on any re-read
                (mine / "commitment.rwck").unlink()
                (mine / "commitment.rwck").mkdir()
            if self.rank == 1 and attack == "swapped-folder":  # the step folder now a link to rank 0's
                mine.rename(mine.with_name("moved"))
                mine.symlink_to(Path(store) / "rank0" / "step_0000000025", target_is_directory=True)
            return votes

    ck = Edited(t=1, store_dir=store, keep=3)
    ck.save(state(20), 20)
    ck.save(state(25), 25)
    if rank == 1 and attack == "forged-before-the-vote":  # round 3's tiny commitment on one disk
        forge(Path(store) / "rank1" / "step_0000000025" / "commitment.rwck")
    dist.barrier()
    before = (Path(store) / "rank0" / "step_0000000025" / "fragment.rwck").read_bytes()
    dist.barrier()
    restored = ck.restore()
    dist.barrier()
    after = (Path(store) / "rank0" / "step_0000000025" / "fragment.rwck").read_bytes()
    shutil.rmtree(Path(store) / "rank1" / "moved", ignore_errors=True)
    return dict(step=restored.step, ok=serialize(restored.state) == serialize(state(25)),
                repaired=restored.repaired, skipped=restored.skipped, rank0_unchanged=before == after)


def test_what_changes_after_the_vote_costs_nothing(tmp_path):
    """Issue 49, item 2: the vote and every later phase read the same opened folder, and the
    commitment the vote read is the one sent. Before, a commitment rewritten after the vote (a
    forged n = 65535, or a re-read failing with EISDIR/EIO) became an error on every rank, and a
    step folder swapped for a link to a peer's was read through the link."""
    from distributed import run_world

    out = run_world(_after_vote, 4, tmp_path, str(tmp_path / "store"), timeout=180)
    for by_attack in out:
        for attack, r in by_attack.items():
            assert r["step"] == 25 and r["ok"] and r["skipped"] == [] and r["rank0_unchanged"], (attack, r)
            assert r["repaired"] == [], (attack, r)  # rank 1's own fragment, read where it voted from


def _forged_whole(folder: Path, block: int):
    """A commitment forged whole: consistent in itself (its fields hash to its root) for a state of
    9 blocks of `block` bytes (n = 4, t = 1, k = 3), with made-up line roots."""
    from rankwise.ckpt import _merkle
    from rankwise.ckpt._format import CODEC, Commitment, commitment_root

    roots = tuple(bytes([i]) * 32 for i in range(8))
    fields = dict(n=4, t=1, data_len=9 * block, block_size=block, hash="sha256", codec=CODEC)
    com = Commitment(**fields, line_roots=roots,
                     root=commitment_root(_merkle.get_hash("sha256"), **fields, line_roots=roots))
    _store.write(folder / _store.COMMITMENT_FILE, com)
    return com


def test_a_fragment_is_sized_and_its_header_checked_before_its_body_is_read(tmp_path, monkeypatch):
    """Issue 49, item 5: a commitment forged whole (1 GiB blocks) let `ckpt verify` read a 1.5 GiB
    sparse fragment into memory before it found no header. Now a fragment must have exactly its
    geometry's size and a header that fits it, both checked before any of its body is read."""
    from rankwise.ckpt import load_fragments

    com = _forged_whole(tmp_path, 1 << 30)
    with open(_store.fragment_path(tmp_path, 0), "wb") as f:  # sparse: costs no disk
        f.truncate(3 << 29)
    with open(_store.fragment_path(tmp_path, 1), "wb") as f:  # the exact size, but no header
        f.truncate(59 + 2 * 3 * (1 << 30))
    read = []
    real = os.readv
    monkeypatch.setattr(os, "readv", lambda fd, bufs: read.append(sum(map(len, bufs))) or real(fd, bufs))
    found, problems = load_fragments(tmp_path, com)
    assert found == {} and read == []
    assert "1,610,612,736 bytes where 6,442,451,003 are expected" in problems[0]
    assert "no rankwise magic" in problems[1]
    assert problems[2] == problems[3] == "missing"


def test_a_good_fragment_still_reads_in_every_version(tmp_path):
    from rankwise.ckpt import Code2D, load_commitment, load_fragments
    from rankwise.ckpt._format import FRAGMENT_VERSION

    disp = Code2D(4, 1, hash="sha256").encode(os.urandom(5000))
    for f in disp.fragments:  # versions 2 and 3 alternately
        version = FRAGMENT_VERSION if f.index % 2 else 2
        _store.fragment_path(tmp_path, f.index).write_bytes(f.to_bytes(version))
    _store.write(tmp_path / _store.COMMITMENT_FILE, disp.commitment)
    found, problems = load_fragments(tmp_path, load_commitment(tmp_path))
    assert problems == {} and sorted(found) == [0, 1, 2, 3]
    assert all(bytes(found[i].row) == bytes(disp.fragments[i].row) for i in range(4))
    header = bytearray(_store.fragment_path(tmp_path, 1).read_bytes())
    header[10] ^= 1  # a size byte: the header checksum (version 3) catches it before the body
    _store.fragment_path(tmp_path, 1).write_bytes(bytes(header))
    assert "header checksum" in load_fragments(tmp_path, disp.commitment)[1][1]


def _no_relaying_collective(rank: int, store: str):
    import shutil

    import torch
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer
    from rankwise.ckpt._serial import serialize

    def refused(*args, **kwargs):
        raise AssertionError("a collective that relays through third ranks was called")

    state = {"w": torch.randn(40, 30, generator=torch.Generator().manual_seed(7))}
    ck = CodedCheckpointer(t=1, store_dir=store)
    relaying = ("all_gather", "broadcast", "all_reduce", "gather", "scatter", "all_gather_object",
                "broadcast_object_list", "all_to_all")
    real = {name: getattr(dist, name) for name in relaying}
    for name in real:
        setattr(dist, name, refused)
    try:
        ck.save(state, 5)
        real["all_reduce"](torch.zeros(1))  # (a barrier of the test's own, outside the checkpointer)
        if rank == 2:
            shutil.rmtree(Path(store) / "rank2")  # rank 2 is repaired: its report travels too
        real["all_reduce"](torch.zeros(1))
        restored = ck.restore()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return serialize(restored.state) == serialize(state), restored.repaired


def test_votes_reports_and_rows_travel_over_direct_pairs_only(tmp_path):
    """Issue 49, item 7: gloo's all-gather is a ring (each rank forwards its left neighbour's
    messages) and its broadcast a binomial tree, so a bad rank in the middle could change what
    honest ranks saw of each other's votes, reports and rows. Every message of a save and a
    restore (with a repair) now goes from its sender to each receiver over their own pair: the
    relaying collectives are refused here and the restore still succeeds."""
    from distributed import run_world

    out = run_world(_no_relaying_collective, 4, tmp_path, str(tmp_path / "store"), timeout=120)
    assert out == [(True, [2])] * 4


def _on_a_subgroup(rank: int, store: str):
    import shutil

    import torch
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer
    from rankwise.ckpt._serial import serialize

    group = dist.new_group(ranks=[1, 2, 3, 4], backend="gloo")  # (collective: every rank calls it)
    if rank == 0:
        return None
    state = {"w": torch.randn(20, 10, generator=torch.Generator().manual_seed(3))}
    ck = CodedCheckpointer(t=1, store_dir=store, process_group=group)
    ck.save(state, 3)
    dist.barrier(group=group)
    if rank == 3:  # group rank 2
        shutil.rmtree(Path(store) / "rank2")
    dist.barrier(group=group)
    restored = ck.restore()
    return serialize(restored.state) == serialize(state), restored.repaired


def test_direct_pairs_address_the_ranks_of_a_subgroup(tmp_path):
    """The direct exchanges name their peers as ranks of the checkpointer's group, whose global
    ranks differ in a subgroup (here ranks 1–4 of 5)."""
    from distributed import run_world

    out = run_world(_on_a_subgroup, 5, tmp_path, str(tmp_path / "store"), timeout=120)
    assert out == [None] + [(True, [2])] * 4
