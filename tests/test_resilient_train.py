"""The resilient job end to end: ``rankwise train --nproc 4 --checkpoint-every`` loses a worker
(SIGKILL, its checkpoint folder deleted), torchrun restarts the group, the lost fragment is
repaired from the peers, and the run's records equal an uninterrupted run's bit for bit."""

import sys

import pytest

from rankwise.experiments.resilient_train import run_resilient


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher finds the worker in /proc")
@pytest.mark.timeout(600)
def test_killed_worker_resumes_bitwise(tmp_path):
    r = run_resilient(tmp_path / "job", every=10, args=("--method", "sdlrt", "--model", "mlp", "--rank", "32",
                                                        "--epochs", "1"))
    assert r["restored_from"]["repaired_ranks"] == [2]
    assert r["restored_from"]["step"] >= 10
    assert r["bitwise_equal"], (r["reference"], r["faulty"])
    assert r["faulty"]["ranks"] != {"fc1": 32, "fc2": 32, "fc3": 32}  # the ranks moved (fc3 to 10)


def test_checkpoint_needs_four_processes(tmp_path):
    from helpers import run_cli

    r = run_cli("train", "--nproc", "2", "--checkpoint-every", "5", "--checkpoint-dir", tmp_path / "ck")
    assert r.exit_code == 2 and "--checkpoint-every needs --nproc >= 4" in r.stderr
    r = run_cli("train", "--checkpoint-every", "5")
    assert r.exit_code == 2 and "--checkpoint-every and --checkpoint-dir together" in r.stderr
