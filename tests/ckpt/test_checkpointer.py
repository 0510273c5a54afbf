"""CodedCheckpointer over real gloo process groups (spawned processes, bounded time).

Each step is one coded DCP checkpoint ``store/step_{N:010d}/rank{i}/{fragment.rwck,.metadata.rwck}``,
rank i writing only its own folder. To keep the suite cheap, one four-rank world runs every
n = 4 scenario in turn (each on its own store, or on the main store's step 3 once the damage
of the scenario before it is repaired) and returns what each rank saw; the tests below read
that record. A seven-rank world (t = 2) and a five-rank world (another world size) run apart.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from distributed import run_world
from rankwise.ckpt import CodedCheckpointer
from rankwise.ckpt._transport import Transport
from rankwise.ckpt.testing import LyingCheckpointer

FRAGMENT, META = "fragment.rwck", ".metadata.rwck"


def _state(step: int) -> dict:
    torch.manual_seed(step)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # ~120 kB with Adam's moments
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": step}


def _same(a, b) -> bool:
    """Equal structure, equal values, tensors equal bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _step(store: Path, step: int) -> Path:
    return store / f"step_{step:010d}"


def _flip(path: Path, at: float, mask: int) -> None:
    b = bytearray(path.read_bytes())
    b[int(len(b) * at)] ^= mask
    path.write_bytes(bytes(b))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class _FalseReporter(Transport):
    """A rank that serves good data but reports every peer's symbols and rows as bad, and claims
    in retrieval that it is missing rows (so that its peers would send it more)."""

    def gather(self, payload: bytes, size: int):
        if self.phase == "report":
            payload = bytes(p != self.rank for p in range(self.size))
        elif self.phase == "retrieve" and size == 1:  # the "I must decode" flag
            payload = b"\x01"
        return super().gather(payload, size)


def _restore_record(ck: CodedCheckpointer, expect: int) -> dict:
    got = ck.restore()
    state, step = got  # still unpacks as the tuple of before
    return dict(type=type(got).__name__, step=step, same_step=step == got.step,
                ok=_same(state, _state(expect)), per_rank=got.per_rank, repaired=got.repaired,
                bad_helpers=got.bad_helpers, reported=got.reported, skipped=got.skipped, stats=got.stats)


def _four(rank: int, root: str) -> dict:
    """Every n = 4, t = 1 scenario, in turn, on one world."""
    import torch.distributed as dist

    root = Path(root)
    out: dict = {}
    store = root / "main"
    ck = CodedCheckpointer(t=1, store_dir=store)

    # a fresh start: no rank holds a step
    out["fresh"] = ck.restore()

    # round trip and pruning (keep=2)
    for step in (1, 2, 3):
        ck.save(_state(step), step, per_rank={"rank": rank})
    out["saved"] = ck.stats()
    dist.barrier()
    out["steps"] = sorted(d.name for d in store.iterdir() if (d / f"rank{rank}").exists())
    out["step1_gone"] = not _step(store, 1).exists()
    mine = _step(store, 3) / f"rank{rank}"
    out["folder"] = {p.name: p.stat().st_size for p in mine.iterdir()}
    before = _files(mine)
    out["intact"] = _restore_record(ck, 3)
    w = ck.restore().state["model"]["0.weight"]
    w.add_(1.0)  # the restored tensors are ordinary writable tensors
    out["writable"] = torch.equal(w, _state(3)["model"]["0.weight"] + 1.0)

    # rank 2's disk wiped (every step), then its step-3 fragment corrupted: rebuilt from its peers
    for damage in ("wipe", "corrupt"):
        dist.barrier()
        if rank == 2 and damage == "wipe":
            for d in store.iterdir():
                shutil.rmtree(d / "rank2", ignore_errors=True)
        elif rank == 2:
            _flip(mine / FRAGMENT, 1 / 3, 0x5A)
        dist.barrier()
        out[damage] = _restore_record(ck, 3)
        out[damage]["rebuilt_identical"] = _files(mine) == before

    # a replica that diverged: only rank 0's state is written, so the save compares digests first
    try:
        ck.save(_state(4 if rank == 2 else 3), 4)
        out["diverged"] = None
    except RuntimeError as e:
        out["diverged"] = str(e)
    out["diverged_left_nothing"] = not _step(store, 4).exists()

    # rank 1 serves corrupted rows (and would serve corrupted repair symbols)
    out["liar"] = _restore_record((LyingCheckpointer if rank == 1 else CodedCheckpointer)(
        t=1, store_dir=store), 3)

    # rank 3 reports every peer as bad and asks for more rows: step 2 is there to roll back to
    out["false_reports"] = _restore_record(CodedCheckpointer(
        t=1, store_dir=store, transport=_FalseReporter if rank == 3 else Transport), 3)

    # step 25 committed on ranks 0–2 only (rank 3 lost it) and rank 1's step-25 fragment has a
    # flipped byte: 2 verified fragments < k = 3, so step 25 cannot be retrieved; step 20 can
    fb = CodedCheckpointer(t=1, store_dir=root / "fallback", keep=3)
    fb.save(_state(20), 20)
    fb.save(_state(25), 25)
    dist.barrier()
    if rank == 3:
        shutil.rmtree(_step(root / "fallback", 25) / "rank3")
    if rank == 1:
        _flip(_step(root / "fallback", 25) / "rank1" / FRAGMENT, 1 / 2, 0x40)
    dist.barrier()
    try:  # (every rank raises alike, if at all: the collectives stay in step)
        out["fallback"] = _restore_record(fb, 20)
    except Exception as e:
        out["fallback"] = {"error": f"{type(e).__name__}: {e}"}

    # saved here for the five-rank world
    CodedCheckpointer(t=1, store_dir=root / "five").save(_state(1), 1, per_rank={"rank": rank})

    # two ranks' disks wiped (> t): every rank raises the same clear error
    dist.barrier()
    if rank in (1, 2):
        for d in store.iterdir():
            shutil.rmtree(d / f"rank{rank}", ignore_errors=True)
    dist.barrier()
    try:
        ck.restore()
        out["too_many"] = None
    except RuntimeError as e:
        out["too_many"] = str(e)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    return root, run_world(_four, 4, root, str(root), timeout=240)


def test_fresh_start_restores_nothing(four):
    _, out = four
    assert [r["fresh"] for r in out] == [None] * 4


def test_round_trip_and_pruning(four):
    _, out = four
    for rank, r in enumerate(out):
        i = r["intact"]
        assert i["type"] == "Restored" and i["ok"] and i["step"] == 3 and i["same_step"] and r["writable"]
        assert i["per_rank"] == {"rank": rank} and i["skipped"] == []
        assert i["repaired"] == [] and i["stats"]["repair_bytes_received"] == 0
        assert i["bad_helpers"] == [] and i["reported"] == {}
        assert i["stats"]["op"] == "restore" and i["stats"]["seconds"] > 0
        assert r["steps"] == ["step_0000000002", "step_0000000003"]  # keep=2: this rank's step 1 removed
        assert r["step1_gone"]  # (the last rank's folder gone, the step's folder too)
        assert sorted(r["folder"]) == sorted([FRAGMENT, META])


def test_each_rank_stores_about_2m_over_k(four):
    """Rank r's ``step_*/rank{r}`` folder holds its row and column of the grid: 2|m|/k bytes
    (|m| = every rank's share of the checkpoint, rounded up to k² blocks) and a small metadata
    file, the same bytes on every rank."""
    _, out = four
    k = 3
    for r in out:
        s = r["saved"]
        m, frag, meta = s["data_len"], r["folder"][FRAGMENT], r["folder"][META]
        assert s["op"] == "save" and s["step"] == 3 and (s["state_bytes"] or 0) <= m  # (rank 0 writes it)
        assert s["data_len"] == out[0]["saved"]["data_len"] and meta == out[0]["folder"][META]
        assert 2 * m / k <= frag < 2 * m / k + 2 * k + 200  # block rounding, header
        assert meta < 0.05 * m


def _extras_bytes(n: int) -> int:
    import io

    total = 0
    for rank in range(n):
        buf = io.BytesIO()
        torch.save({"rank": rank}, buf)
        total += len(buf.getvalue())
    return total


def test_the_coded_checkpoint_is_the_state_and_extras_not_an_inflated_copy(four):
    """|m| is the serialised state plus every rank's extras (and a few kB of framing per entry),
    so a rank stores, and a rebuilt rank receives, about 2/k of it: less than a replica."""
    _, out = four
    plain = out[0]["saved"]["state_bytes"] + _extras_bytes(4)
    for r in out:
        assert r["saved"]["data_len"] <= 1.02 * plain + 5 * 2048
        assert r["folder"][FRAGMENT] + r["folder"][META] < 0.75 * plain  # 2/3 and framing
    assert out[2]["wipe"]["stats"]["repair_bytes_received"] < 0.75 * plain


@pytest.mark.parametrize("damage", ["wipe", "corrupt"])
def test_lost_or_corrupted_fragment_is_repaired_from_peers(four, damage):
    _, out = four
    st = out[2][damage]["stats"]
    for r in out:
        d = r[damage]
        assert d["ok"] and d["step"] == 3 and d["repaired"] == [2] and d["bad_helpers"] == []
        assert d["per_rank"] == {"rank": out.index(r)}
    assert out[2][damage]["rebuilt_identical"]  # its folder rebuilt byte for byte
    k, d, B = 3, 3, st["block_size"]
    assert st["data_len"] <= k * k * B < st["data_len"] + k * k
    assert st["helpers"] == [0, 1, 3]  # k helpers
    helpers_sent = [out[h][damage]["stats"]["repair_bytes_sent"] for h in (0, 1, 3)]
    assert sum(helpers_sent) == st["repair_bytes_received"] and min(helpers_sent) > 0
    payload = 2 * d * B  # = 2d|m|/k² = 2|m|/k (|m| rounded up to k² blocks)
    assert st["repair_bytes_received"] == payload  # raw blocks, checked against the leaf hashes
    assert st["repair_bytes_received"] < 0.7 * st["data_len"]  # 2/3 of a full download of m here
    assert all(r[damage]["stats"]["repair_bytes_received"] == 0 for i, r in enumerate(out) if i != 2)


def test_a_lying_systematic_row_is_named_by_every_rank_and_replaced_by_the_parity_row(four):
    """Rank 1 serves corrupted blocks of its row C[1, :]: the three others verify them, report and
    name it (3 > t reports), and decode each from its column's blocks of the other rows; rank 1
    reads its own blocks, intact on its disk."""
    _, out = four
    R = 3 * out[0]["liar"]["stats"]["block_size"]  # a row: k blocks
    for r in out:
        li = r["liar"]
        assert li["ok"] and li["step"] == 3 and li["skipped"] == [] and li["repaired"] == []
        assert li["bad_helpers"] == [1] and li["reported"] == {1: [0, 2, 3]}
    got = [r["liar"]["stats"]["retrieve_bytes_received"] for r in out]
    # the honest ranks receive the blocks holding their items and, for each of rank 1's blocks among
    # them, that column's blocks from the other holders; rank 1 reads its own blocks from its disk
    assert got[1] < min(got[0], got[2], got[3]) and max(got) <= 4 * R, got


def test_false_reports_neither_roll_back_nor_name_honest_ranks(four):
    """Rank 3 reports everyone: a rank is named only when more than t ranks report it, and no
    report makes the group skip a step (step 2 is on every disk to roll back to)."""
    _, out = four
    R = 3 * out[0]["false_reports"]["stats"]["block_size"]
    for r in out:
        f = r["false_reports"]
        assert f["ok"] and f["step"] == 3 and f["skipped"] == [], f
        assert f["bad_helpers"] == [] and f["reported"] == {0: [3], 1: [3], 2: [3]}
        assert f["stats"]["retrieve_bytes_received"] <= 3 * R  # its claim cost no one a row more


def test_restore_falls_back_to_an_older_step_when_the_newest_cannot_be_retrieved(four):
    """Issue 41, attack 4: step 20, intact on every disk, is restored when step 25 (held by a
    quorum, but with two bad fragments > t) cannot be retrieved."""
    _, out = four
    for r in out:
        fb = r["fallback"]
        assert "error" not in fb, fb["error"][-600:]
        assert fb["ok"] and fb["step"] == 20
        assert [s for s, _ in fb["skipped"]] == [25] and "needs 3 verified" in fb["skipped"][0][1]


def test_too_many_losses_fail_clearly_on_every_rank(four):
    _, out = four
    assert all(r["too_many"] is not None and "no checkpoint step is held by 3 ranks" in r["too_many"]
               for r in out), [r["too_many"] for r in out]


def _restore_five(rank: int, store: str):
    try:
        got = CodedCheckpointer(t=1, store_dir=store).restore()
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return None if got is None else (got.step, _same(got.state, _state(1)), got.per_rank)


def test_restart_with_another_world_size_fails_the_same_way_on_every_rank(four):
    """Saved by 4 ranks, restored by 5: no rank may be left waiting in a collective; each raises
    the same clear error (rank 4 has no per-rank extras in a four-rank checkpoint)."""
    root, _ = four
    out = run_world(_restore_five, 5, root, str(root / "five"), timeout=120)
    assert all(isinstance(r, str) for r in out), out
    assert len({r.splitlines()[0] for r in out}) == 1, out
    assert "saved by 4 ranks and this world has 5" in out[0], out


def _seven(rank: int, store: str):
    ck = (LyingCheckpointer if rank == 5 else CodedCheckpointer)(t=2, store_dir=store)
    ck.save(_state(3), 3, per_rank=rank)
    import torch.distributed as dist

    dist.barrier()
    if rank == 3:
        shutil.rmtree(_step(Path(store), 3) / "rank3")
    dist.barrier()
    return _restore_record(ck, 3)


def test_n7_t2_a_lying_helper_is_detected_reported_and_excluded(tmp_path):
    """n = 7, t = 2: rank 3 lost its folder and rank 5 serves corrupted symbols and rows; the
    other five helpers are enough (k = 5). Only rank 3 sees rank 5's symbols, and rank 5's parity
    row is never needed for retrieval: one report, so rank 5 is recorded as reported by rank 3,
    not named (that takes more than t reports)."""
    out = run_world(_seven, 7, tmp_path, str(tmp_path / "store"), timeout=240)
    for rank, r in enumerate(out):
        assert r["ok"] and r["step"] == 3 and r["per_rank"] == rank and r["repaired"] == [3]
        assert r["reported"] == {5: [3]} and r["bad_helpers"] == []
        assert r["stats"]["n"] == 7 and r["stats"]["k"] == 5
    assert out[3]["stats"]["helpers"] == [0, 1, 2, 4, 5, 6]  # k = 5; rank 6 once rank 5's symbols failed
    assert out[3]["stats"]["repair_bytes_received"] > 0


def test_a_save_of_diverged_replicas_fails_on_every_rank_naming_them(four):
    _, out = four
    for r in out:
        assert r["diverged"] is not None, r
        assert "ranks grouped by state digest: [[0, 1, 3], [2]]" in r["diverged"]
        assert r["diverged_left_nothing"]


def _silent(rank: int, root: str) -> tuple:
    import time

    ck = CodedCheckpointer(t=1, store_dir=Path(root) / "silent", join_timeout=2.0)
    ck.save(_state(3), 3)
    if rank == 1:  # a data rank (k = 3: ranks 0–2 hold M's rows): alive, silent past the deadline
        time.sleep(8)
        try:
            ck.restore()
        except RuntimeError as e:
            return ("late", str(e))
        return ("restored",)
    t0 = time.monotonic()
    rec = _restore_record(ck, 3)
    return ("ok", rec["ok"], rec["stats"]["absent"], time.monotonic() - t0)


def test_a_silent_rank_costs_its_vote_only(tmp_path):
    """A rank that stays alive but does not join a restore: after `join_timeout` (2 s here; the
    group's timeout is 60 s) the three that joined restore the state bitwise without it (its row
    decoded from their columns); joining later, it raises naming the ranks that went on."""
    out = run_world(_silent, 4, tmp_path, str(tmp_path), timeout=120)
    for r in (0, 2, 3):
        tag, ok, absent, seconds = out[r]
        assert (tag, ok, absent) == ("ok", True, [1])
        assert seconds < 30  # not the group's 60 s timeout
    assert out[1][0] == "late" and "joined after" in out[1][1] and "[0, 2, 3]" in out[1][1]
