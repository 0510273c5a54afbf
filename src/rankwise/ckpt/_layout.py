"""The one on-disk layout of a coded checkpoint, read without torch.

A checkpoint is a folder ``PATH`` holding one folder per party (rank) i, ``PATH/rank{i}/``:

- ``fragment.rwck``: the party's row C[i, :] and column R[:, i] (:class:`._format.Fragment`);
- ``.metadata.rwck``: sealed JSON: what the checkpoint holds (DCP's metadata, every field written
  out: :mod:`._dcp_meta`), the commitment's bytes and the grid's leaf hashes; the same bytes in
  every folder, written after the fragment (a folder with metadata is complete).

``dcp.save`` with :class:`rankwise.ckpt.CodedStorageWriter` writes it (each rank its own folder,
on its own disk) and ``rankwise ckpt encode FILE`` too (one process, every folder: the file's
bytes are the checkpoint, one entry ``"file"``). :func:`scan` reads every party's folder it can
reach: what ``rankwise ckpt verify|repair|retrieve|inspect`` and a load at another world size do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import _io
from . import _store
from ._format import METADATA, Commitment, Fragment, seal

FRAGMENT, META = "fragment.rwck", ".metadata.rwck"
FORMAT = "rankwise-dcp-metadata/1"
_FOLDER = re.compile(r"rank(0|[1-9][0-9]{0,2})")


def folder(rank: int) -> str:
    return f"rank{rank}"


def commitment_of(body: bytes) -> Commitment:
    """The commitment a metadata body holds (``ValueError`` if there is none or it is malformed)."""
    try:
        doc = json.loads(body.decode("utf-8"))
        raw = bytes.fromhex(doc["commitment"])
        if doc.get("format") != FORMAT:
            raise ValueError(f"not {FORMAT}")
        roots = {bytes.fromhex(sd[1][3]) for sd in doc.get("storage_data") or []}
    except (KeyError, TypeError, ValueError, IndexError, UnicodeDecodeError, AttributeError,
            RecursionError) as e:  # (JSON nested deeper than the interpreter's stack)
        raise ValueError(f"coded checkpoint metadata is malformed: {type(e).__name__}: {e}") from None
    com = Commitment.from_bytes(raw)  # (only the format whose root binds its header is read)
    if roots - {com.root}:
        raise ValueError("coded checkpoint metadata names another commitment than the one it holds")
    return com


def file_metadata(length: int, com: Commitment) -> bytes:
    """The metadata body of a plain file coded as a checkpoint: one bytes entry ``"file"``, the
    whole of m (``rankwise ckpt encode``)."""
    doc = {"format": FORMAT, "version": None, "planner_data": None, "commitment": com.to_bytes().hex(),
           "state_dict_metadata": {"file": {"kind": "bytes"}},
           "storage_data": [[["file", None, None], [0, 0, length, com.root.hex()]]]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def write_party(fd: int, fragment: Fragment, body: bytes) -> None:
    """A party's folder (its descriptor, :func:`._store.opened_folder`): the fragment, then the
    metadata (sealed), each atomically."""
    _store.write(FRAGMENT, fragment, dir_fd=fd)
    _io.write_atomic(META, seal(METADATA, body), dir_fd=fd)


def read_party(fd: int, com: Commitment | None) -> tuple[bytes | None, Fragment | None, str | None]:
    """A party folder's metadata body and (given the commitment: sized by it) fragment, and what
    failed to read, if anything."""
    body = frag = None
    why = None
    try:
        body = _store.read_metadata(META, dir_fd=fd)
    except (OSError, ValueError, MemoryError) as e:
        why = f"metadata: {getattr(e, 'strerror', None) or e}"
    if com is not None:
        try:
            frag = _store.read_fragment(FRAGMENT, com, dir_fd=fd)
        except (OSError, ValueError, MemoryError) as e:
            why = f"fragment: {getattr(e, 'strerror', None) or e}"
    return body, frag, why


def _note(s: Scan, where: str, why: str) -> None:
    """Record why `where` (or part of it) was left out, keeping earlier reasons."""
    s.skipped[where] = f"{s.skipped[where]}; {why}" if where in s.skipped else why


@dataclass
class Scan:
    """What :func:`scan` found. `body`/`com`: the metadata a quorum of the folders holds and its
    commitment; `fragments`: party -> its fragment as read (not yet verified); `parties`: party ->
    its folder's path; `skipped`: folder name -> why it (or part of it) was left out."""

    path: Path
    body: bytes | None = None
    com: Commitment | None = None
    fragments: dict[int, Fragment] = field(default_factory=dict)
    parties: dict[int, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def scan(path: str | os.PathLike, *, fragments: bool = True) -> Scan:
    """Read every ``rank{i}`` folder under `path` once (a folder reached under two names, or a
    symbolic link in a party's place, counts once: the link is skipped), take the metadata that
    at least n − ⌊(n − 1)/3⌋ of them hold byte for byte (n from its commitment), and read each
    party's fragment sized by that commitment. ``FileNotFoundError`` when `path` is not a folder;
    ``s.body is None`` when no metadata has a quorum."""
    s = Scan(Path(path))
    seen: dict[tuple[int, int], str] = {}
    bodies: dict[int, bytes] = {}
    with contextlib.ExitStack() as stack:
        try:
            names = sorted(os.listdir(s.path))
        except OSError as e:
            raise FileNotFoundError(f"no coded checkpoint at {s.path}: {e.strerror or e}") from None
        fds: dict[int, int] = {}
        for name in names:
            if not _FOLDER.fullmatch(name):
                continue
            try:
                fd = stack.enter_context(_store.opened_folder(s.path, name))
            except (OSError, ValueError) as e:
                s.skipped[name] = str(e)
                continue
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                s.skipped[name] = f"the same folder as {seen[(st.st_dev, st.st_ino)]}"
                continue
            seen[(st.st_dev, st.st_ino)] = name
            party = int(name[4:])
            fds[party], s.parties[party] = fd, s.path / name
            body, _, why = read_party(fd, None)
            if why:
                _note(s, name, why)
            if body is not None:
                bodies[party] = body
        tally: dict[bytes, list[int]] = {}
        for party, body in bodies.items():
            tally.setdefault(body, []).append(party)
        for body, voters in sorted(tally.items(), key=lambda kv: -len(kv[1])):
            try:
                com = commitment_of(body)
            except ValueError as e:
                for party in voters:
                    _note(s, folder(party), f"metadata: {e}")
                continue
            # only the checkpoint's own parties vote for it (folders beyond its n are not its parties)
            if sum(p < com.n for p in voters) >= com.n - (com.n - 1) // 3:
                s.body, s.com = body, com
                break
        for party, body in bodies.items():
            if s.body is not None and body != s.body:
                _note(s, folder(party), "its metadata differs from the quorum's")
        if s.com is None or not fragments:
            return s
        for party, fd in fds.items():
            if party >= s.com.n:
                _note(s, folder(party), f"party {party} of a checkpoint of {s.com.n}")
                continue
            _, frag, why = read_party(fd, s.com)
            if frag is None:
                _note(s, folder(party), why or "no fragment")
            elif frag.index != party:
                _note(s, folder(party), f"holds party {frag.index}'s fragment")
            else:
                s.fragments[party] = frag
    return s


class RowBlocks:
    """A party's fragment opened for block reads: its size and header checked (nothing else read),
    then row blocks C[i, c] read one at a time (``block(c)``, k of B bytes each; not verified: the
    caller checks each against its leaf hash). Close with :meth:`close`."""

    def __init__(self, fd: int, com: Commitment) -> None:
        from ._format import FRAGMENT_HEAD, check_fragment_head, fragment_size

        self.B = com.block_size
        line = (com.n - com.t) * self.B
        self._stack = contextlib.ExitStack()
        try:
            self._fd, size = self._stack.enter_context(_io.open_regular(FRAGMENT, dir_fd=fd))
            if size != fragment_size(line):
                raise ValueError(f"{FRAGMENT} is {size:,} bytes where {fragment_size(line):,} are expected")
            check_fragment_head(os.pread(self._fd, FRAGMENT_HEAD, 0), line)
        except BaseException:
            self._stack.close()
            raise
        self._at = FRAGMENT_HEAD

    def block(self, c: int):
        import numpy as np

        buf = bytearray(self.B)
        got = os.preadv(self._fd, [buf], self._at + c * self.B)
        if got != self.B:
            raise ValueError(f"{FRAGMENT} shrank while it was read")
        return np.frombuffer(buf, np.uint8)

    def close(self) -> None:
        self._stack.close()
