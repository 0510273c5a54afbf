"""Issue 56, the command line: every command takes its lock first, checks before it works,
cleans up what a failed run created, refuses options its mode ignores, and prints progress
wherever its output goes. Each test is small (no subprocess, tiny runs)."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import one_line_error as _one_line_error
from helpers import run_cli
from rankwise.cli._common import _HELD, LOCK_FILE, earlier_outputs

pytestmark = pytest.mark.usefixtures("one_thread")


@contextmanager
def _held(folder: Path, lock_file: bool = True):
    """Another rankwise command holds `folder` (its lock file, or the folder itself, flock'ed)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT) if lock_file else os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def _checkpoint_file(tmp_path: Path, size: int = 3000) -> Path:
    src = tmp_path / "ck.bin"
    src.write_bytes(random.Random(0).randbytes(size))
    return src


@pytest.fixture
def no_runs(monkeypatch):
    """The studies' runs fail the test if they start (a refusal must come before any work)."""
    from rankwise.experiments import _resume, ddp_resilience, sweep
    from rankwise.experiments.lm import lm_compare

    def ran(*a, **k):
        pytest.fail("the command started its runs")

    for module, name in ((sweep, "sweep"), (lm_compare, "study"), (_resume, "run_resumable"),
                         (ddp_resilience, "run_demo")):
        monkeypatch.setattr(module, name, ran)


def _no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# --------------------------------------------------------------------------- locks first
def test_ckpt_encode_into_a_folder_another_encode_holds_is_refused(tmp_path):
    """Two `ckpt encode` into one --out both succeeded and the first root was lost."""
    src, out = _checkpoint_file(tmp_path), tmp_path / "frags"
    with _held(out, lock_file=False):  # (encode locks the folder itself: it adds no file to it)
        r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out)
    msg = _one_line_error(r, "ckpt encode", 1)
    assert "in use by another rankwise command" in msg
    assert list(out.iterdir()) == [] and not _HELD
    r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out)  # free again: it works
    assert r.exit_code == 0, r
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1", "rank2", "rank3"]
    assert sorted(p.name for p in (out / "rank3").iterdir()) == [".metadata.rwck", "fragment.rwck"]


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
    assert "no space left on device writing" in msg and "rank1/fragment.rwck" in msg
    assert "internal error" not in msg
    assert written and not out.exists()  # the fragment it wrote is gone, and the folder it made
    monkeypatch.setattr(_store, "write", real)
    r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out)  # no --force needed
    assert r.exit_code == 0, r


def test_train_on_a_full_disk_is_one_line_and_leaves_nothing_that_blocks_the_rerun(tmp_path, monkeypatch):
    from rankwise.cli._app import RUN_OUTPUTS
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


def test_a_full_disk_met_in_a_writer_thread_prints_no_thread_traceback(tmp_path, monkeypatch):
    """TensorBoard's writer thread met the full disk first and printed "Exception in thread …"
    with a traceback before the command's line; the command now says it once."""
    import threading

    from rankwise.experiments import train_run

    def writer_thread_then_main(config, **kw):
        config.out.joinpath("metrics.csv").write_text("epoch\n")  # (what the run wrote so far)
        t = threading.Thread(target=lambda: (_ for _ in ()).throw(_no_space(config.out / "events.out")))
        t.start()
        t.join()
        raise _no_space(config.out / "events.out")  # (the writer re-raises it in the main thread)

    monkeypatch.setattr(train_run, "train", writer_thread_then_main)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # (Python's, not pytest's)
    out = tmp_path / "o"
    msg = _one_line_error(run_cli("train", "--out", out), "train", 1)
    assert "no space left on device writing" in msg and "Exception in thread" not in msg
    assert not out.exists()  # what it wrote removed, and the folder it created
    assert threading.excepthook is threading.__excepthook__  # (restored)


# --------------------------------------------------------------------------- writable, checked first
def test_ckpt_repair_checks_the_folder_is_writable_before_the_work(tmp_path, monkeypatch):
    from rankwise.ckpt import Code2D
    from rankwise.cli import _ckpt

    src, out = _checkpoint_file(tmp_path), tmp_path / "frags"
    assert run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", out).exit_code == 0
    (out / "rank2" / "fragment.rwck").unlink()
    monkeypatch.setattr(_ckpt, "unwritable_folder",  # (root writes anywhere: chmod cannot show it)
                        lambda folder: f"{folder} is not writable (Permission denied)")
    monkeypatch.setattr(Code2D, "repair", lambda *a, **k: pytest.fail("repaired before the check"))
    msg = _one_line_error(run_cli("ckpt", "repair", out, "--worker", 2), "ckpt repair", 1)
    assert "is not writable" in msg and "worker 2" in msg


def test_an_existing_read_only_out_is_called_not_writable(tmp_path, monkeypatch):
    """A read-only existing --out said "cannot create it"."""
    real = os.open

    def refused(path, *a, **k):
        if str(path).endswith(LOCK_FILE):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *a, **k)

    out = tmp_path / "ro"
    out.mkdir()
    monkeypatch.setattr(os, "open", refused)  # the lock file is opened through os.open
    msg = _one_line_error(run_cli("train", "--out", out), "train", 1)
    assert f"--out {out} is not writable (Permission denied)" in msg and "cannot create" not in msg
    msg = _one_line_error(run_cli("train", "--out", tmp_path / "new" / "x"), "train", 1)
    assert "cannot create it (Permission denied)" in msg and not (tmp_path / "new").exists()


def test_ckpt_demo_refuses_a_kill_before_the_first_checkpoint(tmp_path, no_runs):
    """`ckpt demo --kill-step 3` (before the first checkpoint at --every 5) ran a minute, then a
    traceback."""
    msg = _one_line_error(run_cli("ckpt", "demo", "--workdir", tmp_path / "w", "--kill-step", 3), "ckpt demo")
    assert "--kill-step 3 comes before the first checkpoint (step --every=5)" in msg
    assert not (tmp_path / "w").exists()


# --------------------------------------------------------------------------- train's model, device, progress
def test_train_saves_the_model_and_prints_progress_into_a_pipe(tmp_path):
    """`train` wrote no model, and printed nothing into a pipe or a log until the end."""
    import torch

    from rankwise.models import get_model

    out = tmp_path / "r"
    r = run_cli("train", "--method", "dense", "--model", "mlp", "--epochs", 2, "--batch-size", 512,
                "--out", out)
    assert r.exit_code == 0, r
    assert str(out) in r.stdout  # the summary table's cells whole (not "/tmp/…" at 80 columns)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("dense: step ")]
    assert len(lines) >= 5 and lines[-1].startswith("dense: step 6/6 ep 2/2"), r.stdout
    model = get_model("mlp")
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))  # strict: every tensor
    r = run_cli("train", "--method", "dense", "--model", "mlp", "--epochs", 1, "--out", out)
    assert r.exit_code == 1 and "model.pt" in r.stderr  # an earlier run's model is not overwritten


def test_train_device_is_checked_first(tmp_path):
    import torch

    msg = _one_line_error(run_cli("train", "--device", "tpu", "--out", tmp_path / "a"), "train")
    assert "--device must be cpu, cuda or cuda:N; got 'tpu'" in msg
    r = run_cli("train", "--device", "cuda", "--nproc", 2, "--out", tmp_path / "a")
    msg = _one_line_error(r, "train")
    assert "--nproc 2" in msg
    if not torch.cuda.is_available():
        msg = _one_line_error(run_cli("train", "--device", "cuda", "--out", tmp_path / "a"), "train")
        assert "no CUDA device is available here" in msg and "--device cpu" in msg
    assert not (tmp_path / "a").exists()


def test_a_low_rank_run_above_the_dense_size_says_so():
    """README's `demo --tau 0.2` made SDLRT 1.48× the dense size without a word."""
    import io

    from rich.console import Console

    from rankwise.cli._app import _above_dense

    console = Console(file=io.StringIO(), width=200)
    summary = {"config": {"method": "sdlrt", "tau": 0.2, "target": None},
               "compression": {"ratio": -0.48, "stored_params": 148, "dense_params": 100}}
    _above_dense(console, summary)
    said = console.file.getvalue()
    assert said.count("\n") == 1
    assert "SDLRT ended storing 1.48× the dense model's parameters at τ = 0.2" in said
    small = {"ratio": 0.9, "stored_params": 10, "dense_params": 100}
    _above_dense(console, {**summary, "compression": small})
    assert console.file.getvalue() == said


def test_ckpt_demo_says_what_it_runs_into_a_pipe(tmp_path, monkeypatch):
    from rankwise.experiments import ddp_resilience

    def stop(*a, **k):
        raise RuntimeError("stopped here")

    monkeypatch.setattr(ddp_resilience, "run_demo", stop)
    r = run_cli("ckpt", "demo", "--workdir", tmp_path / "w")
    assert r.exit_code == 1 and "running torchrun three times" in r.stdout


# --------------------------------------------------------------------------- SIGTERM
def test_sigterm_ends_a_sweep_in_one_line(tmp_path, monkeypatch):
    """SIGTERM ended `sweep` / `lm` / `ode` without a word (and leaked the pool's semaphores)."""
    import signal
    import time

    from rankwise.experiments import sweep

    def terminated(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler raises before this ends)
        pytest.fail("SIGTERM did not end the sweep")

    monkeypatch.setattr(sweep, "sweep", terminated)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "s"
    r = run_cli("sweep", "--tasks", "lenet-digits", "--methods", "dense", "--seeds", 1, "--out", out)
    assert r.exit_code == 143 and "Traceback" not in r.stdout + r.stderr, r
    assert r.stderr == (f"rankwise sweep: interrupted by SIGTERM; what it finished so far is in {out} (rerun "
                        "the same command to resume or redo it)\n")
    assert signal.getsignal(signal.SIGTERM) is before and not _HELD



# --------------------------------------------------------------------------- options a mode ignores
@pytest.mark.parametrize("args, flag", [
    (("lm", "--schedule", "constant", "--warmup", "0.2"), "--warmup"),
    (("lm", "--schedule", "constant", "--final-lr", "0.2"), "--final-lr"),
    (("lm", "--warm", "0.3"), "--warm"),
    (("sweep", "--methods", "dense,dlrt", "--omega", "0.5"), "--omega"),
    (("sweep", "--targets", "0.9", "--omega", "0.5"), "--omega"),
    (("sweep", "--targets", "0.9", "--taus", "0.1"), "--taus"),
    (("sweep", "--methods", "dense", "--rank", "4"), "--rank"),
    (("ode", "--layers", "3"), "--layers"),
    (("ode", "--depth-steps", "3"), "--depth-steps"),
    (("ode", "--budget-in", "bytes"), "--budget-in"),
    (("ode", "--grid", "fixed:8", "--max-rank", "9"), "--max-rank"),
])
def test_an_option_the_chosen_mode_ignores_is_refused(tmp_path, args, flag, no_runs):
    msg = _one_line_error(run_cli(*args, "--out", tmp_path / "o"), args[0])
    assert f"{flag} is ignored here: " in msg and f"(leave {flag} out)" in msg
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args", [
    ("lm", "--schedule", "constant"), ("lm", "--methods", "dlrt-warm", "--warm", "0.3"),
    ("sweep", "--methods", "sdlrt", "--omega", "0.5"), ("sweep", "--targets", "0.9", "--rank", "4"),
    ("ode", "--model", "layered", "--layers", "3"), ("ode", "--grid", "budget:6", "--budget-in", "bytes"),
])
def test_the_same_options_where_they_are_read_pass_and_dry_run_runs_nothing(tmp_path, args, no_runs):
    r = run_cli(*args, "--out", tmp_path / "o", "--dry-run")
    assert r.exit_code == 0, r
    assert r.stdout.startswith("plan: ") and "nothing was run (--dry-run)" in r.stdout and r.stderr == ""
    assert not (tmp_path / "o").exists()


def test_sweep_dry_run_counts_the_runs_and_progress_has_a_total(tmp_path, no_runs):
    r = run_cli("sweep", "--tasks", "lenet-digits", "--methods", "dense,dlrt", "--taus", "0.1,0.2",
                "--seeds", 2, "--out", tmp_path / "o", "--dry-run")
    assert r.exit_code == 0, r
    assert r.stdout.startswith("plan: 6 runs (1 task(s) × 2 method(s) × 2 τ × 2 seed(s); dense at one "
                               "level), 0 stored") and "6 to train" in r.stdout
    r = run_cli("ode", "--grid", "fixed:8,fixed:4", "--seeds", 2, "--out", tmp_path / "o", "--dry-run")
    assert r.exit_code == 0 and r.stdout.startswith("plan: 4 runs (2 --grid entries × 2 seed(s))"), r


def test_a_one_tau_sweep_writes_no_empty_equal_compression_table(tmp_path, monkeypatch):
    """A one-τ sweep wrote an empty equal_compression.md (DLRT's accuracy is interpolated
    between its compressions at two τ at least): the file and the command now say why."""
    from rankwise.experiments import sweep

    monkeypatch.setattr(sweep, "sweep", lambda specs, out, **k: [])
    monkeypatch.setattr(sweep, "summary_markdown", lambda results: "| task |\n")
    monkeypatch.setattr(sweep, "write_csv", lambda results, path: path.write_text(""))
    monkeypatch.setattr(sweep, "plot", lambda results, out: [])
    out = tmp_path / "s"
    r = run_cli("sweep", "--tasks", "lenet-digits", "--methods", "dense,dlrt", "--taus", "0.1", "--seeds", 1,
                "--out", out)
    assert r.exit_code == 0, r
    why = ("interpolates DLRT's accuracy between its compressions at two --taus or more, and this sweep "
           "has one")
    assert f"*No rows: it {why}.*" in (out / "equal_compression.md").read_text()
    assert f"equal_compression.md has no rows: it {why}" in " ".join(r.stdout.split())


# --------------------------------------------------------------------------- names and help
def test_one_idea_has_one_option_name(tmp_path, no_runs):
    """--val / --validation and --batch / --batch-size: the commands now say --validation and
    --batch-size; the old names are hidden aliases."""
    out = tmp_path / "o"
    for args in (("sweep", "--val", "0.2"), ("sweep", "--validation", "0.2"), ("lm", "--batch", "8"),
                 ("lm", "--batch-size", "8")):
        assert run_cli(*args, "--out", out, "--dry-run").exit_code == 0, args
    msg = _one_line_error(run_cli("sweep", "--val", "0.2", "--validation", "0.2", "--out", out), "sweep")
    assert "--val is the old name of --validation" in msg
    msg = _one_line_error(run_cli("lm", "--batch", "8", "--batch-size", "8", "--out", out), "lm")
    assert "--batch is the old name of --batch-size" in msg
    msg = _one_line_error(run_cli("sweep", "--val", "1", "--out", out), "sweep")
    assert "--validation must be in [0, 1)" in msg
    for command, old, new in (("sweep", "--val ", "--validation"), ("lm", "--batch ", "--batch-size")):
        shown = run_cli(command, "--help").stdout
        assert new in shown and old not in shown
    assert not out.exists()


COMMANDS = [("train",), ("demo",), ("sweep",), ("ode",), ("peft",), ("lm",), ("ckpt",), ("ckpt", "encode"),
            ("ckpt", "verify"), ("ckpt", "repair"), ("ckpt", "retrieve"), ("ckpt", "inspect"),
            ("ckpt", "demo")]


def test_help_at_80_columns_cuts_nothing_and_lists_every_command(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    root = run_cli("--help")
    assert root.exit_code == 0 and "…" not in root.stdout
    assert max(len(line) for line in root.stdout.splitlines()) <= 80
    described = root.stdout.split("╭")[0]  # the text above the tables names each command too
    for command in ("train", "demo", "sweep", "ode", "peft", "lm", "ckpt"):
        assert re.search(rf"(^|\s){command}( /|:)", described), command
    for command in COMMANDS:
        r = run_cli(*command, "--help")
        cut = [line for line in r.stdout.splitlines() if "…" in line]
        assert r.exit_code == 0 and not cut, (command, cut)


def test_one_process_train_checkpoints_and_resumes_as_if_uninterrupted(tmp_path, monkeypatch):
    """`train` had no checkpoint or resume for one process: --checkpoint-every/--checkpoint-dir
    now work with --nproc 1 (checkpoint.pt), and the same command rerun after an interruption
    resumes and ends where the uninterrupted run does."""
    import json

    from rankwise.experiments import train_run

    def run(name: str):
        return run_cli("train", "--model", "mlp", "--method", "sdlrt", "--rank", 8, "--epochs", 2,
                       "--batch-size", 512, "--checkpoint-every", 2, "--checkpoint-dir",
                       tmp_path / name / "ck", "--out", tmp_path / name / "out")

    def final(name: str) -> dict:
        s = json.loads((tmp_path / name / "out" / "final.json").read_text())
        return {"history": [{k: v for k, v in h.items() if k != "epoch_time"} for h in s["history"]],
                "ranks": s["ranks"], "test_acc": s["test_acc"], "restored": s["restored_from"]}

    assert run("whole").exit_code == 0
    real = train_run._EpochRecords.on_step_end

    def stopped(self, loop):  # interrupted after step 5 (the checkpoint of step 4 is written)
        real(self, loop)
        if loop.global_step == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_run._EpochRecords, "on_step_end", stopped)
    assert run("cut").exit_code == 130
    monkeypatch.setattr(train_run._EpochRecords, "on_step_end", real)
    r = run("cut")  # the same command again: it resumes (no --force needed: the records are its own)
    assert r.exit_code == 0, r
    whole, cut = final("whole"), final("cut")
    assert whole.pop("restored") is None and cut.pop("restored")["step"] == 4
    assert cut == whole
