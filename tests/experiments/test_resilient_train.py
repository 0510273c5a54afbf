"""The resilient job end to end: ``rankwise train --nproc 4 --checkpoint-every`` loses a worker
(SIGKILL, its checkpoint folder deleted), torchrun restarts the group, the lost fragment is
repaired from the peers, and the run's records equal an uninterrupted run's bit for bit."""

import sys

import pytest

from rankwise.experiments.resilient_train import run_resilient


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher finds the worker in /proc")
@pytest.mark.timeout(600)
def test_killed_worker_resumes_bitwise(tmp_path):
    """6 steps per epoch, a checkpoint every 4: the ones in epoch 2 carry epoch 1's record."""
    args = ("--method", "sdlrt", "--model", "mlp", "--rank", "32", "--tau", "0.3", "--epochs", "2",
            "--batch-size", "256")
    r = run_resilient(tmp_path / "job", every=4, args=args)
    assert r["restored_from"]["repaired_ranks"] == [2]
    assert r["restored_from"]["step"] >= 4
    assert r["bitwise_equal"], (r["reference"], r["faulty"])
    assert r["faulty"]["ranks"] == {"fc1": 26, "fc2": 27, "fc3": 9}  # moved from 32 (fc3: 10) in epoch 1


def test_checkpoint_needs_four_processes(tmp_path):
    from helpers import run_cli

    r = run_cli("train", "--nproc", "2", "--checkpoint-every", "5", "--checkpoint-dir", tmp_path / "ck")
    assert r.exit_code == 2 and "--checkpoint-every needs --nproc >= 4" in r.stderr
    r = run_cli("train", "--checkpoint-every", "5")
    assert r.exit_code == 2 and "--checkpoint-every and --checkpoint-dir together" in r.stderr
    r = run_cli("train", "--nproc", "2", "--model", "vgg")
    assert r.exit_code == 2 and "batch norm" in r.stderr
    r = run_cli("train", "--max-restarts", "1")
    assert r.exit_code == 2 and "--max-restarts" in r.stderr and "--nproc > 1" in r.stderr


def test_a_checkpoint_folder_of_another_run_is_refused_before_starting(tmp_path):
    from helpers import run_cli

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "run.json").write_text('{"method": "dlrt", "nproc": 4}')
    r = run_cli("train", "--nproc", "4", "--method", "sdlrt", "--checkpoint-every", "5",
                "--checkpoint-dir", ck)
    assert r.exit_code == 1 and "holds checkpoints of another run" in r.stderr
    assert "method: 'dlrt' there, 'sdlrt' here" in r.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["run.json"]


@pytest.mark.parametrize("case", ["a file", "another run"])
def test_a_bad_checkpoint_folder_is_refused_before_out_is_created(tmp_path, case):
    from helpers import run_cli

    ck, out = tmp_path / "ck", tmp_path / "out"
    if case == "a file":
        ck.write_bytes(b"not a folder")
    else:
        ck.mkdir()
        (ck / "run.json").write_text('{"method": "dlrt", "nproc": 4}')
    r = run_cli("train", "--nproc", "4", "--checkpoint-every", "5", "--checkpoint-dir", ck, "--out", out)
    said = "is a file, not a folder" if case == "a file" else "holds checkpoints of another run"
    assert r.exit_code in (1, 2) and said in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "File exists" not in r.stderr and not out.exists()


def test_batch_norm_is_refused_by_the_data_parallel_optimizer():
    from torch import nn

    from rankwise.optim.parallel._dp import check_model

    with pytest.raises(ValueError, match="batch norm"):
        check_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    check_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False)))


def test_rerunning_an_interrupted_checkpointed_command_resumes_it(tmp_path, monkeypatch):
    """Issue 49, item 8: an interrupted ``train --nproc 4 --checkpoint-dir CK --out O`` rerun as it
    was said "pass --force to replace it". The first start now marks O with the run id it writes
    in CK/run.json, and a rerun whose O carries that mark resumes (its records are replaced, as the
    resumed training rewrites them); O with another run's records, or CK of another run, is still
    refused, and --force is still what replaces records the mark does not vouch for."""
    from helpers import run_cli

    started = []

    def fake_run(config, nproc, workdir, **kw):  # the interrupted first start: records, then a crash
        (config.out / "metrics.csv").write_text("epoch,loss\n1,0.5\n")
        started.append(config.out)
        raise RuntimeError("worker killed")

    monkeypatch.setattr("rankwise.cli._train_dp.run", fake_run)
    ck, out, other = tmp_path / "ck", tmp_path / "out", tmp_path / "other"
    cmd = ("train", "--nproc", "4", "--method", "dlrt", "--checkpoint-every", "5", "--checkpoint-dir", ck)
    r = run_cli(*cmd, "--out", out)
    assert r.exit_code == 1 and "worker killed" in r.stderr and (out / "metrics.csv").exists()
    r = run_cli(*cmd, "--out", out)  # the same command again: resumed, not refused
    assert r.exit_code == 1 and "worker killed" in r.stderr and len(started) == 2, r.stderr
    other.mkdir()
    (other / "metrics.csv").write_text("someone else's\n")
    r = run_cli(*cmd, "--out", other)  # records the mark does not vouch for
    assert r.exit_code == 1 and "pass --force" in r.stderr
    assert (other / "metrics.csv").read_text() == "someone else's\n"
    r = run_cli(*cmd[:-1], tmp_path / "ck2", "--out", out)  # another checkpoint folder: a new run
    assert r.exit_code == 1 and "pass --force" in r.stderr
