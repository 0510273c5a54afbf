"""Where a figure came from: the commit of the checkout that produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def source_commit(ignore: tuple[str, ...] = ("README.md",)) -> str:
    """The short commit of the rankwise checkout (``+dirty`` with uncommitted changes to
    tracked files other than `ignore`, e.g. the README a figure is being written into), or
    ``unknown`` outside a git checkout."""
    here = Path(__file__).parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    dirty = [line for line in dirty if line[3:].strip() not in ignore]
    return sha + ("+dirty" if dirty else "")
