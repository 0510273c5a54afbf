"""Issue 41's newcomer round, the Python API part: each mistake ends in one clear error that
names the problem."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch import nn

import rankwise
from rankwise import DLRT, SDLRT


def _mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("cls", [DLRT, SDLRT])
def test_ramp_and_allocation_without_a_target_are_refused(cls):
    model = rankwise.to_low_rank(_mlp(), rank=2)
    with pytest.raises(ValueError, match="ramp_steps apply to a compression target"):
        cls(model, 0.1, tau=0.1, ramp_steps=100)
    with pytest.raises(ValueError, match="allocation apply"):
        cls(model, 0.1, tau=0.1, allocation="uniform")
    cls(model, 0.1, target=0.5, ramp_steps=100, allocation="uniform")  # with a target: fine
    assert cls(model, 0.1, target=0.5).truncation.ramp_steps == 200  # the documented default


def test_negative_momentum_is_explained_as_negative():
    model = rankwise.to_low_rank(_mlp(), rank=2)
    with pytest.raises(ValueError, match="negative μ"):
        DLRT(model, 0.1, tau=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="μ >= 1"):
        DLRT(model, 0.1, tau=0.1, momentum=1.0)


def test_to_low_rank_refuses_list_entries_that_name_no_module():
    with pytest.raises(ValueError, match=r"`exclude` names no module of the model: \['no-such-module'\]"):
        rankwise.to_low_rank(_mlp(), rank=2, exclude=["no-such-module"])
    with pytest.raises(ValueError, match="`include` names no module"):
        rankwise.to_low_rank(_mlp(), rank=2, include=["0", "fc9"])
    low = rankwise.to_low_rank(_mlp(), rank=2, exclude=["2"])  # a real name: fine
    assert isinstance(low[0], rankwise.LowRankLinear) and type(low[2]) is nn.Linear


def test_adapter_config_checks_alpha_and_module_names():
    from rankwise.peft import AdapterConfig

    for alpha in (float("inf"), 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            AdapterConfig(["query"], alpha=alpha)
    with pytest.raises(TypeError, match=r"entries must be non-empty module names .*\[3\]"):
        AdapterConfig(["q", 3])
    with pytest.raises(ValueError, match="at least one module"):
        AdapterConfig([])


def test_sequence_classifier_checks_its_sizes_controller_and_batch():
    from rankwise.ode import FixedController, SequenceClassifier

    with pytest.raises(ValueError, match="`classes` must be an int >= 1"):
        SequenceClassifier(5, 0, controller=FixedController(2, 3), m=8, rank=3)
    with pytest.raises(TypeError, match="controller"):
        SequenceClassifier(5, 2, controller=None, m=8, rank=3)
    model = SequenceClassifier(5, 2, controller=FixedController(2, 3), m=8, rank=3, p=4, hidden=8)
    with pytest.raises(ValueError, match="empty batch"):
        model(torch.zeros(0, 5))


def test_fit_refuses_numpy_arrays_naming_the_argument():
    import numpy as np

    model = _mlp()
    with pytest.raises(TypeError, match=r"`x` must be a torch.Tensor; got numpy.ndarray"):
        rankwise.fit(model, torch.optim.SGD(model.parameters(), 0.1), np.zeros((4, 8), np.float32),
                     torch.zeros(4, dtype=torch.long))


def test_coded_checkpointer_says_n_is_the_group_size(tmp_path):
    import torch.distributed as dist

    from rankwise.ckpt import CodedCheckpointer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"process group of 1 rank\(s\) \(n is the group's size"):
            CodedCheckpointer(t=1, store_dir=tmp_path / "store")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_negative_seed_is_refused_at_once_naming_the_option(tmp_path, command):
    from helpers import run_cli

    r = run_cli(command, "--seed", "-1", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "--seed" in r.stderr and not (tmp_path / "o").exists()
    from rankwise._checks import check_training

    with pytest.raises(ValueError, match=r"`seed` must be in \[0, 2\*\*32\)"):
        check_training(seed=2**32)


def test_train_refuses_options_that_would_be_ignored_or_misplaced(tmp_path):
    from helpers import run_cli

    r = run_cli("train", "--method", "dlrt", "--tau-min", "0.05")
    assert r.exit_code == 2 and "method 'dlrt' has none" in r.stderr
    for where in ("", "."):
        r = run_cli("train", "--nproc", "4", "--checkpoint-every", "5", "--checkpoint-dir", where)
        assert r.exit_code == 2 and "--checkpoint-dir is empty or the current folder" in r.stderr


def test_sweep_refuses_options_that_would_be_ignored():
    from helpers import run_cli

    r = run_cli("sweep", "--tasks", "lenet-digits", "--widen", "2")
    assert r.exit_code == 2 and "--widen applies to --select" in r.stderr
    r = run_cli("sweep", "--tasks", "lenet-digits", "--methods", "dense,dlrt", "--finetune-epochs", "2")
    assert r.exit_code == 2 and "--finetune-epochs applies to the dense-svd method" in r.stderr


def test_ode_refuses_ignored_options_names_sizes_and_leaves_no_folder(tmp_path):
    from helpers import run_cli

    r = run_cli("ode", "--model", "layered", "--recurrence", "full", "--out", tmp_path / "a")
    assert r.exit_code == 2 and "--recurrence full applies to the gated model" in r.stderr
    r = run_cli("ode", "--grid", "gru:0", "--out", tmp_path / "b")
    assert r.exit_code == 2 and "HIDDEN must be >= 1" in r.stderr
    r = run_cli("ode", "--grid", "fixed:8", "--validation", "0.0001", "--epochs", "1",
                "--out", tmp_path / "c")
    assert r.exit_code != 0 and "validate on" in r.stderr and not (tmp_path / "c").exists()


def test_train_says_what_force_does_when_checkpoints_resume_the_run(tmp_path):
    from helpers import run_cli

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.csv").write_text("epoch\n")
    r = run_cli("train", "--nproc", "4", "--checkpoint-every", "5", "--checkpoint-dir", tmp_path / "ck",
                "--out", tmp_path / "r")
    assert r.exit_code == 1 and "the training itself resumes" in r.stderr and r.stderr.count("\n") == 1


def test_peft_names_an_unknown_family_and_refuses_an_infinite_rate_at_once():
    import time

    from helpers import run_cli

    r = run_cli("peft", "--grid", "rmsprop:0.01")
    assert r.exit_code == 2 and "got 'rmsprop'" in r.stderr
    t0 = time.perf_counter()
    r = run_cli("peft", "--select", "none", "--lr", "inf")
    assert r.exit_code == 2 and "--lr" in r.stderr and time.perf_counter() - t0 < 1.0


def test_ckpt_argument_errors_do_not_import_torch():
    """`ckpt encode --out EXISTING` and `ckpt repair --worker 10` took 2–4.5 s (importing torch
    through rankwise.ckpt); the codec and the file formats need numpy only."""
    import subprocess
    import sys

    code = ("import sys, rankwise.ckpt as c; c.load_commitment, c.Code2D, c.read_fragment; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_library_imports_neither_the_studies_nor_the_command_line():
    """Issue 41, item 8: no module of the library packages imports rankwise.experiments or
    rankwise.cli (the package's lazy namespace and ``python -m rankwise`` aside)."""
    import ast
    from pathlib import Path

    root = Path(rankwise.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in ("experiments", "cli") or str(rel) in ("__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.lstrip(".").split(".")[0] in ("experiments", "cli")
                   or n.startswith(("rankwise.experiments", "rankwise.cli")) for n in names):
                offenders.append(str(rel))
    assert offenders == []


def test_peft_resumes_a_folder_holding_only_its_token_cache(tmp_path, monkeypatch):
    """An interrupted first `peft` run leaves bbc_tokens_*.pt and no record; the rerun was
    refused as if the cache were someone's outputs."""
    pytest.importorskip("peft")
    import rankwise.experiments.peft_compare as pc
    from helpers import run_cli

    out = tmp_path / "p"
    out.mkdir()
    (out / "bbc_tokens_64.pt").write_bytes(b"cache")

    def reached(*a, **k):
        raise RuntimeError("reached the study")

    monkeypatch.setattr(pc, "study", reached)
    r = run_cli("peft", "--out", out)
    assert "reached the study" in r.stderr and "already holds" not in r.stderr
    (out / "summary.md").write_text("mine")  # someone's summary: still refused without --force
    r = run_cli("peft", "--out", out)
    assert r.exit_code == 1 and "already holds" in r.stderr


@pytest.mark.parametrize("command", [("train", "--epochs", "1"), ("demo", "--epochs", "1"), ("sweep",),
                                     ("lm",), ("peft",), ("ode",)])
def test_two_commands_into_one_folder_at_once_are_refused(tmp_path, command):
    """Two `train --out same` started together both succeeded, the first one's records replaced;
    every command that writes an --out now holds it for its run."""
    import fcntl

    from helpers import run_cli
    from rankwise.cli._common import _HELD, LOCK_FILE

    out = tmp_path / "r"
    out.mkdir()
    with open(out / LOCK_FILE, "a+") as held:  # another command holds the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = run_cli(*command, "--out", out)
    assert r.exit_code == 1 and "in use by another rankwise command" in r.stderr, r.stderr
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE] and not _HELD  # released
    if command[0] == "train":
        r = run_cli("train", "--epochs", "1", "--model", "mlp", "--out", tmp_path / "gone", "--lr", "nan")
        assert r.exit_code == 2 and not (tmp_path / "gone").exists()


def test_an_unwritable_checkpoint_dir_is_named():
    from helpers import run_cli

    r = run_cli("train", "--nproc", "4", "--checkpoint-every", "5", "--checkpoint-dir", "/proc/ck")
    assert r.exit_code == 1 and r.stderr.startswith("rankwise train: error: --checkpoint-dir /proc/ck")


def test_a_second_sweep_into_the_folder_drops_tables_it_does_not_rewrite(tmp_path):
    """A second `sweep` into the same --out left the first call's equal_compression.md, which then
    described runs the new tables do not hold."""
    from helpers import run_cli

    out = tmp_path / "sw"
    base = ["sweep", "--tasks", "lenet-digits", "--taus", "0.4", "--seeds", "1", "--epochs", "1",
            "--out", out]
    assert run_cli(*base, "--methods", "dense,dlrt").exit_code == 0
    assert (out / "equal_compression.md").is_file()
    assert run_cli(*base, "--methods", "dense,sdlrt").exit_code == 0
    assert not (out / "equal_compression.md").exists() and (out / "summary.md").is_file()


_POOL_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from rankwise.experiments._pool import map_runs

# as in a terminal: a job started in the background by a non-interactive shell (a CI script's
# `cmd &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)

def slow(item, report):
    Path(sys.argv[1], f"started{item}").write_text(str(os.getpid()))
    for i in range(600):
        time.sleep(0.1)
        if report is not None:
            report(i, 600, "")
    return item

if __name__ == "__main__":
    try:
        map_runs(slow, [0, 1, 2, 3], jobs=2, processes=True, fresh_process=sys.argv[2] == "fresh",
                 on_progress=lambda *a: None)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
"""


@pytest.mark.parametrize("fresh,presses", [("fresh", 1), ("fork", 2)])
def test_ctrl_c_stops_a_pool_of_runs_at_once_without_tracebacks(tmp_path, fresh, presses):
    """Issue 41, newcomer round: Ctrl-C on `lm` or `sweep` printed a worker's traceback (most with
    a double Ctrl-C) and a sweep took ~5 s to stop (the pool waited for its running runs)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "pool.py"
    script.write_text(_POOL_SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path), fresh], stderr=subprocess.PIPE,
                         text=True, start_new_session=True)  # its own process group, as a terminal's job
    deadline = time.monotonic() + 60
    while not ((tmp_path / "started0").exists() and (tmp_path / "started1").exists()):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    time.sleep(0.3)
    t0 = time.monotonic()
    for _ in range(presses):
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        time.sleep(0.05)
    _, err = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 130 and err.strip() == "interrupted", err
    assert took < 3.0, took
    assert not (tmp_path / "started2").exists()  # the runs not started never start


def _ended(pid: int) -> bool:
    """The process `pid` has exited (gone, or a zombie nobody reaped yet)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_end_when_their_parent_is_killed(tmp_path):
    """Issue 49's note: a sweep's parent ended by SIGTERM (a scheduler's kill, `timeout`) left
    its workers training on: they ignore SIGINT and nothing ended them."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "pool.py"
    script.write_text(_POOL_SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path), "fork"], start_new_session=True)
    started = [tmp_path / "started0", tmp_path / "started1"]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in started):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    workers = [int(f.read_text()) for f in started]
    p.send_signal(signal.SIGTERM)  # the parent alone, as `kill PID` does
    p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not all(_ended(w) for w in workers):
        if time.monotonic() > deadline:
            for w in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w, signal.SIGKILL)
            pytest.fail("the workers outlived their parent")
        time.sleep(0.05)


_SLOW_START = """
import os, signal, sys, time
from pathlib import Path
from rankwise.experiments import _pool

PARENT = os.getpid()

def interrupt(sig, frame):  # a parent under load answers late; a worker at once
    if os.getpid() == PARENT:
        time.sleep(1.5)
    raise KeyboardInterrupt

signal.signal(signal.SIGINT, interrupt)
real = _pool._ignore_interrupt

def slow_start():  # a worker starting under load: Ctrl-C comes before its initializer ran
    Path(sys.argv[1], "booting").write_text("")
    time.sleep(2.0)
    real()

_pool._ignore_interrupt = slow_start

def run(item, report):
    time.sleep(30)

if __name__ == "__main__":
    try:
        _pool.map_runs(run, [0, 1], jobs=2, processes=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
"""


def test_ctrl_c_while_a_worker_starts_prints_no_traceback(tmp_path):
    """Issue 49, item 8: under load a double Ctrl-C on `sweep` still printed a worker's traceback
    (1 of 5 tries): a SIGINT that reached a worker before its initializer ignored it. The pool
    now starts its workers with SIGINT blocked; here a slow start makes that window certain."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "slow.py"
    script.write_text(_SLOW_START)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "booting").exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    for _ in range(2):
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.05)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and err.strip() == "interrupted", err


@pytest.mark.parametrize("command,field", [("peft", "setting"), ("sweep", "task"), ("lm", "context"),
                                           ("ode", "controller")])
def test_a_folder_of_another_commands_run_records_is_refused(tmp_path, command, field):
    """Issue 41, newcomer round: `peft --out` a folder of an `ode` run mixed the records."""
    import json

    from helpers import run_cli

    other = {"setting": "controller", "task": "setting", "context": "task", "controller": "context"}[field]
    runs = tmp_path / "o" / "runs"
    runs.mkdir(parents=True)
    record = runs / "a.json"
    record.write_text(json.dumps({"spec": {other: "x", "seed": 0}, "val_acc": 0.5}))
    for force in ([], ["--force"]):
        r = run_cli(command, "--out", tmp_path / "o", *force)
        assert r.exit_code == 1 and "holds run records of rankwise" in r.output, r.output
        assert "runs/a.json" in r.output and len(r.output.strip().splitlines()) == 1
    assert sorted(p.name for p in runs.iterdir()) == ["a.json"]


def test_train_refuses_low_rank_options_for_dense_and_names_a_divergence(tmp_path):
    """Found in this session's newcomer pass: `train --method dense --tau 0.1` ignored --tau, and a
    diverging `--lr 1e9` ended in "internal error: FloatingPointError … pass on_nonfinite='skip'"
    (an argument of the Python API)."""
    from helpers import run_cli

    r = run_cli("train", "--method", "dense", "--tau", "0.1", "--out", tmp_path / "a")
    assert r.exit_code == 2 and "--tau needs a low-rank method (dlrt or sdlrt)" in r.stderr, r.stderr
    assert not (tmp_path / "a").exists()
    r = run_cli("train", "--method", "dense", "--rank", "3", "--update-every", "2")
    assert r.exit_code == 2 and "--rank needs a low-rank method" in r.stderr
    r = run_cli("train", "--lr", "1e9", "--epochs", "1", "--out", tmp_path / "b")
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and "internal error" not in r.stderr, r.stderr
    assert "training diverged at --lr 1e+09" in lines[-1] and "try a lower --lr" in lines[-1]
    assert f"records up to there are in {tmp_path / 'b'}" in lines[-1]


def test_the_optional_4bit_kernels_warning_is_not_printed():
    """Issue 41, newcomer round: every `peft`/`lm` run first printed bitsandbytes' "Failed to load
    CPU gemm_4bit_forward … pip install kernels" (kernels rankwise never runs)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed here: there is no warning to silence")
    code = "import rankwise.experiments, peft, bitsandbytes"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gemm_4bit" not in r.stderr and "kernels" not in r.stderr, r.stderr


def test_ctrl_c_in_a_command_ends_in_one_line_and_status_130(monkeypatch, tmp_path):
    """typer turns KeyboardInterrupt into a silent exit status 130: the command line says so, and
    a folder its refused first run created is removed."""
    from helpers import run_cli
    from rankwise.cli import _app

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(_app, "_train", interrupted)
    r = run_cli("train", "--epochs", "1", "--out", tmp_path / "o")
    assert r.exit_code == 130 and r.stderr.strip() == "rankwise: interrupted", r
    assert not (tmp_path / "o").exists()


def test_progress_written_to_a_file_shows_runs_advancing():
    """Issue 49's note: `rankwise lm ... > log` wrote nothing until a run ended (rich draws no
    bars where the output is not a terminal): a 5-minute run looked hung."""
    import io

    from rich.console import Console

    from rankwise.cli._common import run_bars

    out = io.StringIO()
    with run_bars(Console(file=out), lambda r: f"{r['key']} done") as (on_progress, on_done):
        for step in range(1, 101):
            on_progress("a", step, 100, f"loss {1 / step:.2f}")
            on_progress("b", step // 2, 50, "")
        on_done({"key": "a"})
    lines = [x for x in out.getvalue().splitlines() if x]
    assert [x for x in lines if x.startswith("a:")] == [f"a: step {10 * t}/100 loss {1 / (10 * t):.2f}"
                                                         for t in range(1, 10)]
    assert len([x for x in lines if x.startswith("b:")]) == 9 and lines[-1] == "a done"
