"""Atomic file writes and bounded reads, shared by the run records, the configs and the
checkpoint format."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def write_atomic(path: str | os.PathLike, data: bytes | list, *, dir_fd: int | None = None) -> None:
    """Write ``data`` (bytes, or a list of buffers written one after another) to ``path``
    atomically: a temporary file in the same directory is written, flushed and fsynced, then
    renamed over ``path``, and the directory is fsynced. A crash leaves either the old file or
    the new one, never a partial file. The temporary file is created as ``open(path, "w")``
    would create a file (mode 0666 less the umask), so the result has the permissions the user
    expects (``tempfile.mkstemp`` would give 0600). With `dir_fd` (an open folder), `path` is a
    name in that folder, and no path is resolved again: a folder swapped for a link after it
    was opened cannot redirect the write."""
    path = Path(path)
    if dir_fd is not None and path.name != str(path):
        raise ValueError(f"with dir_fd, path must be a bare file name; got {path}")
    where = {} if dir_fd is None else {"dir_fd": dir_fd}
    while True:  # a fresh name, created exclusively (as mkstemp does)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666,
                         **where)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            for part in data if isinstance(data, list) else [data]:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        if dir_fd is None:
            os.replace(tmp, path)
        else:
            os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, **where)
        raise
    if dir_fd is not None:
        os.fsync(dir_fd)
    elif hasattr(os, "O_DIRECTORY"):
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(parent)
        finally:
            os.close(parent)


SMALL_FILE = 16 << 20  # bytes: the most a record, a manifest or a config rankwise reads may hold


def read_json(path: str | os.PathLike, limit: int = SMALL_FILE) -> Any:
    """A small JSON file (a run record, ``run.json``, an adapter config) through
    :func:`read_regular`: a FIFO, a device, a link to ``/dev/zero`` or an oversized file is
    refused before anything is read; text that is not JSON, or JSON nested too deep for the
    parser (1 MiB of ``[``), is a ``ValueError`` naming the file, never a ``RecursionError``."""
    data = read_regular(path, limit)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{path} is not a JSON file rankwise wrote: it is nested too deep to read") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, *, dir_fd: int | None = None,
                 what: str = "") -> Iterator[tuple[int, int]]:
    """(fd, size) of `path` opened read-only without blocking, refused (``ValueError``) unless a
    regular file (links are followed to one): a FIFO, a device or a socket is refused at once
    instead of hanging or reading without end. With `dir_fd`, `path` is a name in that open
    folder; `what` ends the refusal's message (what the file was to be read as)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0),
                 **({} if dir_fd is None else {"dir_fd": dir_fd}))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise ValueError(f"{path} is {kind}, not a regular file{what}")
        yield fd, st.st_size
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike, limit: int, *, dir_fd: int | None = None, exact: int | None = None,
                 head: tuple[int, Callable[[bytes], None]] | None = None, mutable: bool = False
                 ) -> bytes | bytearray:
    """The bytes of `path`, which must be a regular file (links are followed to one) of at
    most `limit` bytes. Opened without blocking, so a FIFO, a device (``/dev/zero``) or a socket
    is refused at once instead of hanging or reading without end; a file over `limit` (a 1 TiB
    sparse file) is refused before anything is allocated. Raises ``ValueError`` naming the
    problem for those, ``OSError`` when the file cannot be opened or read. With `dir_fd`, `path`
    is a name in that open folder. `exact`: the size the file must have (any other is refused
    before anything is read); `head` = (n, check): the first n bytes are read and given to
    `check` (which raises ``ValueError`` naming what is wrong) before the rest is allocated.
    `mutable`: return the ``bytearray`` read into (no copy: for large files) instead of ``bytes``."""
    with open_regular(path, dir_fd=dir_fd) as (fd, size):
        if size > limit:
            raise ValueError(f"{path} is {size:,} bytes, more than the {limit:,} it can hold")
        if exact is not None and size != exact:
            raise ValueError(f"{path} is {size:,} bytes where {exact:,} are expected")
        if head is not None:
            first = os.pread(fd, min(head[0], size), 0)
            head[1](first)
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise ValueError(f"{path} shrank while it was read ({got:,} of {size:,} bytes)")
            got += n
        if os.read(fd, 1):
            raise ValueError(f"{path} grew while it was read (beyond {size:,} bytes)")
        return buf if mutable else bytes(buf)
