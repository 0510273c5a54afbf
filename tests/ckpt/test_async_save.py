"""CodedCheckpointer.save(blocking=False): a snapshot, a future, one save in flight, training
collectives running meanwhile, and a crash during the background write (gloo ranks)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch

from distributed import run_world
from rankwise.ckpt import CodedCheckpointer
from rankwise.ckpt._serial import serialize


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(400, 300), "b": torch.randn(300), "step": step}


class _SlowWrite(CodedCheckpointer):
    """Writes take at least 0.5 s (a slow disk)."""

    def _publish(self, d, frag, com) -> None:
        import time

        time.sleep(0.5)
        super()._publish(d, frag, com)


def _async_round_trip(rank: int, store: str):
    import time

    import torch.distributed as dist

    ck = _SlowWrite(t=1, store_dir=store)
    state = _state(1)
    t0 = time.perf_counter()
    f1 = ck.save(state, 1, blocking=False)
    returned_after, done_on_return = time.perf_counter() - t0, f1.done()
    assert isinstance(f1, Future)
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
    return dict(x=float(x[0]), first_done=first_done_before_second, step=step, done_on_return=done_on_return,
                returned_after=returned_after,
                same=serialize(got) == serialize(_state(2)), blocked=stats["blocked_seconds"],
                total=stats["save_seconds"])


def test_async_save_snapshots_returns_a_future_and_waits_for_the_previous(tmp_path):
    out = run_world(_async_round_trip, 4, tmp_path, str(tmp_path / "store"))
    for r in out:
        assert r["x"] == 4.0**20 and r["first_done"] and r["step"] == 2 and r["same"]
        assert r["blocked"] < r["total"]
        # the write takes ≥ 0.5 s (a slowed _publish): save returned long before it ended
        assert not r["done_on_return"] and r["returned_after"] < 0.5 <= r["total"]
    # the first save restored alone is the snapshot, not the zeroed weights
    first = run_world(_restore_step, 4, tmp_path, str(tmp_path / "store"), 1)
    assert all(first)


def _restore_step(rank: int, store: str, step: int) -> bool:
    import shutil

    mine = Path(store) / f"rank{rank}"
    for d in mine.iterdir():  # keep only `step`
        if d.name != f"step_{step:010d}":
            shutil.rmtree(d)
    got, s = CodedCheckpointer(t=1, store_dir=store).restore()
    return s == step and serialize(got) == serialize(_state(step))


class _CrashAfterFragment(CodedCheckpointer):
    """Dies (SIGKILL) in the background write of step 2, after its fragment, before its commitment."""

    def _publish(self, d, frag, com) -> None:
        if d.name.endswith("0000000002"):
            from rankwise.ckpt import _store

            _store.write(d / _store.STEP_FRAGMENT, frag)
            os.kill(os.getpid(), signal.SIGKILL)
        super()._publish(d, frag, com)


def _crash_worker(rank: int, n: int, init: str, store: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))
    ck = _CrashAfterFragment(t=1, store_dir=store)
    ck.save(_state(1), 1)
    ck.save(_state(2), 2, blocking=False).result()


def test_a_crash_during_the_background_write_restores_the_previous_step(tmp_path):
    store = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_crash_worker, args=(r, 4, str(tmp_path / "init"), store)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 4
    assert all((Path(store) / f"rank{r}" / "step_0000000002" / "fragment.rwck").exists() for r in range(4))
    out = run_world(_restore_latest, 4, tmp_path, store)
    assert out == [(1, True)] * 4


def _restore_latest(rank: int, store: str):
    got, step = CodedCheckpointer(t=1, store_dir=store).restore()
    return step, serialize(got) == serialize(_state(step))


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
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.state_dict().values()))
    return loop.global_step, ck.restored, digest.hexdigest(), opt.ranks()


def test_fit_with_background_checkpoints_resumes_bitwise(tmp_path):
    ref = run_world(_fit_async, 4, tmp_path, str(tmp_path / "a"), None)
    run_world(_fit_async, 4, tmp_path, str(tmp_path / "b"), 8)  # checkpoint at 5 lands; lost after 8
    resumed = run_world(_fit_async, 4, tmp_path, str(tmp_path / "b"), None)
    for r, (step, restored, digest, ranks) in enumerate(resumed):
        assert step == 12 and restored["step"] == 5
        assert digest == ref[r][2] and ranks == ref[r][3]


class _FailsOnRank1(CodedCheckpointer):
    def _save(self, state, step, extra, t0, group):
        if self.rank == 1:
            raise OSError("disk full (planted)")
        super()._save(state, step, extra, t0, group)


def _one_rank_fails_its_background_save(rank: int, store: str):
    import time

    from rankwise.dist import group_timeout

    ck = _FailsOnRank1(t=1, store_dir=store)
    fut = ck.save(_state(1), 1, blocking=False)
    t0 = time.perf_counter()
    try:
        fut.result()
        error = None
    except Exception as e:  # rank 1: its own error; the others: their collective timed out
        error = type(e).__name__
    waited = time.perf_counter() - t0
    timeout = group_timeout(ck._bg_group).total_seconds()
    ck._executor.shutdown()
    return dict(error=error, waited=waited, timeout=timeout)


def test_a_background_save_failing_on_one_rank_frees_the_others_within_the_group_timeout(tmp_path):
    """The background group inherits the training group's timeout (4 s here), not torch's
    default 30 min: the ranks waiting for the failed one get an error in seconds."""
    out = run_world(_one_rank_fails_its_background_save, 4, tmp_path, str(tmp_path / "store"), pg_timeout=4.0)
    assert all(r["timeout"] == 4.0 for r in out)
    assert out[1]["error"] == "OSError"
    for r in out[:1] + out[2:]:
        assert r["error"] is not None and r["waited"] < 30, r
