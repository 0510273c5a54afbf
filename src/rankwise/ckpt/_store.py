"""Sealed files and the folders they live in: how coded files are written and read.

Every file is sealed by :mod:`._format` and published atomically (temporary file, fsync, rename,
directory fsync); every read is bounded (:func:`rankwise._io.read_regular`: a regular file of at
most the size its geometry allows). Folders are opened component by component without following
links (:func:`opened_folder`), and files are written through those descriptors, so a link swapped
in after the check cannot redirect a write. The layout itself is :mod:`._layout`'s.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from .. import _io
from . import _format
from ._format import METADATA, Commitment, Fragment, seal, unseal

# what a file may hold before it is read (a larger one is a bad file, never allocated): a
# commitment has 2n ≤ 510 line roots of ≤ 64 bytes; DCP metadata names every tensor of the
# state (a fragment has exactly the size its commitment's geometry gives: read_fragment)
MAX_COMMITMENT = 1 << 20
MAX_METADATA = 256 << 20


# ------------------------------------------------------------------ sealed files
def write(path: str | Path, record: Fragment | Commitment, *, dir_fd: int | None = None) -> None:
    """Publish a fragment or commitment at `path` atomically (parent folders created); with
    `dir_fd` (from :func:`opened_folder`), `path` is a file name in that folder."""
    path = Path(path)
    if dir_fd is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    _io.write_atomic(path, record.to_parts() if isinstance(record, Fragment) else record.to_bytes(),
                     dir_fd=dir_fd)


def read_commitment(path: str | Path, *, dir_fd: int | None = None) -> Commitment:
    """The commitment at `path` (a name in `dir_fd`, if given; ``ValueError`` if it is not one,
    or not a regular file of at most ``MAX_COMMITMENT`` bytes: :func:`rankwise._io.read_regular`)."""
    return Commitment.from_bytes(_io.read_regular(path, MAX_COMMITMENT, dir_fd=dir_fd))


def read_fragment(path: str | Path, com: Commitment | None = None, *, dir_fd: int | None = None) -> Fragment:
    """The fragment at `path` (a name in `dir_fd`, if given), read only if it is a regular file
    of exactly the size `com`'s geometry gives, whose header (magic, kind, version, sizes and
    their checksum) fits it: both checked before the body is read (:func:`._format.fragment_size`,
    :func:`._format.check_fragment_head`). Without `com`, any size (for files you wrote).
    ``ValueError`` otherwise or if it does not parse."""
    if com is None:
        return Fragment.from_bytes(_io.read_regular(path, sys.maxsize, dir_fd=dir_fd, mutable=True))
    line = (com.n - com.t) * com.block_size

    def check(first: bytes) -> None:
        _format.check_fragment_head(first, line)

    size = _format.fragment_size(line)  # (k = n − t blocks in each line)
    blob = _io.read_regular(path, size, dir_fd=dir_fd, exact=size, head=(_format.FRAGMENT_HEAD, check),
                            mutable=True)  # (the fragment's lines are views of it: no copy)
    return Fragment.from_bytes(blob)


def holds(path: str | Path, record: Fragment | Commitment, *, dir_fd: int | None = None) -> bool:
    """Does `path` (a name in `dir_fd`, if given) hold exactly `record` (byte for byte)?"""
    want = record.to_bytes()
    try:
        return _io.read_regular(path, len(want), dir_fd=dir_fd) == want
    except (OSError, ValueError):
        return False


def write_metadata(path: str | Path, body: bytes) -> None:
    """Publish DCP metadata (JSON bytes) sealed as kind ``METADATA``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _io.write_atomic(path, seal(METADATA, body))


def read_metadata(path: str | Path, *, dir_fd: int | None = None) -> bytes:
    """The body of :func:`write_metadata` (``ValueError`` naming the problem if it is not one);
    `path` a name in `dir_fd` if given."""
    blob = _io.read_regular(path, MAX_METADATA, dir_fd=dir_fd)
    return bytes(unseal(blob, METADATA, "DCP metadata"))


class StoreError(ValueError):
    """A folder of the store breaks its rules (a symbolic link, or not a folder)."""


@contextlib.contextmanager
def opened_folder(root: str | Path | int, *names: str, create: bool = False,
                  where: str | Path | None = None) -> Iterator[int]:
    """A descriptor of ``root/names[0]/names[1]/…``, each component opened relative to the one
    before without following a link (``O_NOFOLLOW``): below `root` (which the user chose, and
    may be a link; or a descriptor of a folder opened before, `where` naming it in messages)
    each must be a real folder, not a symbolic link (its target could be another rank's folder
    or a folder outside the store) nor anything else. Files written through the descriptor
    (``write(name, rec, dir_fd=fd)``) land in the folder that was checked, even if a link is
    swapped in afterwards. Raises :class:`StoreError` naming the component and the rule;
    ``FileNotFoundError`` for a missing component unless `create`, which makes it."""
    if isinstance(root, int):
        fd, path = os.dup(root), Path(where if where is not None else f"<folder {root}>")
    else:
        if create:
            Path(root).mkdir(parents=True, exist_ok=True)
        fd, path = os.open(root, os.O_RDONLY | os.O_DIRECTORY), Path(root)
    try:
        for name in names:
            parent, path = fd, path / name
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
            try:
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:  # (Linux says ENOTDIR for a link with O_DIRECTORY | O_NOFOLLOW)
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, parent):
                    raise StoreError(f"{path} is a symbolic link; the checkpoint store's rank and step "
                                     "folders must be real folders inside store_dir (a link could lead "
                                     "writes onto another rank's folder or outside the store)") from None
                if e.errno == errno.ENOTDIR:
                    raise StoreError(f"{path} is not a folder") from None
                raise
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
