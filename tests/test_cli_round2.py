"""Issue 56, the command line: every command takes its lock first, checks before it works,
cleans up what a failed run created, refuses options its mode ignores, and prints progress
wherever its output goes. Each test is small (no subprocess, tiny runs)."""

from __future__ import annotations

import errno
import fcntl
import os
import random
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import run_cli
from rankwise.cli._common import _HELD, LOCK_FILE

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_line_error(r, command: str, code: int = 2) -> str:
    """The call failed with `code`, printing exactly one line on stderr naming `command`."""
    assert r.exit_code == code, r
    assert r.stderr.endswith("\n") and r.stderr.count("\n") == 1, r
    assert r.stderr.startswith(f"rankwise {command}: error: "), r
    assert "Traceback" not in r.stdout + r.stderr
    return r.stderr


@contextmanager
def _held(folder: Path):
    """Another rankwise command holds `folder` (its lock file, flock'ed)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def _checkpoint_file(tmp_path: Path, size: int = 3000) -> Path:
    src = tmp_path / "ck.bin"
    src.write_bytes(random.Random(0).randbytes(size))
    return src


def _no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# --------------------------------------------------------------------------- locks first
def test_ckpt_encode_into_a_folder_another_encode_holds_is_refused(tmp_path):
    """Two `ckpt encode` into one --out both succeeded and the first root was lost."""
    src, out = _checkpoint_file(tmp_path), tmp_path / "frags"
    with _held(out):
        r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out)
    msg = _one_line_error(r, "ckpt encode", 1)
    assert "in use by another rankwise command" in msg
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE] and not _HELD
    r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out)  # free again: it works
    assert r.exit_code == 0, r
    assert run_cli("ckpt", "verify", out).exit_code == 0  # (the lock file beside the fragments is fine)


def test_train_reads_the_resume_mark_only_after_taking_the_lock(tmp_path, monkeypatch):
    """`train --checkpoint-dir` read --out's resume mark (and the checkpoint folder) before it
    held --out; now the lock comes first, so a held folder is refused before anything is read."""
    from rankwise.cli import _train_dp

    read = []
    monkeypatch.setattr(_train_dp, "resumes_out", lambda config: read.append("mark") or False)
    monkeypatch.setattr(_train_dp, "check_checkpoint_dir", lambda config, nproc: read.append("dir"))
    out = tmp_path / "out"
    with _held(out):
        msg = _one_line_error(run_cli("train", "--nproc", 4, "--checkpoint-every", 1, "--checkpoint-dir",
                                      tmp_path / "ck", "--out", out), "train", 1)
    assert "in use by another rankwise command" in msg and read == []
    assert not (tmp_path / "ck").exists()


# --------------------------------------------------------------------------- full disk
def test_ckpt_encode_on_a_full_disk_is_one_line_and_the_rerun_works(tmp_path, monkeypatch):
    from rankwise.ckpt import _store

    src, out = _checkpoint_file(tmp_path), tmp_path / "frags"
    real, written = _store.write, []

    def fills_up(path, record, **kw):
        if written:
            raise _no_space(path)
        written.append(path)
        real(path, record, **kw)

    monkeypatch.setattr(_store, "write", fills_up)
    msg = _one_line_error(run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out), "ckpt encode", 1)
    assert "no space left on device writing" in msg and "worker1.rwck" in msg and "internal error" not in msg
    assert written and not out.exists()  # the fragment it wrote is gone, and the folder it made
    monkeypatch.setattr(_store, "write", real)
    r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out)  # no --force needed
    assert r.exit_code == 0, r


def test_train_on_a_full_disk_is_one_line_and_leaves_nothing_that_blocks_the_rerun(tmp_path, monkeypatch):
    from rankwise.cli._app import RUN_OUTPUTS
    from rankwise.cli._common import earlier_outputs
    from rankwise.experiments import train_run

    def full(path, data, **kw):
        raise _no_space(path)

    monkeypatch.setattr(train_run, "write_atomic", full)
    out = tmp_path / "keep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run_cli("train", "--model", "mlp", "--epochs", 1, "--batch-size", 512, "--out", out)
    msg = _one_line_error(r, "train", 1)
    assert "no space left on device writing" in msg and "model.pt" in msg
    assert earlier_outputs(out, RUN_OUTPUTS) == []  # metrics.csv, TensorBoard's events: removed
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "notes.txt"]


# --------------------------------------------------------------------------- writable, checked first
def test_ckpt_repair_checks_the_folder_is_writable_before_the_work(tmp_path, monkeypatch):
    from rankwise.ckpt import Code2D
    from rankwise.cli import _ckpt

    src, out = _checkpoint_file(tmp_path), tmp_path / "frags"
    assert run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out).exit_code == 0
    (out / "worker2.rwck").unlink()
    monkeypatch.setattr(_ckpt, "unwritable_folder",  # (root writes anywhere: chmod cannot show it)
                        lambda folder: f"{folder} is not writable (Permission denied)")
    monkeypatch.setattr(Code2D, "repair", lambda *a, **k: pytest.fail("repaired before the check"))
    msg = _one_line_error(run_cli("ckpt", "repair", out, "--worker", 2), "ckpt repair", 1)
    assert "is not writable" in msg and "worker 2" in msg


def test_an_existing_read_only_out_is_called_not_writable(tmp_path, monkeypatch):
    """A read-only existing --out said "cannot create it"."""
    from rankwise.cli import _common

    real = os.open

    def refused(path, *a, **k):
        if str(path).endswith(LOCK_FILE):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *a, **k)

    out = tmp_path / "ro"
    out.mkdir()
    monkeypatch.setattr(_common.os, "open", refused)
    msg = _one_line_error(run_cli("ckpt", "encode", _checkpoint_file(tmp_path), "--n", 4, "--t", 1,
                                  "--out", out), "ckpt encode", 1)
    assert f"--out {out} is not writable (Permission denied)" in msg and "cannot create" not in msg
    msg = _one_line_error(run_cli("train", "--out", tmp_path / "new" / "x"), "train", 1)
    assert "cannot create it (Permission denied)" in msg and not (tmp_path / "new").exists()


def test_ckpt_demo_refuses_a_kill_before_the_first_checkpoint(tmp_path):
    """`ckpt demo --kill-step 3` (before the first checkpoint at --every 5) ran a minute, then a
    traceback."""
    msg = _one_line_error(run_cli("ckpt", "demo", "--workdir", tmp_path / "w", "--kill-step", 3), "ckpt demo")
    assert "--kill-step 3 comes before the first checkpoint (step --every=5)" in msg
    assert not (tmp_path / "w").exists()
