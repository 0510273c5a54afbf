"""Issue 41's newcomer round, the command line: an option a command would ignore or misplace, a
bad value or an unusable folder is refused at once in one line naming it."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_negative_seed_is_refused_at_once_naming_the_option(tmp_path, command):
    from helpers import run_cli

    r = run_cli(command, "--seed", "-1", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "--seed" in r.stderr and not (tmp_path / "o").exists()
    from rankwise.train import TrainConfig

    with pytest.raises(ValueError, match=r"`seed` must be in \[0, 2\*\*32\)"):
        TrainConfig(seed=2**32)


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


def test_an_unwritable_checkpoint_dir_is_named():
    from helpers import run_cli

    r = run_cli("train", "--nproc", "4", "--checkpoint-every", "5", "--checkpoint-dir", "/proc/ck")
    assert r.exit_code == 1 and r.stderr.startswith("rankwise train: error: --checkpoint-dir /proc/ck")


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
