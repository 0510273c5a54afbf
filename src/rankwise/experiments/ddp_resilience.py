"""Survive losing a worker under torchrun: data-parallel training with a coded checkpoint every
few steps.

``worker`` runs under ``torchrun --nproc_per_node=N --max-restarts=1``: it restores from the
newest coded checkpoint (repairing a lost rank from its peers), trains an MLP on scikit-learn's
digits data-parallel (gloo) — dense with DDP and Adam (``--method dense``), or low-rank with
SDLRT / DLRT (:mod:`rankwise.methods`) and ``process_group`` (``--method sdlrt``/``dlrt``:
the hidden layers from rank 16, τ = 0.2, Adam at 0.01: the ranks change as it trains) —
checkpoints every ``every`` steps and logs each step's loss, a digest of the parameters and the
ranks exactly (``float.hex``). On the first attempt, rank ``kill_rank`` stops at ``kill_step`` and
waits to be killed. Steps count from 1; the loop is :func:`rankwise.train.fit`, the checkpoints
its :class:`rankwise.train.CodedCheckpoints` callback.

``run_demo`` is the harness: an uninterrupted reference run; a run in which it SIGKILLs that
worker and wipes its node-local store (a lost machine) so torchrun restarts the group; and
optionally a restore in which one rank serves corrupted symbols. It returns the measured bytes
and times, and whether the merged loss curve equals the reference bitwise.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from ..methods import COMMANDS

# ---------------------------------------------------------------------------- worker


def lowrank_optimizer(method: str, model, process_group=None):
    """The demo's integrator of `method` (:mod:`rankwise.methods`) for the factored `model`:
    τ = 0.2, the Adam rule at 0.01."""
    from .. import methods, optim

    return methods.build(method, model, 1e-2, optim.Tolerance(0.2), optimizer="adam",
                         process_group=process_group)


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..ckpt import CodedCheckpointer
    from ..ckpt.testing import LyingCheckpointer
    from ..data import load_digits
    from ..dist import exit_worker, init_process_group, ordered_allreduce_hook
    from ..nn import LowRankLinear, to_low_rank
    from ..train import Callback, CodedCheckpoints, fit

    torch.set_num_threads(1)
    faulthandler.enable()  # a native abort (e.g. in gloo) prints the Python stack to torchrun.log
    attempt = init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    if args.method == "dense":
        trained = DDP(model)
        trained.register_comm_hook(None, ordered_allreduce_hook)  # bitwise-reproducible across restarts
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:  # DDP cannot see the factor gradients: the optimizer averages them (same layout on restart)
        trained = to_low_rank(model, rank=16, exclude=["4"], max_rank=32)
        opt = lowrank_optimizer(args.method, model, dist.group.WORLD)
    train, _ = load_digits(seed=0)
    X, y = train.tensors[0].flatten(1), train.tensors[1]
    ck = (LyingCheckpointer if rank == args.fault_rank else CodedCheckpointer)(t=1, store_dir=args.store)

    class Demo(Callback):
        """Writes this rank's restore statistics; rank 0 logs every step's loss, a digest of the
        parameters and the ranks exactly; on the first attempt, rank `kill_rank` waits at
        `kill_step` to be killed."""

        def on_fit_start(self, loop) -> None:
            (out / f"restore_attempt{attempt}_rank{rank}.json").write_text(json.dumps(ck.stats()))

        def on_step_end(self, loop) -> None:
            if rank == 0:
                digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
                ranks = "/".join(str(m.rank) for m in model if isinstance(m, LowRankLinear))
                with open(out / f"losses_attempt{attempt}.csv", "a") as log:
                    log.write(f"{loop.global_step},{loop.loss.hex()},{digest.hexdigest()[:16]},{ranks}\n")
            if attempt == 0 and rank == args.kill_rank and loop.global_step == args.kill_step:
                (out / "victim.pid").write_text(str(os.getpid()))
                while True:  # wait for the harness's SIGKILL
                    time.sleep(1)

    def noisy(xb, yb):  # uses (and so tests) the restored RNG
        return xb + 0.05 * torch.randn(xb.shape), yb

    fit(trained, opt, X, y, epochs=None, batch_size=args.batch, max_steps=args.steps,
        shuffle=torch.Generator().manual_seed(0), process_group=dist.group.WORLD, transform=noisy,
        callbacks=[CodedCheckpoints(ck, args.every), Demo()])
    dist.barrier()
    dist.destroy_process_group()
    exit_worker()  # here, while the run's objects (DDP, the checkpointer) are alive: see exit_worker


# ---------------------------------------------------------------------------- harness


def _torchrun(nproc: int, out: Path, store: Path, *, steps: int, every: int, kill_rank: int = -1,
              kill_step: int = -1, fault_rank: int = -1, max_restarts: int = 0,
              method: str = "dense") -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    from ..dist import local_torchrun

    cmd, env = local_torchrun(nproc, "rankwise.experiments.ddp_resilience", [
        "worker", "--out", str(out), "--store", str(store), "--steps", str(steps), "--every", str(every),
        "--kill-rank", str(kill_rank), "--kill-step", str(kill_step), "--fault-rank", str(fault_rank),
        "--method", method], max_restarts=max_restarts)
    return subprocess.Popen(cmd, env=env, stdout=open(out / "torchrun.log", "w"), stderr=subprocess.STDOUT)


def _wait(p: subprocess.Popen, out: Path, timeout: float) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise RuntimeError(f"torchrun timed out after {timeout} s; see {out / 'torchrun.log'}") from None
    if rc != 0:
        tail = (out / "torchrun.log").read_text()[-3000:]
        raise RuntimeError(f"torchrun exited with {rc}; log tail:\n{tail}")


def _curve(out: Path) -> dict[int, str]:
    """step -> loss (hex); later attempts override earlier ones (they recomputed those steps)."""
    curve: dict[int, str] = {}
    for f in sorted(out.glob("losses_attempt*.csv")):
        for line in f.read_text().splitlines():
            s, v = line.split(",", 1)
            curve[int(s)] = v
    return curve


DEMO_OUTPUTS = ("reference", "faulty", "corrupt")
METHODS = COMMANDS["ckpt"]  # what each name means: rankwise.methods


def run_demo(workdir: str | Path, *, nproc: int = 4, steps: int = 40, every: int = 5, kill_rank: int = 2,
             kill_step: int = 22, corrupt_scenario: bool = True, timeout: float = 300,
             overwrite: bool = False, method: str = "dense") -> dict:
    """Run the three scenarios in ``workdir`` and return the measurements. The demo writes the
    subfolders ``reference``, ``faulty`` and ``corrupt``; if they exist it raises
    ``FileExistsError`` unless `overwrite`, which deletes those three (nothing else)."""
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}; got {method!r}")
    if not 4 <= nproc <= 255:
        raise ValueError(f"`nproc` must be in [4, 255] (t = 1 needs 3t < n <= 255); got {nproc}")
    if not 0 <= kill_rank < nproc:
        raise ValueError(f"`kill_rank` must be in [0, {nproc}); got {kill_rank}")
    if every < 1 or not 1 <= kill_step < steps or kill_step % every == 0:
        raise ValueError("need every >= 1 and 1 <= kill_step < steps, not on a checkpoint step "
                         f"(so work is lost); got every={every}, kill_step={kill_step}, steps={steps}")
    work = Path(workdir)
    if work.exists() and not work.is_dir():
        raise NotADirectoryError(f"{work} is a file, not a folder; choose another --workdir")
    old = [work / d for d in DEMO_OUTPUTS if (work / d).exists()]
    if old and not overwrite:
        raise FileExistsError(f"{work} holds an earlier demo ({', '.join(p.name for p in old)}); "
                              "pass overwrite=True to replace it")
    for p in old:
        shutil.rmtree(p)
    ref, run = work / "reference", work / "faulty"
    t0 = time.perf_counter()
    _wait(_torchrun(nproc, ref, ref / "store", steps=steps, every=every, method=method), ref, timeout)
    t_ref = time.perf_counter() - t0

    p = _torchrun(nproc, run, run / "store", steps=steps, every=every, kill_rank=kill_rank,
                  kill_step=kill_step, max_restarts=1, method=method)
    killed: dict = {}

    def killer() -> None:
        pid_file = run / "victim.pid"
        while p.poll() is None:
            if pid_file.exists() and pid_file.read_text():
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGKILL)
                for step in (run / "store").glob("step_*"):  # the machine's disk is gone too
                    shutil.rmtree(step / f"rank{kill_rank}", ignore_errors=True)
                killed.update(pid=pid, at=time.perf_counter())
                return
            time.sleep(0.05)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    _wait(p, run, timeout)
    th.join(timeout=5)
    if not killed:
        raise RuntimeError("the victim never reached its kill step")
    stats = [json.loads((run / f"restore_attempt1_rank{r}.json").read_text()) for r in range(nproc)]
    ref_curve, got_curve = _curve(ref), _curve(run)
    victim = stats[kill_rank]
    k, d = victim["k"], len(victim["helpers"])
    result = dict(
        nproc=nproc, steps=steps, every=every, kill_rank=kill_rank, kill_step=kill_step,
        restored_step=victim["step"], repaired=victim["repaired"], state_bytes=victim["state_bytes"],
        checkpoint_bytes=victim["data_len"], block_size=victim["block_size"], k=k, helpers=victim["helpers"],
        repair_bytes_per_helper={h: stats[h]["repair_bytes_sent"] for h in victim["helpers"]},
        repair_bytes_total=victim["repair_bytes_received"],
        repair_payload_formula=2 * d * victim["data_len"] / k**2,
        repair_payload_measured=2 * d * victim["block_size"],
        repair_seconds=victim["repair_seconds"], retrieve_seconds=victim["retrieve_seconds"],
        retrieve_bytes_received=victim["retrieve_bytes_received"],
        bitwise_equal=ref_curve == got_curve and len(ref_curve) == steps,
        method=method, ranks_first=ref_curve[1].split(",")[2], ranks_final=got_curve[steps].split(",")[2],
        ranks_at_restore=ref_curve[victim["step"]].split(",")[2],
        reference_seconds=t_ref)
    if corrupt_scenario:  # restore the finished run while rank 1 serves corrupted symbols
        bad = work / "corrupt"
        bad.mkdir()
        _wait(_torchrun(nproc, bad, run / "store", steps=steps, every=every, fault_rank=1, method=method),
              bad, timeout)
        cs = [json.loads((bad / f"restore_attempt0_rank{r}.json").read_text()) for r in range(nproc)]
        result["corrupt_scenario"] = dict(fault_rank=1, bad_helpers_seen={r: s["bad_helpers"] for r, s in
                                                                          enumerate(cs)},
                                          restored_step=cs[0]["step"])
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    for name, typ, default in (("out", str, None), ("store", str, None), ("steps", int, 40),
                               ("every", int, 5), ("kill-rank", int, -1), ("kill-step", int, -1),
                               ("fault-rank", int, -1), ("batch", int, 64)):
        w.add_argument(f"--{name}", type=typ, default=default, required=default is None)
    w.add_argument("--method", choices=METHODS, default="dense")
    d = sub.add_parser("demo")
    d.add_argument("--workdir", default="runs/ddp_resilience")
    d.add_argument("--nproc", type=int, default=4)
    d.add_argument("--method", choices=METHODS, default="dense")
    d.add_argument("--force", action="store_true", help="replace an earlier demo in --workdir")
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        _worker(a)  # (it ends the process)
    else:
        try:
            result = run_demo(a.workdir, nproc=a.nproc, overwrite=a.force, method=a.method)
        except (ValueError, FileExistsError, NotADirectoryError) as e:  # a user's mistake: one line, exit 2
            ap.error(f"{e} (--force replaces an earlier demo)" if isinstance(e, FileExistsError) else str(e))
        except RuntimeError as e:  # the workers failed: the log's tail, without a traceback
            raise SystemExit(f"error: {e}") from None
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
