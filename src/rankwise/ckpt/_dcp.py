"""torch.distributed.checkpoint storage on a 2-D code across the ranks: each rank keeps its own row
and column, on its own disk.

``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with :class:`CodedStorageWriter` /
:class:`CodedStorageReader` store sharded (FSDP2, DTensor) and replicated state alike. The ranks'
serialised shares, laid end to end, are one checkpoint m coded by :class:`Code2D` with n = the
world size (:mod:`._phases`: the encode crosses ranks on a gloo group of its own). Rank i writes
only ``PATH/rank{i}/``:

- ``fragment.rwck``: its row C[i, :] and column R[:, i] of the extended grid (2|m|/k bytes);
- ``.metadata.rwck``: the DCP metadata as JSON with every field written out (nothing is
  unpickled when reading; :mod:`._dcp_meta`), the commitment and the n×n leaf hashes of the grid;
  the same bytes on every rank, written after the fragment.

Loading at the same world size reads each rank's own folder: the ranks agree on the metadata
(a quorum of n − ⌊(n − 1)/3⌋ identical copies), check their fragments against the grid's leaf
hashes (kept in the metadata), rebuild a lost or damaged one from 2|m|/k bytes of their peers'
blocks (written back to its folder), and each rank receives, verified, only the blocks of m that
hold the items it loads. Loading at another world
size, or in one process, reads every ``rank*`` folder under PATH it can reach and decodes
from any k that verify (saved at 4, loaded at 2 or 1 on a shared or copied folder).

Without a process group, ``CodedStorageWriter(PATH, t=1, n=4)`` writes all n folders itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import stat
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import _io
from ..dist import group_timeout
from . import _dcp_meta, _layout, _phases, _store
from ._code2d import Code2D, NotEnoughSymbols
from ._format import METADATA, Commitment, Fragment, seal
from ._transport import Transport

log = logging.getLogger(__name__)

FRAGMENT, META, folder = _layout.FRAGMENT, _layout.META, _layout.folder
# [(the default group, its gloo side group)] as weak references: torch's registry holds the
# side group until ``destroy_process_group``, which must free it while the interpreter is alive
# (a gloo group still referenced by a module global at interpreter exit aborted the process:
# "terminate called without an active exception", 4 of 30 four-rank runs under load).
_SIDE: list[tuple[weakref.ref, weakref.ref]] = []


_SUBGROUP = ("CodedStorageWriter codes across every rank of the default process group; dcp.save was given "
             "a process_group that is a part of it (leave process_group out)")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def side_group():
    """A gloo group over every rank, made once per default process group (collectively, so on
    every rank at the same point: the writers and readers make it when they are built) and used
    by every coded save and load: an asynchronous save's messages never meet training's. Only
    torch's registry keeps it: ``destroy_process_group`` frees it."""
    world = dist.group.WORLD
    for pg, side in _SIDE:
        if pg() is world and side() is not None:
            return side()
    _SIDE.clear()
    side = dist.new_group(backend="gloo", timeout=group_timeout())  # not torch's 30 min
    _SIDE.append((weakref.ref(world), weakref.ref(side)))
    return side


def _weights_only(chunk: io.BytesIO, fqn: str) -> io.BytesIO:
    """A non-tensor entry's bytes as DCP's load planner may unpickle them: torch's default
    planner calls ``torch.load(weights_only=False)`` on them, so they are loaded here with
    ``weights_only=True`` (refused, naming the entry, if they hold anything else) and the planner
    gets them re-saved: the bytes read from disk never reach an unrestricted unpickler."""
    try:
        value = torch.load(chunk, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(f"DCP entry {fqn!r} is a non-tensor value that torch.load(weights_only=True) "
                           f"refuses ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                           "rankwise's reader loads only what weights_only allows: store plain Python "
                           "values (numbers, strings, lists, dicts, tensors) or register the type with "
                           "torch.serialization.add_safe_globals") from None
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _serialise(plan: SavePlan, planner: SavePlanner) -> tuple[memoryview, list, list[tuple[int, int]]]:
    """This rank's items as one share: non-tensor entries' bytes (as the planner gives them), then
    each tensor chunk's raw bytes, C order (its dtype and sizes are in the metadata) -> (the
    share, the items in that order, each item's (offset, length)). One buffer of the share's
    size, each tensor copied into it once."""
    items = ([i for i in plan.items if i.type == WriteItemType.BYTE_IO]
             + [i for i in plan.items if i.type != WriteItemType.BYTE_IO])
    parts = []
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            parts.append(np.frombuffer(data.getbuffer(), dtype=np.uint8))
        else:
            t = data.detach().cpu().contiguous()
            parts.append(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8))
    spans, at = [], 0
    for part in parts:
        spans.append((at, part.size))
        at += part.size
    share = np.empty(at, np.uint8)
    for part, (offset, length) in zip(parts, spans, strict=True):
        share[offset:offset + length] = part
    return memoryview(share), items, spans


class CodedStorageWriter(StorageWriter):
    """DCP ``StorageWriter``: the state as a 2-D code over the n ranks (any k = n − t of them
    restore it; a lost one is rebuilt from its peers), rank i writing ``path/rank{i}`` only.

    `path`: the checkpoint's folder on each rank's own disk (``dcp.save(checkpoint_id=...)``
    replaces it). `t`: losses tolerated (3t < n). `n`: only without a process group (or with a
    world of one): one process then writes all n folders. ``stats`` after a save: bytes sent and
    seconds."""

    def __init__(self, path: str | os.PathLike, *, t: int = 1, n: int | None = None,
                 hash: str = "blake3", transport: type[Transport] = Transport,
                 inner: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.root, self.inner, self.transport = Path(path), tuple(inner), transport
        self.path = self.root.joinpath(*self.inner)
        self.rank, world = _world()
        if world > 1:
            if n not in (None, world):
                raise ValueError(f"n={n}, but the world has {world} ranks: a coded checkpoint has one "
                                 "party per rank (leave n out)")
            n = world
        elif n is None:
            raise ValueError("without a process group one process writes every party's folder: give n "
                             "(the number of parties, ≥ 3t + 1)")
        self.code = Code2D(n, t, hash=hash)  # validates n and t: a world below 4 ranks is refused here
        self.group = side_group() if world > 1 else None
        self.stats: dict[str, Any] = {}
        self._folders: contextlib.ExitStack | None = None
        self._fds: dict[int, int] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A ``checkpoint_id`` is the checkpoint's folder (as for ``FileSystemWriter``)."""
        if checkpoint_id is not None:
            self.root, self.inner = Path(checkpoint_id), ()
            self.path = self.root

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if kwargs.get("use_collectives") is False:
            raise ValueError("CodedStorageWriter needs use_collectives=True (the code spans the ranks)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Open (and make) this rank's folders now, never through a link: the save writes through
        these descriptors, so a link swapped in afterwards cannot redirect it. A link or file planted
        at a rank folder's name is removed (the entry, never what it points to); a folder that still
        cannot be opened costs this rank's files only (logged; it takes part in the encode and is
        rebuilt like a lost rank at the next load)."""
        self._close()
        self._folders = contextlib.ExitStack()
        self.write_errors: dict[int, str] = {}
        mine = [self.rank] if self.group is not None else list(range(self.code.n))
        try:
            with _store.opened_folder(self.root, *self.inner, create=True) as parent:
                for i in mine:
                    try:
                        self._fds[i] = self._open_party(parent, folder(i))
                    except (OSError, ValueError) as e:
                        self.write_errors[i] = str(e)
        except (OSError, ValueError) as e:
            self.write_errors.update(dict.fromkeys(mine, str(e)))
        for i, why in self.write_errors.items():
            log.error("coded DCP save: %s cannot be written (%s); this rank's files are skipped",
                      self.path / folder(i), why)
        return plan

    def _open_party(self, parent: int, name: str) -> int:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
            log.warning("coded DCP save: removed the non-folder entry at %s", self.path / name)
        return self._folders.enter_context(_store.opened_folder(parent, name, create=True,
                                                                where=self.path))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) > 1 and len(plans) != self.code.n:  # (one plan: no_dist, each rank plans alone)
            raise ValueError(_SUBGROUP)
        return plans

    def _close(self) -> None:
        if self._folders is not None:
            self._folders.close()
        self._folders, self._fds = None, {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0 = time.perf_counter()
        try:
            share, items, spans = _serialise(plan, planner)
            doc = _dcp_meta.share_doc(items, spans, plan.planner_data)
            t1 = time.perf_counter()
            if self.group is None:
                disp = self.code.encode(share)
                frags, com, docs, starts, leaves = disp.fragments, disp.commitment, [doc], [0], disp.leaves
                sent = 0
            else:
                tp = self.transport(self.group)
                frag, com, docs, starts, leaves = _phases.encode_across(self.code, tp, share, doc)
                frags, sent = [frag], sum(tp.sent.values())
            t2 = time.perf_counter()
            md = _dcp_meta.merged(docs, starts, com.root)
            body = _dcp_meta.encode_file(md, com.to_bytes(), b"".join(b"".join(r) for r in leaves))
            for frag in frags:  # the fragment first: the metadata (with the commitment) commits it
                if frag.index not in self._fds:
                    continue
                try:
                    _layout.write_party(self._fds[frag.index], frag, body)
                except OSError as e:  # (costs this rank's files only, as a lost disk would)
                    self.write_errors[frag.index] = str(e)
                    log.error("coded DCP save: writing %s failed: %s", self.path / folder(frag.index), e)
        finally:
            self._close()
        self.stats = {"share_bytes": len(share), "data_len": com.data_len, "bytes_sent": sent,
                      "serialise_s": t1 - t0, "encode_s": t2 - t1, "write_s": time.perf_counter() - t2}
        me = 0 if self.group is None else self.rank
        return _done([WriteResult(index=item.index, size_in_bytes=length,
                                  storage_data=(me, starts[me] + off, length, com.root))
                      for item, (off, length) in zip(items, spans, strict=True)])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing left to write: every rank wrote the metadata with its fragment."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


def _commitment_of(body: bytes) -> tuple[Metadata, Commitment]:
    return _dcp_meta.decode_file(body)[0], _layout.commitment_of(body)


class CodedStorageReader(StorageReader):
    """DCP ``StorageReader`` for :class:`CodedStorageWriter` checkpoints (see the module
    docstring). ``skipped``: folders or parts left out and why; ``stats``: bytes per phase,
    whether this rank was repaired, seconds; ``reported``/``bad``: whose blocks failed.
    `transport`: the :class:`._transport.Transport` class (tests inject faults through it).
    `scrub` (default): every load reads its rank's whole fragment and checks all its blocks, so a
    damaged one is found and rebuilt now; ``scrub=False`` reads only the row blocks the ranks ask
    for (a damaged block is decoded around where it is used, and stays on disk until a scrubbing
    load or ``rankwise ckpt verify``)."""

    def __init__(self, path: str | os.PathLike, *, transport: type[Transport] = Transport,
                 inner: tuple[str, ...] = (), scrub: bool = True) -> None:
        super().__init__()
        self.scrub = scrub
        self.root, self.inner, self.transport = Path(path), tuple(inner), transport
        self.path = self.root.joinpath(*self.inner)
        self.rank, world = _world()
        self.group = side_group() if world > 1 else None
        self.collective = False
        self.storage_data: dict = {}
        self.skipped: dict[str, str] = {}
        self.stats: dict[str, Any] = {}
        self.reported: dict[int, list[int]] = {}  # after a load: rank -> the ranks that found its data bad
        self.bad: list[int] = []  # the ranks more than t ranks reported

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A ``checkpoint_id`` is the checkpoint's folder (as for ``FileSystemReader``)."""
        if checkpoint_id is not None:
            self.root, self.inner = Path(checkpoint_id), ()
            self.path = self.root

    def _close_folder(self) -> None:
        if getattr(self, "_folder", None) is not None:
            self._folder.close()
        self._folder, self._fd = None, None

    def _skip(self, where: str, why: str) -> None:
        self.skipped[where] = why
        log.warning("coded DCP read: skipping %s: %s", where, why)

    def read_metadata(self) -> Metadata:
        """The metadata a quorum of the ranks (or, read alone, of the folders) holds byte for byte."""
        self.skipped, self.stats = {}, {}
        self._tp = None
        if self.group is not None:
            body = None
            self._close_folder()
            self._folder = contextlib.ExitStack()  # kept open: the load reads and writes what the vote read
            self._fd = None
            try:  # (a bad folder costs this rank's data only: it still takes part in every phase)
                self._fd = self._folder.enter_context(
                    _store.opened_folder(self.root, *self.inner, folder(self.rank), create=True))
                body, _, why = _layout.read_party(self._fd, None)
            except (OSError, ValueError) as e:
                why = str(e)
            if why:
                self._skip(folder(self.rank), why)
            tp = self.transport(self.group)
            agreed, holders = _phases.agree(tp, body, _store.MAX_METADATA)
            if agreed is not None:
                md, com = _commitment_of(agreed)
                if com.n == tp.size:
                    self.collective, self._tp, self.com, self._md_body = True, tp, com, agreed
                    self._repair_metadata = self.rank not in holders
                    self.code = Code2D(com.n, com.t, hash=com.hash)
                    self.leaves = _phases.leaf_matrix(self.code, com, _dcp_meta.leaves_of(agreed))
                    return md
        self.collective = False
        self._close_folder()
        return self._read_alone()

    def _read_alone(self) -> Metadata:
        """Every party's folder under the path (:func:`._layout.scan`) and the checkpoint decoded
        from any k fragments that verify."""
        found = _layout.scan(self.path)
        for where, why in found.skipped.items():
            self._skip(where, why)
        if found.body is None or found.com is None:
            raise FileNotFoundError(f"no coded DCP metadata that a quorum of the folders under "
                                    f"{self.path} agree on (skipped: {self.skipped})")
        md, com = _commitment_of(found.body)
        self.com, self.code = com, Code2D(com.n, com.t, hash=com.hash)
        frags = list(found.fragments.values())
        rejected: list[int] = []
        try:
            self._blob = memoryview(self.code.retrieve(frags, com, rejected=rejected))
        except NotEnoughSymbols as e:
            raise RuntimeError(f"the coded checkpoint at {self.path} cannot be decoded: {e} "
                               f"(skipped: {self.skipped})") from None
        finally:
            for pos in rejected:
                self._skip(folder(frags[pos].index), "fragment does not match the commitment")
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.chunks = {MetadataIndex(fqn, c.offsets): (m.properties.dtype, c.sizes)
                       for fqn, m in metadata.state_dict_metadata.items()
                       if isinstance(m, TensorStorageMetadata) for c in m.chunks}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _recover(self, plan: LoadPlan):
        """Collective: check, repair (and write back), then fetch the blocks this plan reads ->
        a function (offset, length) -> bytes of m."""
        t0 = time.perf_counter()
        tp, com, code = self._tp, self.com, self.code
        rows: _layout.RowBlocks | None = None
        try:
            fd, frag, why = self._fd, None, None
            try:  # (the folder the vote read, through its descriptor: a link swapped in since costs nothing)
                if fd is not None and self.scrub:
                    _, frag, why = _layout.read_party(fd, com)
                elif fd is not None:
                    rows = _layout.RowBlocks(fd, com)
            except (OSError, ValueError) as e:
                why = str(e)
            if why:
                self._skip(folder(self.rank), why)
            t1 = time.perf_counter()

            def load() -> Fragment | None:
                try:
                    return _layout.read_party(fd, com)[1]
                except (OSError, ValueError):
                    return None

            checked = (_phases.present_and_repair(code, tp, com, self.leaves, frag) if self.scrub else
                       _phases.present_and_repair(code, tp, com, self.leaves, None, present=rows is not None,
                                                  load=load))
            t2 = time.perf_counter()
            try:
                if fd is not None and checked.rebuilt is not None:
                    _store.write(FRAGMENT, checked.rebuilt, dir_fd=fd)
                whole = (checked.verified or checked.rebuilt) is not None
                if fd is not None and whole and self._repair_metadata:
                    _io.write_atomic(META, seal(METADATA, self._md_body), dir_fd=fd)  # (after the fragment)
            except OSError as e:  # the state is restored in memory; the disk refused the write-back
                log.error("coded DCP read: could not write rank %d's rebuilt files back: %s", self.rank, e)
                self._skip(folder(self.rank), f"write-back: {e}")
        finally:
            self._close_folder()
        B = com.block_size
        need: set[int] = set()
        for req in plan.items:
            _, start, length, _ = self.storage_data[req.storage_index]
            need.update(range(start // B, (start + max(length, 1) - 1) // B + 1))
        t3 = time.perf_counter()
        bad_blocks: set[int] = set()
        own = checked.rebuilt or checked.verified
        row_block = (None if own is None else
                     lambda c: np.frombuffer(own.row, np.uint8)[c * B:(c + 1) * B])
        if row_block is None and rows is not None:
            row_block = rows.block
        try:
            blocks, bad_blocks = _phases.fetch_blocks(code, tp, com, self.leaves, row_block,
                                                      checked.holders, need)
        finally:  # (every rank reports, also one whose retrieval failed: the others wait for it)
            self.reported = _phases.report(tp, checked.bad | bad_blocks)
            if rows is not None:
                rows.close()
        self.bad = sorted(p for p, by in self.reported.items() if len(by) > com.t)
        self.stats = {"sent": dict(tp.sent), "received": dict(tp.received), "control": dict(tp.control),
                      "repaired": checked.rebuilt is not None, "helpers": checked.helpers,
                      "blocks": sorted(need), "check_s": t1 - t0, "repair_s": t2 - t1,
                      "retrieve_s": time.perf_counter() - t3}

        def span(start: int, length: int):
            b, o = divmod(start, B)
            if o + length <= B:  # within one block: a view of it
                return memoryview(blocks[b])[o:o + length]
            out, pos = bytearray(length), start
            while pos < start + length:
                b, o = divmod(pos, B)
                take = min(B - o, start + length - pos)
                out[pos - start:pos - start + take] = memoryview(blocks[b])[o:o + take]
                pos += take
            return out

        return span

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        if self.collective:
            span = self._recover(plan)
        else:
            blob = self._blob

            def span(start: int, length: int) -> bytearray:
                return bytearray(blob[start:start + length])

        for req in plan.items:
            _, start, length, _ = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                chunk = io.BytesIO(span(start, length))
                planner.load_bytes(req, _weights_only(chunk, req.storage_index.fqn))
                continue
            dtype, sizes = self.chunks[MetadataIndex(req.storage_index.fqn, req.storage_index.offset)]
            if length != sizes.numel() * dtype.itemsize:
                raise RuntimeError(f"{req.storage_index}: {length} bytes stored for a {dtype} chunk of "
                                   f"{tuple(sizes)}")
            raw = span(start, length)
            t = (torch.frombuffer(raw, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8))
            t = t.view(dtype).reshape(sizes)
            for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                t = t.narrow(dim, o, n)
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise RuntimeError(f"{req.storage_index}: stored {tuple(t.size())}, "
                                   f"expected {tuple(target.size())}")
            target.copy_(t)
            planner.commit_tensor(req, target)
        self.stats["read_s"] = time.perf_counter() - t0
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False
