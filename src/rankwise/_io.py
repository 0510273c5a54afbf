"""Atomic file writes, shared by the run records and the checkpoint format."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | list) -> None:
    """Write ``data`` (bytes, or a list of buffers written one after another) to ``path``
    atomically: a temporary file in the same directory is written, flushed and fsynced, then
    renamed over ``path``, and the directory is fsynced. A crash leaves either the old file or
    the new one, never a partial file. The temporary file is created as ``open(path, "w")``
    would create a file (mode 0666 less the umask), so the result has the permissions the user
    expects (``tempfile.mkstemp`` would give 0600)."""
    path = Path(path)
    while True:  # a fresh name, created exclusively (as mkstemp does)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            for part in data if isinstance(data, list) else [data]:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
