"""CodedCheckpointer.save(blocking=False): a snapshot, a future, one save in flight, training
collectives running meanwhile, a crash during the background write, a background failure on one
rank, and fit() resuming bitwise from background checkpoints (gloo ranks).

To keep the suite cheap, the scenarios that need a world after another has run (a crash, a lost
training run) share one four-rank world that runs after them (``world``)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from distributed import run_world
from rankwise.ckpt import CodedCheckpointer
from rankwise.ckpt._transport import Transport


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(200, 100), "b": torch.randn(100), "step": step}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _step(store: Path, step: int) -> Path:
    return store / f"step_{step:010d}"


class _SlowEncode(Transport):
    """A slow network or disk: each save's first message waits 0.5 s."""

    def gather(self, payload: bytes, size: int):
        if self.phase == "encode" and not getattr(self, "_slept", False):
            self._slept = True
            time.sleep(0.5)
        return super().gather(payload, size)


def _async_round_trip(rank: int, store: Path) -> dict:
    import torch.distributed as dist

    ck = CodedCheckpointer(t=1, store_dir=store, transport=_SlowEncode)
    state = _state(1)
    t0 = time.perf_counter()
    f1 = ck.save(state, 1, blocking=False)
    returned_after, done_on_return = time.perf_counter() - t0, f1.done()
    state["w"].zero_()  # training changes the weights at once: the snapshot was taken before
    x = torch.ones(8)
    for _ in range(20):  # training's own collectives, on the default group, meanwhile
        dist.all_reduce(x)
    f2 = ck.save(_state(2), 2, blocking=False)  # waits for the first
    first_done_before_second = f1.done()
    f2.result()
    stats = ck.stats()
    got, step = ck.restore()
    ck.close()
    out = dict(future=isinstance(f1, Future) and isinstance(f2, Future), x=float(x[0]),
               first_done=first_done_before_second, step=step, done_on_return=done_on_return,
               returned_after=returned_after, same=_same(got, _state(2)), blocked=stats["blocked_seconds"],
               total=stats["seconds"], save_step=stats["step"])
    # step 1 restored alone is the snapshot, not the zeroed weights
    dist.barrier()
    import shutil

    shutil.rmtree(_step(store, 2) / f"rank{rank}")
    dist.barrier()
    got, step = CodedCheckpointer(t=1, store_dir=store).restore()
    out["first"] = step == 1 and _same(got, _state(1))
    return out


def _crash_worker(rank: int, n: int, init: str, store: str) -> None:
    """Saves step 1, then step 2 in the background, and dies (SIGKILL) in that write after its
    fragment, before its metadata (the file that makes a folder complete, written last)."""
    import torch.distributed as dist

    from rankwise.ckpt import _layout, _store

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))
    write_party = _layout.write_party

    def crash_after_fragment(fd: int, fragment, body: bytes) -> None:
        if "step_0000000002" in os.readlink(f"/proc/self/fd/{fd}"):
            _store.write(_layout.FRAGMENT, fragment, dir_fd=fd)
            os.kill(os.getpid(), signal.SIGKILL)
        write_party(fd, fragment, body)

    _layout.write_party = crash_after_fragment
    ck = CodedCheckpointer(t=1, store_dir=store)
    ck.save(_state(1), 1)
    ck.save(_state(2), 2, blocking=False).result()


def _fit_async(rank: int, store: str, stop_at: int | None):
    """SDLRT data-parallel through fit with background checkpoints every 5 steps; stops after
    `stop_at` steps (a lost run), or resumes from the newest checkpoint and finishes 12 steps."""
    import hashlib

    import torch.distributed as dist

    import rankwise
    from rankwise.train import CodedCheckpoints, fit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))
    rankwise.to_low_rank(model, rank=6)
    opt = rankwise.SDLRT(model, 0.05, tau=0.1, momentum=0.9, process_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 10, generator=g), torch.randint(0, 4, (96,), generator=g)
    ck = CodedCheckpoints(CodedCheckpointer(t=1, store_dir=store), 5, blocking=False)
    loop = fit(model, opt, x, y, epochs=2, batch_size=16, max_steps=stop_at or 12,
               shuffle=torch.Generator().manual_seed(2), process_group=dist.group.WORLD, callbacks=[ck])
    ck.checkpointer.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.state_dict().values()))
    return loop.global_step, ck.restored, digest.hexdigest(), opt.ranks()


def _reference_and_lost_run(rank: int, root: str):
    """The uninterrupted run (store a), then a run lost after 8 steps (store b: its background
    checkpoint of step 5 landed)."""
    ref = _fit_async(rank, str(Path(root) / "a"), None)
    _fit_async(rank, str(Path(root) / "b"), 8)
    return ref


def _after(rank: int, root: str) -> dict:
    root = Path(root)
    out = _async_round_trip(rank, root / "round_trip")
    got, step = CodedCheckpointer(t=1, store_dir=root / "crashed").restore()
    out["crashed"] = (step, _same(got, _state(step)))
    out["resumed"] = _fit_async(rank, str(root / "fit" / "b"), None)  # a fresh process: a restart
    out["timeouts"] = _timeouts()
    return out


def _timeouts() -> tuple[float, float]:
    """Seconds after which a collective times out on training's group and on the coded saves'."""
    from rankwise.ckpt._dcp import side_group
    from rankwise.dist import group_timeout

    return group_timeout().total_seconds(), group_timeout(side_group()).total_seconds()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("async")


@pytest.fixture(scope="module")
def crashed(root):
    """Four ranks killed in the background write of step 2: (exit codes, the files they left)."""
    store = root / "crashed"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_crash_worker, args=(r, 4, str(root / "crash_init"), str(store)))
             for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    left = [sorted(f.name for f in (_step(store, 2) / f"rank{r}").iterdir()) for r in range(4)]
    return [p.exitcode for p in procs], left


@pytest.fixture(scope="module")
def reference(root):
    return run_world(_reference_and_lost_run, 4, root, str(root / "fit"), timeout=180)


@pytest.fixture(scope="module")
def world(root, crashed, reference):
    return run_world(_after, 4, root, str(root), timeout=180)


def test_async_save_snapshots_returns_a_future_and_waits_for_the_previous(world):
    for r in world:
        assert r["future"] and r["x"] == 4.0**20 and r["first_done"] and r["step"] == 2 and r["same"]
        assert r["save_step"] == 2 and r["blocked"] < r["total"]
        # the encode takes ≥ 0.5 s (a slowed transport): save returned long before it ended
        assert not r["done_on_return"] and r["returned_after"] < 0.5 <= r["total"]
        assert r["first"]  # the first save, restored alone, is the snapshot, not the zeroed weights


def test_a_crash_during_the_background_write_restores_the_previous_step(crashed, world):
    codes, left = crashed
    assert codes == [-signal.SIGKILL] * 4
    assert left == [["fragment.rwck"]] * 4  # the fragment written, the metadata (written last) not
    assert [r["crashed"] for r in world] == [(1, True)] * 4


def test_fit_with_background_checkpoints_resumes_bitwise(reference, world):
    for r, (ref, got) in enumerate(zip(reference, world, strict=True)):
        step, restored, digest, ranks = got["resumed"]
        assert ref[0] == 12 and ref[1] is None
        assert step == 12 and restored["step"] == 5 and restored["skipped"] == []
        assert restored["repaired_ranks"] == []
        assert digest == ref[2] and ranks == ref[3], r


class _FailsOnRank1(CodedCheckpointer):
    def _save(self, sd, step, t0, blocked):
        if self.rank == 1:
            raise OSError("disk full (planted)")
        super()._save(sd, step, t0, blocked)


def _one_rank_fails_its_background_save(rank: int, store: str):
    ck = _FailsOnRank1(t=1, store_dir=store)
    timeout, side = _timeouts()
    if side != timeout:  # the others would wait `side` s: do not run the scenario
        return dict(timeout=timeout, side=side, error=None, waited=None)
    fut = ck.save(_state(1), 1, blocking=False)
    t0 = time.perf_counter()
    try:
        fut.result()
        error = None
    except Exception as e:  # rank 1: its own error; the others: their collective timed out
        error = type(e).__name__
    waited = time.perf_counter() - t0
    with contextlib.suppress(Exception):  # (the same error again)
        ck.close()
    return dict(timeout=timeout, side=side, error=error, waited=waited)


def test_a_background_save_failing_on_one_rank_frees_the_others_within_the_group_timeout(world, tmp_path):
    """The save's group inherits the training group's timeout (4 s here), not torch's default
    30 min: the ranks waiting for the failed one get an error in seconds. (Checked first on the
    shared world, where the training group's timeout is 60 s: no world of its own is spent on a
    scenario that would hang.)"""
    assert all(side == timeout == 60.0 for timeout, side in (r["timeouts"] for r in world)), \
        [r["timeouts"] for r in world]
    out = run_world(_one_rank_fails_its_background_save, 4, tmp_path, str(tmp_path / "store"), pg_timeout=4.0)
    assert all(r["timeout"] == 4.0 and r["side"] == 4.0 for r in out), out
    assert out[1]["error"] == "OSError"
    for r in out[:1] + out[2:]:
        assert r["error"] is not None and r["waited"] < 30, r
