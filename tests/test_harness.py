"""The multi-process test harness (tests/distributed.py) itself."""

from __future__ import annotations

import pytest

from distributed import run_world


def _exit_slowly(rank: int, hold_store: bool) -> float:
    """An all-reduce; with `hold_store`, the rendezvous store outlives destroy_process_group and
    the process lingers at exit (as a rank whose background thread keeps the store does)."""
    import atexit
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if hold_store:
        _held.append(dist.distributed_c10d._get_default_store())
        atexit.register(time.sleep, 60)
    return t.item()


_held: list = []


def test_a_world_killed_at_teardown_is_reported_and_does_not_break_the_next(tmp_path):
    """A world whose ranks had to be killed before they released the file:// store leaves its
    keys in the rendezvous file; the next world of the same test (same function, same folder)
    must still start. It did not while worlds shared one file name (issue 29)."""
    with pytest.raises(AssertionError, match=r"rank\(s\) \[0, 1, 2, 3\] returned but did not exit"):
        run_world(_exit_slowly, 4, tmp_path, True, exit_timeout=3.0)
    assert run_world(_exit_slowly, 4, tmp_path, False, pg_timeout=15.0, timeout=60.0) == [4.0] * 4
