"""Issue 49 (hardening, round 4): the attacks fixed so far, each a test that failed before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankwise.ckpt import _store

NAMES = [("step_0000000025", 25), ("step_25", None), ("step_" + "9" * 20, None), ("step_²", None),
         ("step_000000002５", None), ("step_-000000025", None), ("step_18446744073709551615", 2**64 - 1),
         ("step_0000000025 ", None)]


@pytest.mark.parametrize("name, step", NAMES)
def test_only_the_stores_own_step_names_are_steps(name, step):
    """A step folder is exactly step_{s:010d} in ASCII digits with s < 2⁶⁴: `step_25` was read as
    step 25 by the vote and then not found; twenty nines raised struct.error; `step_²` passed
    isdigit() and failed int() (in _prune too, failing every save)."""
    assert _store.step_of(Path(name)) == step


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
