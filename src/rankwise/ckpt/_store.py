"""The storage layer: where coded files live, and how they are written and read.

One module for the three users' layouts (all files sealed by :mod:`._format` and published
atomically: temporary file, fsync, rename, directory fsync):

- a **dispersal folder** (the ``rankwise ckpt`` commands): ``commitment.rwck`` plus
  ``worker{i}.rwck`` per worker (on a cluster each worker keeps only its own file);
- a **checkpoint step** of :class:`CodedCheckpointer`:
  ``store_dir/rank{i}/step_{step:010d}/{fragment,commitment}.rwck``, the commitment written
  last (a step folder with a commitment is complete). The tree below ``store_dir`` is
  rankwise's own: ``rank{i}`` and ``step_*`` must be real folders, never symbolic links, which
  could lead a write onto another rank's folder or outside the store (:func:`opened_folder`:
  writes go through a descriptor of the checked folder);
- a **DCP location** of :class:`CodedStorageWriter`: ``.metadata.rwck`` and, per writing rank
  r, ``__{r}.frag.rwck`` and ``__{r}.commit.rwck``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .. import _io
from . import _format
from ._format import METADATA, Commitment, Fragment, seal, unseal

COMMITMENT_FILE = "commitment.rwck"
STEP_FRAGMENT, STEP_COMMITMENT = "fragment.rwck", "commitment.rwck"
DCP_METADATA = ".metadata.rwck"
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
        return Fragment.from_bytes(_io.read_regular(path, sys.maxsize, dir_fd=dir_fd))
    line = (com.n - com.t) * com.block_size

    def check(first: bytes) -> None:
        _format.check_fragment_head(first, line)

    size = _format.fragment_size(line)  # (k = n − t blocks in each line)
    blob = _io.read_regular(path, size, dir_fd=dir_fd, exact=size, head=(_format.FRAGMENT_HEAD, check))
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
    """The body of :func:`write_metadata` (``ValueError`` if it is not one, e.g. the pickled
    metadata of the first format, which is never read); `path` a name in `dir_fd` if given."""
    blob = _io.read_regular(path, MAX_METADATA, dir_fd=dir_fd)
    if blob[:8] == b"RWDCPMD1":
        raise ValueError("metadata of format 1 (pickled), which is not read")
    return bytes(unseal(blob, METADATA, "DCP metadata"))


# ------------------------------------------------------------------ a dispersal folder
def fragment_path(folder: str | Path, index: int) -> Path:
    return Path(folder) / f"worker{index}.rwck"


def save_dispersal(folder: str | Path, dispersal, *,
                   progress: Callable[[Iterable[Fragment]], Iterable[Fragment]] = iter) -> None:
    """Write every fragment, then the commitment (each atomically): a folder with a
    commitment is complete. ``progress`` wraps the fragment loop (e.g. ``rich.progress.track``)."""
    for f in progress(dispersal.fragments):
        write(fragment_path(folder, f.index), f)
    write(Path(folder) / COMMITMENT_FILE, dispersal.commitment)


def load_commitment(folder: str | Path) -> Commitment:
    path = Path(folder) / COMMITMENT_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {COMMITMENT_FILE} in {folder}")
    return read_commitment(path)


def load_fragments(folder: str | Path, com: Commitment | int, *,
                   where: Callable[[int], Path] | None = None
                   ) -> tuple[dict[int, Fragment], dict[int, str]]:
    """Readable fragments by worker index, and a reason for each worker that has none. With
    the folder's commitment `com`, each file is read only if its geometry allows its size
    (:func:`read_fragment`); an int `com` is the number of workers n, any size read. `where`
    maps a worker to its file (default: :func:`fragment_path` in `folder`; for a checkpointer
    step, :func:`step_fragment`); it may raise :class:`StoreError` for a worker whose folder
    breaks the store's rules."""
    found: dict[int, Fragment] = {}
    problems: dict[int, str] = {}
    n, bound = (com, None) if isinstance(com, int) else (com.n, com)
    for i in range(n):
        try:
            path = where(i) if where is not None else fragment_path(folder, i)
        except FileNotFoundError:
            problems[i] = "missing"
            continue
        except StoreError as e:
            problems[i] = str(e)
            continue
        if not path.exists():
            problems[i] = "missing"
            continue
        try:
            f = read_fragment(path, bound)
        except (ValueError, MemoryError) as e:
            problems[i] = str(e)
            continue
        except OSError as e:  # unreadable (a folder, no permission): this worker is missing
            problems[i] = f"cannot read {path.name}: {e.strerror or e}"
            continue
        if f.index != i:
            problems[i] = f"file holds worker {f.index}'s fragment"
            continue
        found[i] = f
    return found, problems


# ------------------------------------------------------------------ checkpoint steps
def step_parts(rank: int, step: int) -> tuple[str, str]:
    """The folder names of rank `rank`'s `step` below ``store_dir``: ``("rank{rank}", "step_…")``."""
    return f"rank{rank}", f"step_{step:010d}"


def step_dir(store_dir: str | Path, rank: int, step: int) -> Path:
    return Path(store_dir).joinpath(*step_parts(rank, step))


def step_fragment(store_dir: str | Path, rank: int, step: int) -> Path:
    """Rank `rank`'s fragment file of `step`, its folders checked (:func:`real_folder`)."""
    return real_folder(store_dir, *step_parts(rank, step)) / STEP_FRAGMENT


def store_step(folder: str | Path) -> tuple[Path, int] | None:
    """``(store_dir, step)`` when `folder` is a checkpointer step folder
    ``store_dir/rank{i}/step_{step:010d}`` (it holds ``fragment.rwck``), else ``None``."""
    folder = Path(folder)
    step, rank = step_of(folder), folder.parent.name
    if (step is None or not rank.startswith("rank") or not rank[4:].isdigit()
            or not (folder / STEP_FRAGMENT).exists()):
        return None
    return folder.parent.parent, step


STEP_LIMIT = 2**64  # steps are below this (the commitment's field)


def step_of(folder: Path) -> int | None:
    """The step of a folder named exactly ``step_{step:010d}`` (ASCII digits, step < 2⁶⁴), or
    ``None`` for anything else: ``step_25`` (not the store's spelling, so a vote could not find it
    again under its proper name), ``step_²`` (a digit to ``str.isdigit`` that ``int`` refuses),
    twenty nines (beyond a commitment's step field) are not steps and cost nothing."""
    name = folder.name
    digits = name[5:]
    if not name.startswith("step_") or not (digits.isascii() and digits.isdigit()):
        return None
    step = int(digits)
    return step if step < STEP_LIMIT and name == f"step_{step:010d}" else None


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


class RankFolders:
    """A rank's folder and its step folders, each opened once (:func:`opened_folder`: never
    through a link) and then read and written through its descriptor, so that every phase of a
    restore sees the folders the vote read, whatever is renamed or swapped in meanwhile. Also
    holds the commitments the vote read (`commitments`: step -> Commitment), which later phases
    use instead of reading them again. A context manager: closing it closes every descriptor."""

    def __init__(self, store_dir: str | Path, rank: int) -> None:
        self.store_dir, self.rank = Path(store_dir), rank
        self.where = self.store_dir / f"rank{rank}"
        self.commitments: dict[int, Commitment] = {}
        self._stack = contextlib.ExitStack()
        self._rank: int | None = None
        self._steps: dict[int, int] = {}

    def __enter__(self) -> RankFolders:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def rank_folder(self, *, create: bool = False) -> int:
        """The rank folder's descriptor (opened at the first call; `create` makes the folder).
        Raises as :func:`opened_folder` does."""
        if self._rank is None:
            self._rank = self._stack.enter_context(
                opened_folder(self.store_dir, f"rank{self.rank}", create=create))
        return self._rank

    def step_folder(self, step: int, *, create: bool = False) -> int:
        """Step `step`'s folder's descriptor, opened once inside the rank folder's (`create`
        makes both). Raises as :func:`opened_folder` does."""
        if step not in self._steps:
            name = step_parts(self.rank, step)[1]
            self._steps[step] = self._stack.enter_context(
                opened_folder(self.rank_folder(create=create), name, create=create, where=self.where))
        return self._steps[step]


def real_folder(root: str | Path, *names: str, create: bool = False) -> Path:
    """``root/names…`` after :func:`opened_folder` checked it (for listing and reading; writes
    go through :func:`opened_folder`'s descriptor)."""
    with opened_folder(root, *names, create=create):
        pass
    return Path(root).joinpath(*names)


def rank_folder(store_dir: str | Path, rank: int) -> Path:
    """``store_dir/rank{rank}``, a real folder (:func:`real_folder`)."""
    return real_folder(store_dir, f"rank{rank}")


# ------------------------------------------------------------------ DCP locations
def dcp_fragment(location: Path, owner: int) -> Path:
    return location / f"__{owner}.frag.rwck"


def dcp_commitment(location: Path, owner: int) -> Path:
    return location / f"__{owner}.commit.rwck"
