"""A command's --out folder: held by one command at a time through a lock that follows no link,
and never mixed with another command's or another run's records (issues 41 and 49)."""

from __future__ import annotations

import os

import pytest


def test_the_out_lock_follows_no_link_and_opens_only_a_regular_file(tmp_path):
    """`open(".rankwise.lock", "a+")` followed a link planted as the lock file and created its
    target (any path, as the user running the command); a FIFO there would hang."""
    from rankwise.cli._common import UserError, lock_output, release_outputs

    out, target = tmp_path / "out", tmp_path / "elsewhere" / "created"
    out.mkdir()
    target.parent.mkdir()
    (out / ".rankwise.lock").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        lock_output(out)
    assert not target.exists()
    (out / ".rankwise.lock").unlink()
    os.mkfifo(out / ".rankwise.lock")
    with pytest.raises(UserError, match="not a regular file"):
        lock_output(out)
    (out / ".rankwise.lock").unlink()
    lock_output(out)  # and a plain folder still locks
    release_outputs(False)
    assert (out / ".rankwise.lock").is_file()


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


def test_peft_resumes_a_folder_holding_only_its_token_cache(tmp_path, monkeypatch):
    """An interrupted first `peft` run leaves bbc_tokens_*.pt and no record; the rerun was
    refused as if the cache were someone's outputs."""
    pytest.importorskip("peft")
    import rankwise.experiments.peft.peft_compare as pc
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
