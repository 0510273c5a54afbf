"""Restart-safe process-group set-up for torchrun.

torchrun restarts the whole worker group after a failure, but its rendezvous store lives on:
a plain ``init_process_group("gloo")`` in the restarted group meets the dead attempt's keys
(and, for the gloo backend, its peers' old addresses) and fails or hangs. Each restart attempt
therefore gets its own key namespace, ``PrefixStore(f"rankwise/attempt_{n}", store)`` with
n = ``TORCHELASTIC_RESTART_COUNT``, and every collective gets a timeout.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["exit_worker", "global_rank", "group_timeout", "init_process_group", "local_torchrun",
           "ordered_allreduce_hook"]


def __dir__() -> list[str]:
    """The public names only (not this module's own imports)."""
    return list(__all__)


def _env_int(name: str, default: int | None = None) -> int:
    v = os.environ.get(name)
    if v is None:
        if default is None:
            raise RuntimeError(f"rankwise.dist.init_process_group: environment variable {name} is not set "
                               "(launch with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        return default
    try:
        return int(v)
    except ValueError as e:
        raise RuntimeError(f"environment variable {name} must be an integer; got {v!r}") from e


def global_rank(group, r: int) -> int:
    """Rank `r` of process group `group` (None or WORLD: the default group) as a global rank,
    what point-to-point calls and ``src=``/``dst=`` take on every torch since 2.3."""
    return dist.get_global_rank(group, r) if group is not None and group != dist.group.WORLD else r


def init_process_group(backend: str | None = None, *, timeout: timedelta = timedelta(seconds=120)) -> int:
    """Initialise the default process group from torchrun's environment, with one store
    namespace per restart attempt; returns the attempt number (0 on the first run).

    **Arguments:**
    - `backend`: ``"gloo"``, ``"nccl"``, … (default: ``"cpu:gloo,cuda:nccl"`` when CUDA is
      available, so that CPU tensors, which :class:`rankwise.ckpt.CodedCheckpointer` sends,
      still have a backend; else ``"gloo"``). With CUDA the device is set to ``LOCAL_RANK``.
    - `timeout`: for the store connection and every collective, so a lost peer raises instead
      of hanging.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent hosts the TCP store and
    every worker connects as a client; launched otherwise, rank 0 hosts it.
    """
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialised")
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available() and "nccl" in backend:
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(addr, port, world_size=None if agent else world,
                          is_master=(rank == 0 and not agent), timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"rankwise/attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    return attempt


def local_torchrun(nproc: int, module: str, args: list[str], *,
                   max_restarts: int = 0) -> tuple[list[str], dict]:
    """(command, environment) that runs ``python -m module *args`` on `nproc` local torchrun
    workers (c10d rendezvous on a free localhost port, one thread each), restarting the group up
    to `max_restarts` times."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "-m", module, *args]
    return cmd, dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def ordered_allreduce_hook(process_group, bucket):  # DDP rejects string annotations here
    """DDP communication hook ``(ProcessGroup | None, GradBucket) -> Future[Tensor]``: average
    gradients bitwise-reproducibly.

    DDP's default all-reduce sums each element in an order that depends on where it sits in
    its bucket, and DDP rebuilds its buckets after the first iteration, so a run resumed from a
    checkpoint (whose first iteration uses the initial layout) drifts from an uninterrupted
    run by a few ulps. This hook all-gathers each bucket and sums the ranks' gradients in rank
    order, which depends on neither. It moves n× the bytes of an all-reduce: for small models,
    tests and reproducibility checks. Use: ``ddp.register_comm_hook(None, ordered_allreduce_hook)``.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    t = bucket.buffer()
    parts = [torch.empty_like(t) for _ in range(world)]
    fut = dist.all_gather(parts, t, group=group, async_op=True).get_future()

    def mean(_):
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out.div_(world)

    return fut.then(mean)


def exit_worker() -> None:
    """End a torchrun worker after its process group is destroyed: flush the standard streams
    and leave with ``os._exit(0)``, skipping the interpreter's teardown. Call it in the function
    that holds the run's objects (a DDP module, an optimizer or checkpointer with a group), right
    after ``destroy_process_group``, so that their destructors never run: returning first frees
    them after the group is gone. Seen in 4-process gloo runs of the checkpoint demo: twice in
    about 50 a worker aborted at exit ("terminate called without an active exception", a native
    thread destroyed during teardown), and 2 of 8 runs under load hung in the destructors of the
    worker's locals (its Python stack at the line that had called the returning worker); torchrun
    then reported the whole job as failed or waited for it."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The collective timeout `group` (default: the default group) was created with, for a
    group derived from it: ``dist.new_group`` otherwise gives torch's default (30 min), so one
    rank's failure would block its peers for that long. Read from the group's CPU (else CUDA)
    backend options; torch's default when neither says."""
    pg = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            options = getattr(pg._get_backend(torch.device(device)), "options", None)
            timeout = getattr(options, "_timeout", None)
        except (RuntimeError, ValueError, AttributeError):  # no backend for that device
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return dist.default_pg_timeout
