"""One bad location or rank out of n never runs code, never changes the restored state and never
stops a restore (CodedCheckpointer and the coded DCP storage, gloo ranks in spawned processes).

The checkpoint is the one layout ``store/step_{N:010d}/rank{i}/{fragment.rwck,.metadata.rwck}``;
a bad rank lies through the :class:`rankwise.ckpt._transport.Transport` it talks through. To keep
the suite cheap one world per geometry (n = 4, t = 1 and n = 7, t = 2) runs every scenario of
this file in turn, each on its own store, and returns what each rank saw; the tests read that
record. Every scenario runs on a side group of its own with a short timeout, so that one that
leaves a rank waiting fails in seconds and the next one starts in step.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from distributed import fresh_side_group, run_world
from rankwise.ckpt import Code2D, Commitment, _format
from rankwise.ckpt._format import commitment_root
from rankwise.ckpt._merkle import get_hash
from rankwise.ckpt._transport import Transport

MARKER = "pwned"  # a folder the planted pickles create when (and only when) they are unpickled
FRAGMENT, META = "fragment.rwck", ".metadata.rwck"
SIDE_TIMEOUT = 10.0  # seconds a scenario's collectives wait for a silent rank


class _Plant:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def _pickle(marker: str) -> bytes:
    return pickle.dumps({"state": _Plant(marker)})


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(60, 40), "step": step, "rng": torch.get_rng_state()}


def _same(state, step: int) -> bool:
    want = _state(step)
    return (isinstance(state, dict) and state.keys() == want.keys() and torch.equal(state["w"], want["w"])
            and state["step"] == step and torch.equal(state["rng"], want["rng"]))


def _step(store: Path, step: int) -> Path:
    return Path(store) / f"step_{step:010d}"


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


def _doc(folder: Path) -> dict:
    from rankwise.ckpt._store import read_metadata

    return json.loads(read_metadata(folder / META))


def _sealed(doc: dict) -> bytes:
    """A metadata file holding `doc`, sealed anew (a valid checksum)."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return _format.seal(_format.METADATA, body)


def _with_commitment(doc: dict, raw: bytes, *, roots: bool) -> dict:
    """`doc` holding the commitment `raw`; with `roots`, its storage entries name that
    commitment's root too (a forgery consistent in itself)."""
    out = dict(doc, commitment=raw.hex())
    if roots:
        root = raw[-64:-32].hex()  # (a sealed commitment ends with its 32-byte root and checksum)
        out["storage_data"] = [[key, [*where[:3], root]] for key, where in doc["storage_data"]]
    return out


def _attacks(mine: Path, other: Path, marker: str) -> dict[str, dict[str, bytes]]:
    """What one bad location (a rank's folder of a step) holds instead of its files, per attack;
    `other` is the same rank's folder of another checkpoint."""
    doc = _doc(mine)
    com = Commitment.from_bytes(bytes.fromhex(doc["commitment"]))
    frag = (mine / FRAGMENT).read_bytes()
    planted = _pickle(marker)
    entries = doc["storage_data"]  # two entries' places exchanged: each reads the other's bytes
    swapped = dict(doc, storage_data=[[entries[0][0], entries[1][1]], [entries[1][0], entries[0][1]],
                                      *entries[2:]])
    out = {
        "pickle in the metadata": {META: planted},
        "pickle sealed as metadata": {META: _format.seal(_format.METADATA, planted)},
        "pickle in the fragment": {FRAGMENT: planted},
        "pickle sealed as a fragment": {FRAGMENT: _format.seal(_format.FRAGMENT, planted)},
        "files of another checkpoint": {f: (other / f).read_bytes() for f in (FRAGMENT, META)},
        "metadata of another checkpoint": {META: (other / META).read_bytes()},
        "entries swapped, re-sealed": {META: _sealed(swapped)},
        "garbage": {META: os.urandom(300), FRAGMENT: os.urandom(len(frag))},
    }
    for field, value in (("data_len", com.data_len - 1), ("data_len", com.data_len + 1),
                         ("block_size", com.block_size + 1), ("t", com.t + 1), ("hash", "sha256"),
                         ("codec", "xor"), ("version", 1)):
        for keep in (True, False):
            raw = _reseal(com, **{field: value, "keep_root": keep})
            out[f"{field}={value!r} re-sealed, root {'kept' if keep else 'recomputed'}"] = {
                META: _sealed(_with_commitment(doc, raw, roots=not keep))}
    return out


def _restored(ck, expect: int) -> dict:
    """What a restore gave this rank, or its error (caught, so that every rank goes on to the
    scenario's next barrier alike)."""
    try:
        got = ck.restore()
    except BaseException as e:  # (a CheckpointException is a BaseException)
        return {"error": f"{type(e).__name__}: {e}"[-800:]}
    if got is None:
        return {"error": "no step to restore"}
    return dict(step=got.step, ok=_same(got.state, expect), repaired=got.repaired, skipped=got.skipped,
                reported=got.reported, bad_helpers=got.bad_helpers)


# ---------------------------------------------------------------------- scenarios (one world each)
def _bad_location(rank: int, store: Path, marker: str, t: int) -> dict:
    """Rank 0's folder of step 3 replaced, attack after attack, by what _attacks lists; then every
    rank's step-3 metadata holding a format-1 commitment (a format never read)."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    ck = CodedCheckpointer(t=t, store_dir=store)
    ck.save(_state(2), 2)
    ck.save(_state(3), 3)
    mine = _step(store, 3) / f"rank{rank}"
    pristine = store / f"pristine{rank}"
    shutil.copytree(mine, pristine / "3")
    shutil.copytree(_step(store, 2) / f"rank{rank}", pristine / "2")
    dist.barrier()
    attacks = _attacks(pristine / "3", pristine / "2", marker)
    results = {}
    for name in attacks:
        if rank == 0:
            for f, data in attacks[name].items():
                (mine / f).write_bytes(data)
        dist.barrier()
        results[name] = _restored(ck, 3)
        dist.barrier()
        shutil.rmtree(mine)
        shutil.copytree(pristine / "3", mine)
        dist.barrier()
    # every rank's copy holding a format-1 commitment (root over the line roots only: its header is
    # not bound), self-consistent: format 1 is not read, so the restore falls back to step 2
    doc = _doc(mine)
    c = Commitment.from_bytes(bytes.fromhex(doc["commitment"]))
    (mine / META).write_bytes(_sealed(_with_commitment(doc, _reseal(c, version=1), roots=True)))
    dist.barrier()
    results["format 1 checkpoint"] = _restored(ck, 2)
    return results


def _symbols_announcing_a_tib(helper: int, target: int, size: int, marker: str) -> bytes:
    """Repair symbols whose header (with a valid header checksum) announces 2⁴⁰-byte blocks, a
    pickle after it, in a message of the expected `size`."""
    import hashlib
    import struct

    meta = (struct.pack("<4sHB", _format.MAGIC, _format.FRAGMENT_VERSION, _format.SYMBOLS)
            + struct.pack("<IIQBHH", helper, target, 1 << 40, 32, 1, 1) + bytes(64))
    return (meta + hashlib.sha256(meta).digest() + _pickle(marker)).ljust(size, b"\0")[:size]


def _lying_rank(rank: int, store: Path, marker: str, t: int) -> dict:
    """Rank 3 lost its disk; rank 0, a holder of the metadata, sends rank 3 a pickle as its copy
    and, as a helper, symbols announcing a 1 TiB block."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    class Liar(Transport):
        def swap(self, sends, recvs):
            if self.phase == "agree":
                sends = {p: _pickle(marker).ljust(len(b), b"\0") for p, b in sends.items()}
            elif self.phase == "repair":
                sends = {p: _symbols_announcing_a_tib(self.rank, p, len(memoryview(b).cast("B")), marker)
                         for p, b in sends.items()}
            super().swap(sends, recvs)

    ck = CodedCheckpointer(t=t, store_dir=store, transport=Liar if rank == 0 else Transport)
    ck.save(_state(5), 5)
    dist.barrier()
    if rank == 3:
        shutil.rmtree(_step(store, 5) / "rank3")
    dist.barrier()
    return _restored(ck, 5)


def _accusing_target(rank: int, store: Path, liar: int, t: int) -> dict:
    """The last rank claims its fragment is bad (so it is repaired) and then reports every
    helper's symbols as bad."""
    from rankwise.ckpt import CodedCheckpointer

    class Accuser(Transport):
        def gather(self, payload, size):
            if self.phase == "check" and size == 1:
                payload = b"\x00"
            elif self.phase == "report":
                payload = bytes(p != self.rank for p in range(self.size))
            return super().gather(payload, size)

    ck = CodedCheckpointer(t=t, store_dir=store, transport=Accuser if rank == liar else Transport)
    ck.save(_state(5), 5)
    return _restored(ck, 5)


def _forged_metadata(rank: int, store: Path, t: int) -> dict:
    """Rank 0 (the lowest holder) rewrites its step-5 metadata: the commitment's data_len cut short
    (or, where no shorter length has the same block size, made longer) with its root kept,
    re-sealed."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    ck = CodedCheckpointer(t=t, store_dir=store)
    ck.save(_state(5), 5)
    dist.barrier()
    path = _step(store, 5) / f"rank{rank}" / META
    honest = path.read_bytes()
    if rank == 0:
        doc = _doc(path.parent)
        com = Commitment.from_bytes(bytes.fromhex(doc["commitment"]))
        k = com.n - com.t
        cut = com.data_len - 1 if com.data_len - 1 > (com.block_size - 1) * k * k else com.data_len + 1
        path.write_bytes(_sealed(_with_commitment(doc, _reseal(com, data_len=cut, keep_root=True),
                                                  roots=False)))
    dist.barrier()
    r = _restored(ck, 5)
    dist.barrier()
    return dict(r, holds_the_honest_copy=path.read_bytes() == honest)


class _LyingSaver(Transport):
    """A bad writer: while `lie` is set, it sends other leaf hashes for its lines than it computed
    ("row": its whole row; "diagonal": only block P[r, r], in its row and its column alike, which
    no peer holds)."""

    lie: str | None = None

    def gather(self, payload, size):
        if self.phase == "encode" and self.lie and size == len(payload) == 2 * self.size * 32:
            n, d = self.size, 32  # (the gather of every rank's 2n leaves)
            leaves = [payload[i * d:(i + 1) * d] for i in range(2 * n)]
            bogus = bytes(range(d))
            if self.lie == "row":
                leaves[:n] = [bogus] * n
            else:
                leaves[self.rank] = leaves[n + self.rank] = bogus
            payload = b"".join(leaves)
        return super().gather(payload, size)


def _lying_saver(rank: int, store: Path, liar: int, t: int, lie: str) -> dict:
    from torch.distributed.checkpoint.api import CheckpointException

    from rankwise.ckpt import CodedCheckpointer

    ck = CodedCheckpointer(t=t, store_dir=store, transport=_LyingSaver if rank == liar else Transport)
    ck.save(_state(5), 5)
    _LyingSaver.lie = lie
    try:
        ck.save(_state(6), 6)
        error = None
    except (RuntimeError, CheckpointException) as e:
        error = str(e)
    _LyingSaver.lie = None
    try:
        got = ck.restore()
    except BaseException as e:
        return dict(error=error, restore_error=f"{type(e).__name__}: {e}"[-800:])
    return dict(error=error, step=got.step, ok=_same(got.state, got.step), repaired=got.repaired,
                skipped=got.skipped)


RELAYING = ("all_gather", "broadcast", "all_reduce", "gather", "scatter", "all_to_all", "reduce_scatter",
            "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def _no_relaying_collective(rank: int, store: Path) -> dict:
    """A save and a restore (rank 2's folder wiped: it is repaired, and reports) with every
    collective that relays through third ranks, or pickles, refused on every rank."""
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    def refused(*args, **kwargs):
        raise AssertionError("a collective that relays through third ranks (or pickles) was called")

    ck = CodedCheckpointer(t=1, store_dir=store)
    real = {name: getattr(dist, name) for name in RELAYING}
    for name in real:
        setattr(dist, name, refused)
    try:
        try:
            ck.save(_state(5), 5)
            saved = None
        except BaseException as e:
            saved = f"{type(e).__name__}: {e}"[-300:]
        dist.barrier()  # (the test's own; a barrier relays nothing)
        if rank == 2:
            shutil.rmtree(_step(store, 5) / "rank2", ignore_errors=True)
        dist.barrier()
        got = _restored(ck, 5)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return dict(got, save_error=saved)


def _pickled_plan(rank: int, store: Path, marker: str) -> dict:
    """Rank 3 sends a pickle in place of every object it hands torch's object collectives (its
    save plan first): what a bad rank can put on the wire outside the Transport."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.checkpoint.api import CheckpointException

    from rankwise.ckpt import CodedCheckpointer

    ck = CodedCheckpointer(t=1, store_dir=store)
    real = c10d._object_to_tensor
    if rank == 3:
        c10d._object_to_tensor = lambda obj, device, group: real(_Plant(marker), device, group)
    try:
        ck.save(_state(5), 5)
        error = None
    except (RuntimeError, CheckpointException) as e:
        error = type(e).__name__
    finally:
        c10d._object_to_tensor = real
    return {"error": error}


def _world(rank: int, root: str, n: int, t: int, marker: str) -> dict:
    root_ = Path(root)
    scenarios = {
        "bad_location": lambda: _bad_location(rank, root_ / "location", marker, t),
        "accusing_target": lambda: _accusing_target(rank, root_ / "accusing", n - 1, t),
        "forged_metadata": lambda: _forged_metadata(rank, root_ / "forged", t),
        "saver_row": lambda: _lying_saver(rank, root_ / "row", 1, t, "row"),
        "saver_diagonal": lambda: _lying_saver(rank, root_ / "diagonal", 1, t, "diagonal"),
    }
    if n == 7:
        scenarios["lying_rank"] = lambda: _lying_rank(rank, root_ / "lying", marker, t)
    if n == 4:  # (the last: a pickle the coordinator runs may leave its state as it likes)
        scenarios["direct_pairs"] = lambda: _no_relaying_collective(rank, root_ / "direct")
        scenarios["pickled_plan"] = lambda: _pickled_plan(rank, root_ / "plan", f"{marker}-plan")
    out = {}
    for name, run in scenarios.items():
        fresh_side_group(SIDE_TIMEOUT)
        try:
            out[name] = run()
        except BaseException as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"[-800:]}
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """n -> (the marker path, each rank's record), each world run once, when first asked for."""
    runs: dict[int, tuple[Path, list]] = {}

    def get(n: int, t: int):
        if n not in runs:
            root = tmp_path_factory.mktemp(f"n{n}")
            marker = root / MARKER
            runs[n] = marker, run_world(_world, n, root, str(root), n, t, str(marker), timeout=420)
        return runs[n]

    return get


GEOMETRIES = [(4, 1), (7, 2)]


@pytest.mark.parametrize("n,t", GEOMETRIES)
def test_one_bad_location_never_runs_code_changes_state_or_stops_a_restore(worlds, n, t):
    marker, out = worlds(n, t)
    assert not marker.exists(), "a planted pickle ran"
    names = [x for x in out[0]["bad_location"] if x != "format 1 checkpoint"]
    assert len(names) == 22, out[0]["bad_location"]
    for r in out:
        for name in names:
            got = r["bad_location"][name]
            assert "error" not in got, (name, got)
            assert got["step"] == 3 and got["ok"] and got["skipped"] == [], (name, got)
            assert got["repaired"] in ([], [0]), (name, got)
    # a rewritten or foreign fragment is rebuilt from the peers; a bad metadata copy costs a vote
    at = out[1]["bad_location"]
    assert at["pickle in the fragment"]["repaired"] == [0]
    assert at["files of another checkpoint"]["repaired"] == [0]
    assert at["pickle in the metadata"]["repaired"] == at[f"t={t + 1} re-sealed, root kept"]["repaired"] == []


@pytest.mark.parametrize("n,t", GEOMETRIES)
def test_a_format_1_checkpoint_is_never_read_and_the_restore_falls_back(worlds, n, t):
    """Format 1 does not bind its header to its root: a checkpoint whose every copy holds one is
    not read (a downgrade costs the step, never a rewritten header), and the older step restores."""
    _, out = worlds(n, t)
    for r in out:
        got = r["bad_location"]["format 1 checkpoint"]
        assert "error" not in got, got
        assert got["step"] == 2 and got["ok"], got
        assert [s for s, _ in got["skipped"]] == [3] and "format version 1" in got["skipped"][0][1], got


def test_one_lying_rank_is_reported_and_excluded_and_runs_no_code(worlds):
    """n = 7, t = 2: rank 3 lost its disk; rank 0, a holder of the metadata, sends a pickle as its
    copy and, as a helper, symbols announcing a 1 TiB block. Nothing is unpickled or allocated
    from them; rank 3's report against rank 0 is recorded; the state restores on every rank."""
    marker, out = worlds(7, 2)
    assert not marker.exists()
    for r in out:
        got = r["lying_rank"]
        assert "error" not in got, got
        assert got["step"] == 5 and got["ok"] and got["repaired"] == [3], got
        # its symbols were bad, but only rank 3 saw them: reported by one rank, named by none
        # (t = 2; its rows were good, so retrieval had nothing against it)
        assert got["reported"] == {0: [3]} and got["bad_helpers"] == [], got


@pytest.mark.parametrize("n,t", GEOMETRIES)
def test_a_repair_target_that_accuses_every_helper_gets_no_honest_rank_named(worlds, n, t):
    _, out = worlds(n, t)
    liar = n - 1
    honest = [r for r in range(n) if r != liar]
    for r in out:
        got = r["accusing_target"]
        assert "error" not in got, got
        assert got["step"] == 5 and got["ok"] and got["repaired"] == [liar], got
        assert got["bad_helpers"] == []  # one rank's word names nobody
        assert got["reported"] == {h: [liar] for h in honest}  # but what it said is on record


@pytest.mark.parametrize("n,t", GEOMETRIES)
def test_a_forged_commitment_is_outvoted_and_never_copied_to_honest_disks(worlds, n, t):
    """The lowest holder's copy cut short with its root kept (format 1's downgrade, re-sealed):
    outvoted; its disk gets the quorum's copy back and no honest disk is rewritten."""
    _, out = worlds(n, t)
    for r in out:
        got = r["forged_metadata"]
        assert "error" not in got, got
        assert got["step"] == 5 and got["ok"] and got["skipped"] == [], got
        assert got["holds_the_honest_copy"]


@pytest.mark.parametrize("n,t", GEOMETRIES)
def test_a_saver_lying_about_its_line_fails_the_save_and_the_previous_step_restores(worlds, n, t):
    _, out = worlds(n, t)
    for r in out:
        got = r["saver_row"]
        assert got["error"] is not None, got
        assert "disagree with their peers about blocks of the grid" in got["error"], got
        assert "restore_error" not in got, got
        assert got["step"] == 5 and got["ok"], got  # the previous step is the newest, and restores


@pytest.mark.parametrize("n,t", GEOMETRIES)
def test_a_saver_lying_about_its_line_is_named_alone(worlds, n, t):
    _, out = worlds(n, t)
    for r in out:
        said = r["saver_row"]["error"] or ""
        assert "rank(s) [1] disagree with their peers" in said, r["saver_row"]


@pytest.mark.parametrize("n,t", GEOMETRIES)
def test_a_saver_lying_where_no_peer_can_check_leaves_a_restorable_step(worlds, n, t):
    """The one block no peer hashes, P[r, r], forged in both of rank r's lines: the save
    commits, rank r's own fragment then fails its line, its rebuild fails too, and every rank
    (rank r included) restores from the k rows that verify."""
    _, out = worlds(n, t)
    for r in out:
        got = r["saver_diagonal"]
        assert got["error"] is None and "restore_error" not in got, got
        assert got["step"] == 6 and got["ok"] and got["skipped"] == [], got


def test_votes_reports_and_rows_travel_over_direct_pairs_only(worlds):
    """Issue 49, item 7: gloo's all-gather is a ring (each rank forwards its left neighbour's
    messages) and its broadcast a binomial tree, so a bad rank in the middle could change what
    honest ranks saw of each other's votes, reports and rows. Every message of a save and a
    restore (with a repair) is to go from its sender to each receiver over their own pair: the
    relaying (and pickling) collectives are refused here and the save and restore still succeed."""
    _, out = worlds(4, 1)
    for r in out:
        got = r["direct_pairs"]
        assert got["save_error"] is None and "error" not in got, got
        assert got["ok"] and got["step"] == 5 and got["repaired"] == [2], got


def test_a_rank_that_sends_a_pickle_in_place_of_its_plan_runs_no_code_on_its_peers(worlds):
    """Nothing a peer sends is unpickled: a bad rank's save plan replaced by a planted pickle
    (the object collectives' own framing, a valid pickle) must not run on the coordinator. The
    checkpointer runs DCP without its object collectives (``no_dist``): the plans never travel,
    the save succeeds, and the planted object is never unpickled."""
    marker, out = worlds(4, 1)
    assert all(r["pickled_plan"]["error"] is None for r in out), out
    assert not Path(f"{marker}-plan").exists(), "the coordinator unpickled rank 3's plan"


@pytest.mark.parametrize("field", ["data_len", "block_size", "t", "hash", "codec"])
def test_every_header_field_is_bound_to_the_root(field):
    """Changing any field decoding uses, even by re-sealing the file, breaks the root (and
    recomputing the root gives another root, which the vote of the k honest ranks outweighs)."""
    code = Code2D(4, 1)
    c = code.encode(os.urandom(5000)).commitment
    changed = {"data_len": c.data_len - 1, "block_size": c.block_size + 1, "t": 2, "hash": "sha256",
               "codec": "xor"}[field]
    forged = Commitment.from_bytes(_reseal(c, **{field: changed, "keep_root": True}))
    with pytest.raises(ValueError, match=r"inconsistent|this code is"):
        code._check(forged)
    recomputed = Commitment.from_bytes(_reseal(c, **{field: changed}))
    assert recomputed.root != c.root


@pytest.mark.parametrize("version", [1, 3])
def test_a_commitment_of_another_format_version_is_refused_even_resealed(version):
    c = Code2D(4, 1).encode(os.urandom(5000)).commitment
    for keep in (True, False):
        with pytest.raises(ValueError, match=f"format version {version}, this rankwise reads"):
            Commitment.from_bytes(_reseal(c, version=version, keep_root=keep))


# ---------------------------------------------------------------------- DCP storage, read alone
def _dcp_sd(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"a": torch.randn(6, 5), "b": torch.randn(6, 5), "step": seed}


def _dcp_fresh() -> dict:
    return {"a": torch.zeros(6, 5), "b": torch.zeros(6, 5), "step": -1}


def test_one_bad_dcp_folder_never_runs_code_or_changes_the_state(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from rankwise.ckpt import CodedStorageReader, CodedStorageWriter

    warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
    ck, other = tmp_path / "ck", tmp_path / "other"  # n = 4, t = 1, one process writing every folder
    dcp.save(_dcp_sd(1), storage_writer=CodedStorageWriter(ck, t=1, n=4))
    dcp.save(_dcp_sd(2), storage_writer=CodedStorageWriter(other, t=1, n=4))
    doc = _doc(ck / "rank0")
    entries = {e[0][0]: e for e in doc["storage_data"]}
    swapped = dict(doc)  # a and b's storage entries exchanged, re-sealed: same shapes, wrong data
    swapped["storage_data"] = [[entries["a"][0], entries["b"][1]], [entries["b"][0], entries["a"][1]]] + [
        e for e in doc["storage_data"] if e[0][0] not in ("a", "b")]
    marker = str(tmp_path / MARKER)
    planted = _pickle(marker)
    import hashlib

    attacks = {
        "pickled metadata (format 1)": {META: b"RWDCPMD1" + hashlib.sha256(planted).digest() + planted},
        "entries swapped, re-sealed": {META: _sealed(swapped)},
        "metadata of another checkpoint": {META: (other / "rank0" / META).read_bytes()},
        "another checkpoint's files": {f: (other / "rank0" / f).read_bytes() for f in (META, FRAGMENT)},
        "pickles in the fragment and metadata": {FRAGMENT: planted, META: planted},
        "pickle sealed as metadata": {META: _format.seal(_format.METADATA, planted)},
        "garbage": {META: os.urandom(500), FRAGMENT: os.urandom(400)},
    }
    pristine = {f.name: f.read_bytes() for f in (ck / "rank0").iterdir()}
    for name, files in attacks.items():
        for f, data in files.items():
            (ck / "rank0" / f).write_bytes(data)
        got = _dcp_fresh()
        reader = CodedStorageReader(ck)
        dcp.load(got, storage_reader=reader)
        want = _dcp_sd(1)
        assert got["step"] == 1 and torch.equal(got["a"], want["a"]), name
        assert torch.equal(got["b"], want["b"]), name
        assert "rank0" in reader.skipped, (name, reader.skipped)  # the bad folder is named
        for f, data in pristine.items():
            (ck / "rank0" / f).write_bytes(data)
    assert not Path(marker).exists()
