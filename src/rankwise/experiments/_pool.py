"""Run independent experiment runs in worker processes and hear how each one is doing.

:func:`map_runs` calls ``fn(item, report)`` for every item, in this process or in a pool;
``report(done, total, info)`` reaches the caller's ``on_progress(index, done, total, info)``
from inside a run (across processes through a manager queue, at most a few times a second),
so a command line can show progress *within* runs, not only between them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue as _queue
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

Report = Callable[[int, int, str], None]
OnProgress = Callable[[int, int, int, str], None]


class _Throttled:
    """``report`` for a run in a worker process: puts (index, done, total, info) on the queue,
    at most every `interval` seconds (and always for the last step)."""

    def __init__(self, q: Any, index: int, interval: float = 0.25) -> None:
        self.q, self.index, self.interval, self.last = q, index, interval, 0.0

    def __call__(self, done: int, total: int, info: str = "") -> None:
        now = time.monotonic()
        if done >= total or now - self.last >= self.interval:
            self.last = now
            self.q.put((self.index, done, total, info))


def _ignore_interrupt() -> None:
    """Initializer of the workers and of the progress manager: Ctrl-C (SIGINT reaches the
    terminal's whole process group) is the parent's to handle: it ends the workers and says so
    once. (By default each worker printed a KeyboardInterrupt traceback and the pool waited for
    its running runs; workers that ended themselves on SIGINT raced the parent, which could see
    a broken pool before its own interrupt.) A worker starts with SIGINT blocked
    (:func:`_interrupts_held`), so one that arrives before this runs waits, and is dropped here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _end_with_parent(parent: int) -> None:
    """On Linux, ask the kernel to send this process SIGTERM when the thread that started it
    ends (``PR_SET_PDEATHSIG``), so that workers do not outlive a parent killed by SIGTERM or
    SIGKILL (they ignore SIGINT, and nothing else would end them: orphans kept training). A
    parent that died before this ran is seen by the changed parent pid. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:
        os._exit(1)


def _worker_init(parent: int) -> None:
    """Initializer of the workers and of the progress manager (`parent`: the pool's pid)."""
    _ignore_interrupt()
    _end_with_parent(parent)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT blocked in this thread while the pool starts: the processes it forks or spawns
    and the pool's own thread (which starts the later workers) inherit the mask, so a Ctrl-C
    during a worker's start-up waits for :func:`_ignore_interrupt` instead of raising a
    KeyboardInterrupt in it (a traceback, under load, before its initializer ran). One that
    reaches this process meanwhile is delivered when the mask is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _call(fn: Callable[[Any, Report | None], Any], item: Any, index: int, q: Any) -> Any:
    return fn(item, _Throttled(q, index) if q is not None else None)


def map_runs(fn: Callable[[Any, Report | None], Any], items: Sequence[Any], *, jobs: int = 1,
             processes: bool = False, fresh_process: bool = False,
             on_progress: OnProgress | None = None,
             on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(item, report) for item in items]``, in order.

    **Arguments:**
    - `fn`: a module-level function (it is pickled for worker processes); `report` is
      ``None`` when nobody listens.
    - `jobs`: worker processes; with ``jobs == 1`` and not `processes` the runs happen here.
    - `fresh_process`: one process per run, started with "spawn" (a clean interpreter;
      ``max_tasks_per_child=1``), e.g. so that peak memory is per run.
    - `on_progress(index, done, total, info)`, `on_done(index, result)`: called in this
      process, in the order events arrive.
    """
    if jobs < 1:
        raise ValueError(f"`jobs` must be >= 1; got {jobs}")
    results: list[Any] = [None] * len(items)
    if jobs == 1 and not processes:
        for i, item in enumerate(items):
            report = None if on_progress is None else (lambda d, t, s="", i=i: on_progress(i, d, t, s))
            results[i] = fn(item, report)
            if on_done is not None:
                on_done(i, results[i])
        return results

    import multiprocessing as mp

    kw: dict[str, Any] = {"initializer": _worker_init, "initargs": (os.getpid(),)}
    if fresh_process:  # max_tasks_per_child needs the "spawn" start method
        kw |= {"max_tasks_per_child": 1, "mp_context": mp.get_context("spawn")}
    with contextlib.ExitStack() as stack:
        ex: ProcessPoolExecutor | None = None
        pending: set = set()
        try:
            with _interrupts_held():  # (a Ctrl-C meanwhile is raised when it ends, in this try)
                manager = stack.enter_context(_manager() if on_progress is not None else _NoManager())
                ex = stack.enter_context(ProcessPoolExecutor(jobs, **kw))
                q = manager.Queue() if on_progress is not None else None
                futures = {ex.submit(_call, fn, item, i, q): i for i, item in enumerate(items)}
                pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(q, on_progress)
                for f in done:
                    i = futures[f]
                    results[i] = f.result()  # a run's exception propagates, as its own type
                    if on_done is not None:
                        on_done(i, results[i])
        except KeyboardInterrupt:  # stop now: the workers are ended, not awaited; the pool is then
            # broken and starts nothing more (cancelling the pending futures too would race the
            # pool's own thread, which fails them: InvalidStateError, Python 3.11); the pool has
            # no public way to end its workers
            for proc in list((getattr(ex, "_processes", None) or {}).values()):
                proc.terminate()
            raise
        except BaseException:
            for f in pending:  # do not start the rest; the running ones finish
                f.cancel()
            raise
        _drain(q, on_progress)
    return results


def _drain(q: Any, on_progress: OnProgress | None) -> None:
    if q is None or on_progress is None:
        return
    while True:
        try:
            on_progress(*q.get_nowait())
        except _queue.Empty:
            return
        except (EOFError, OSError):  # the manager is gone (shutdown)
            return


def _manager() -> Any:
    from multiprocessing.managers import SyncManager

    manager = SyncManager()
    manager.start(_worker_init, (os.getpid(),))
    return manager


class _NoManager:
    def __enter__(self) -> _NoManager:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
