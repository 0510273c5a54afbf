"""The resilient training job: ``rankwise train --nproc N --checkpoint-every K`` losing a worker.

``run_resilient`` runs the job twice through the command line: once uninterrupted, once while a
watcher SIGKILLs one worker right after the first coded checkpoint lands and deletes that
worker's node-local checkpoint folder (a lost machine). torchrun (``--max-restarts 1``)
restarts the group; every rank restores the newest checkpoint, the lost rank's fragment
repaired from its peers; training finishes. It returns both runs' records and whether they are
equal bit for bit (losses, accuracies, ranks and τ of every epoch; not the timings).
Linux only (the watcher finds the worker through ``/proc``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

VICTIM = 2  # the rank that is killed


def _train(out: Path, store: Path, args: list[str], nproc: int, every: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rankwise", "train", "--nproc", str(nproc), "--checkpoint-every", str(every),
           "--checkpoint-dir", str(store), "--max-restarts", "1", "--out", str(out), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _worker_pid(rank: int) -> int | None:
    """The pid of the torchrun worker of `rank` running ``rankwise.cli._train_dp``."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rankwise.cli._train_dp" in cmd and f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


def _record(out: Path) -> dict:
    final = json.loads((out / "final.json").read_text())
    for h in final["history"]:
        h.pop("epoch_time")
    return {k: final[k] for k in ("history", "test_acc", "train_acc", "ranks", "taus")}


def run_resilient(workdir: str | Path, *, nproc: int = 4, every: int = 10, timeout: float = 600,
                  args: tuple[str, ...] = ("--method", "sdlrt", "--model", "mlp", "--rank", "32",
                                           "--epochs", "3")) -> dict:
    """Both runs in ``workdir`` (``reference/``, ``faulty/``; refuses to reuse a non-empty
    folder); returns ``{"bitwise_equal", "killed_pid", "killed_after_checkpoint",
    "reference", "faulty", "seconds"}``."""
    work = Path(workdir)
    if work.exists() and not work.is_dir():
        raise NotADirectoryError(f"{work} is a file, not a folder; choose another folder")
    if work.exists() and any(work.iterdir()):
        raise FileExistsError(f"{work} is not empty; choose another folder")
    t0 = time.perf_counter()
    ref = _train(work / "reference", work / "reference_store", list(args), nproc, every)
    log_ref = ref.communicate(timeout=timeout)[0]
    if ref.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{log_ref[-2000:]}")
    t_ref = time.perf_counter() - t0
    store = work / "faulty_store"
    run = _train(work / "faulty", store, list(args), nproc, every)
    killed: dict = {}

    def watch() -> None:
        while run.poll() is None:  # the victim's folders of complete steps: step_*/rank{VICTIM}
            steps = sorted(p.parent for p in store.glob(f"step_*/rank{VICTIM}/.metadata.rwck"))
            pid = _worker_pid(VICTIM) if steps else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                for step in store.glob("step_*"):  # the machine's disk is gone too
                    shutil.rmtree(step / f"rank{VICTIM}", ignore_errors=True)
                killed.update(pid=pid, after=steps[-1].parent.name)
                return
            time.sleep(0.05)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    log = run.communicate(timeout=timeout)[0]
    th.join(timeout=5)
    if run.returncode != 0:
        raise RuntimeError(f"the faulty run failed:\n{log[-2000:]}")
    if not killed:
        raise RuntimeError("the run finished before a checkpoint landed; no worker was killed")
    a, b = _record(work / "reference"), _record(work / "faulty")
    restored = json.loads((work / "faulty" / "final.json").read_text())["restored_from"]
    return {"bitwise_equal": a == b, "killed_pid": killed["pid"], "killed_after_checkpoint": killed["after"],
            "restored_from": restored,
            "reference": a, "faulty": b, "seconds": {"reference": t_ref, "total": time.perf_counter() - t0}}
