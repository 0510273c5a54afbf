"""Small files (records, configs, run.json) are read bounded and typed: a FIFO, a link to
/dev/zero or deeply nested JSON is refused by name, never a hang or an unbounded read (issue 49)."""

from __future__ import annotations

import os

import pytest


def test_small_files_are_read_bounded_and_deep_json_is_named(tmp_path):
    """`run.json` was read with read_text(): a FIFO hung the command, a link to /dev/zero read
    until MemoryError; 1 MiB of `[` in an adapter config raised RecursionError."""
    from rankwise._io import read_json

    fifo, zero, deep = tmp_path / "fifo.json", tmp_path / "zero.json", tmp_path / "deep.json"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    deep.write_text("[" * (1 << 20))
    with pytest.raises(ValueError, match="FIFO"):
        read_json(fifo)
    with pytest.raises(ValueError, match="a device"):
        read_json(zero)
    with pytest.raises(ValueError, match="nested too deep"):
        read_json(deep)


def test_a_run_json_that_is_a_fifo_is_refused_in_one_line(tmp_path):
    from rankwise.cli._common import UserError
    from rankwise.cli._train_dp import check_checkpoint_dir
    from rankwise.train_config import TrainConfig

    config = TrainConfig(checkpoint_dir=tmp_path / "ck", checkpoint_every=1)
    config.checkpoint_dir.mkdir()
    os.mkfifo(config.checkpoint_dir / "run.json")
    with pytest.raises(UserError, match=r"run\.json is unreadable .*FIFO"):
        check_checkpoint_dir(config, 2)
