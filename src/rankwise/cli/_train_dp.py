"""``rankwise train --nproc N``: the same training run, data-parallel under torchrun.

The parent starts ``torchrun --nproc_per_node N`` on this module; every worker joins the group
(:func:`rankwise.dist.init_process_group`, gloo), runs
:func:`rankwise.experiments.train_run.train` on its shard of every batch, and rank 0 writes the
run records and the summary the parent prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .._io import read_json, write_atomic


def check_checkpoint_dir(config, nproc: int) -> None:
    """Refuse (``UserError``) a ``checkpoint_dir`` that is not a folder, or that holds the
    checkpoints of a run with other settings or another number of processes (its
    ``run.json``), naming what differs; creates nothing."""
    from ..experiments.train_run import resumable
    from ..train._checkpoints import mismatch as resume_mismatch
    from ._common import UserError, _check_writable

    folder = config.checkpoint_dir
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--checkpoint-dir {folder} is a file, not a folder; give a folder (created if "
                        "missing)")
    _check_writable(folder, "--checkpoint-dir")  # (e.g. /proc/ck: names the option, not an errno)
    manifest = folder / "run.json"
    mine = {**resumable(config), "nproc": nproc}
    if manifest.exists():
        try:
            saved = read_json(manifest)
        except (OSError, ValueError) as e:
            raise UserError(f"{manifest} is unreadable ({e}); choose another --checkpoint-dir", 1) from None
        if not isinstance(saved, dict):
            raise UserError(f"{manifest} is not a run's manifest; choose another --checkpoint-dir", 1)
        saved = {k: v for k, v in saved.items() if k != RUN_ID}
        if saved != mine:
            raise UserError(f"--checkpoint-dir {config.checkpoint_dir} holds checkpoints of another run ("
                            f"{resume_mismatch(saved, mine)}); choose another folder", 1)


RUN_ID = "run_id"  # the manifest's key naming the run (older manifests have none)
OUT_MARK = ".rankwise-run.json"  # in --out: the checkpointed run whose records it holds


def _run_id(folder: Path) -> str | None:
    try:
        saved = read_json(folder / "run.json")
    except (OSError, ValueError):
        return None
    return saved.get(RUN_ID) if isinstance(saved, dict) else None


def claim_checkpoint_dir(config, nproc: int) -> str | None:
    """The run's identity in ``checkpoint_dir/run.json`` (written on the first start, with a
    random run id), after :func:`check_checkpoint_dir`: a later start with other settings is
    refused before any process starts. Returns the run id (None for a manifest written before
    run ids)."""
    import secrets

    from ..experiments.train_run import resumable

    check_checkpoint_dir(config, nproc)
    manifest = config.checkpoint_dir / "run.json"
    if manifest.exists():
        return _run_id(config.checkpoint_dir)
    config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(8)
    manifest_body = {**resumable(config), "nproc": nproc, RUN_ID: run_id}
    write_atomic(manifest, json.dumps(manifest_body, indent=1).encode())
    return run_id


def mark_out(config, run_id: str | None) -> None:
    """Record in ``config.out`` that its records are the checkpointed run `run_id`'s (so that
    rerunning the same command resumes it: :func:`resumes_out`)."""
    if config.out is not None and run_id is not None:
        write_atomic(config.out / OUT_MARK, json.dumps(
            {RUN_ID: run_id, "checkpoint_dir": str(config.checkpoint_dir.resolve())}).encode())


def resumes_out(config) -> bool:
    """Does ``config.out`` hold the records of the run whose checkpoints are in
    ``config.checkpoint_dir`` (its mark names that folder and the run id of its manifest)? Then
    rerunning the command resumes that run and replaces its records, as ``--force`` would."""
    if config.out is None or config.checkpoint_dir is None:
        return False
    run_id = _run_id(config.checkpoint_dir)
    try:
        mark = read_json(config.out / OUT_MARK)
    except (OSError, ValueError):
        return False
    return (run_id is not None and isinstance(mark, dict) and mark.get(RUN_ID) == run_id
            and mark.get("checkpoint_dir") == str(config.checkpoint_dir.resolve()))


def run(config, nproc: int, workdir: Path, *, max_restarts: int = 0, timeout: float | None = None) -> dict:
    """Train `config` on `nproc` local processes; returns rank 0's summary. torchrun's output
    goes to ``config.out/torchrun.log`` (or `workdir`). Raises ``RuntimeError`` with the log's
    last error line if the workers fail (or run past `timeout` s)."""
    from ..dist import local_torchrun

    summary = workdir / "summary.json"
    cmd, env = local_torchrun(nproc, "rankwise.cli._train_dp", [json.dumps(config.to_dict()), str(summary)],
                              max_restarts=max_restarts)
    log = (config.out if config.out is not None else workdir) / "torchrun.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the {nproc} training processes ran past {timeout} s") from None
    if rc != 0 or not summary.exists():
        tail = [ln for ln in log.read_text().splitlines() if "Error" in ln or "error:" in ln]
        raise RuntimeError(f"the {nproc} training processes failed (torchrun exit {rc}): "
                           + (tail[-1].strip() if tail else "no error line")
                           + (f"; see {log}" if config.out is not None else ""))
    return json.loads(summary.read_text())


def _worker(config_json: str, summary_path: str) -> None:
    import torch
    import torch.distributed as dist

    from ..dist import exit_worker, init_process_group
    from ..experiments.train_run import train
    from ..train_config import TrainConfig

    torch.set_num_threads(1)
    init_process_group("gloo")
    summary = train(TrainConfig.from_dict(json.loads(config_json)), save_model=True)
    if dist.get_rank() == 0:
        summary["nproc"] = dist.get_world_size()
        write_atomic(Path(summary_path), json.dumps(summary).encode())
    dist.barrier()
    dist.destroy_process_group()
    exit_worker()  # here, while the run's objects are alive: see exit_worker


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])  # (it ends the process)
