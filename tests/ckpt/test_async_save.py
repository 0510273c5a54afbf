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
from rankwise.ckpt._checkpointer import serialize


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(400, 300), "b": torch.randn(300), "step": step}


def _async_round_trip(rank: int, store: str):
    import torch.distributed as dist

    ck = CodedCheckpointer(t=1, store_dir=store)
    state = _state(1)
    f1 = ck.save(state, 1, blocking=False)
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
    return dict(x=float(x[0]), first_done=first_done_before_second, step=step,
                same=serialize(got) == serialize(_state(2)), blocked=stats["blocked_seconds"],
                total=stats["save_seconds"])


def test_async_save_snapshots_returns_a_future_and_waits_for_the_previous(tmp_path):
    out = run_world(_async_round_trip, 4, tmp_path, str(tmp_path / "store"))
    for r in out:
        assert r["x"] == 4.0**20 and r["first_done"] and r["step"] == 2 and r["same"]
        assert r["blocked"] < r["total"]
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
