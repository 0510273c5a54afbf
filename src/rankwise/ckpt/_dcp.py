"""torch.distributed.checkpoint storage on 2-D coded fragments spread over n folders.

Each rank gathers the items it writes into one blob (in plan order, tensors with ``torch.save``),
encodes the blob with :class:`Code2D` (n = number of locations) and writes fragment i, plus a
copy of the commitment, to location i. The DCP metadata (small) is replicated to every location
as JSON with its fields written out (:mod:`rankwise.ckpt._dcp_meta`; nothing is unpickled when
reading), and a reader accepts it only when a quorum of the locations holds the same bytes
(n − ⌊(n − 1)/3⌋, which the t ≤ ⌊(n − 1)/3⌋ bad locations cannot reach and the honest ones
always do). The metadata names each blob's commitment root; a read decodes each needed blob
from any k = n − t locations whose fragment verifies against that commitment: up to t deleted,
corrupted or rewritten locations are tolerated.

Files, in every location (:mod:`._store`): ``.metadata.rwck`` and, per writing rank r,
``__{r}.frag.rwck`` and ``__{r}.commit.rwck``; all sealed and written atomically.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
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

from . import _dcp_meta, _store
from ._code2d import Code2D, NotEnoughSymbols
from ._format import Commitment, Fragment

log = logging.getLogger(__name__)

def _locations(locations) -> list[Path]:
    locs = [Path(p) for p in locations]
    _distinct(locs)
    return locs


def _distinct(locs: list[Path]) -> None:
    """Refuse locations that are one folder under two names (the same spelling, a symbolic link
    to another location, ``a`` and ``./a``): the existing ones are compared by identity (device
    and inode), the others by their resolved path. Two names for one folder would hold one
    fragment where the code counts two, so fewer than t losses could make the data unreadable."""
    seen: dict[object, Path] = {}
    for loc in locs:
        try:
            st = os.stat(loc)
            key: object = (st.st_dev, st.st_ino)
        except OSError:
            key = loc.resolve()
        if key in seen:
            raise ValueError(f"storage locations must be distinct folders; {seen[key]} and {loc} are the "
                             "same folder")
        seen[key] = loc


def _subfolders(roots: list[Path], checkpoint_id) -> list[Path]:
    if checkpoint_id is None:
        return roots
    sub = Path(checkpoint_id)
    if sub.is_absolute() or ".." in sub.parts:
        raise ValueError(f"checkpoint_id must be a relative name inside every location; "
                         f"got {checkpoint_id!r}")
    return [r / sub for r in roots]


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


class CodedStorageWriter(StorageWriter):
    """DCP ``StorageWriter``: every rank's data as 2-D coded fragments over ``locations``
    (n = len(locations) folders, any k = n − t of which suffice to read; 3t < n)."""

    def __init__(self, locations, *, t: int, hash: str = "blake3") -> None:
        super().__init__()
        self._roots = self.locations = _locations(locations)
        self.code = Code2D(len(self.locations), t, hash=hash)  # validates n, t
        self.rank, self.is_coordinator = 0, True

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A ``checkpoint_id`` (a relative name) selects that subfolder of every location."""
        self.locations = _subfolders(self._roots, checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives") is False:
            raise ValueError("CodedStorageWriter needs use_collectives=True (one metadata for all ranks)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for loc in self.locations:
            loc.mkdir(parents=True, exist_ok=True)
        _distinct(self.locations)  # now that they all exist: by identity
        return dataclasses.replace(plan, storage_data=self.rank)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        owner = plan.storage_data if plan.storage_data is not None else self.rank
        buf, spans = io.BytesIO(), []
        items = ([i for i in plan.items if i.type == WriteItemType.BYTE_IO]
                 + [i for i in plan.items if i.type != WriteItemType.BYTE_IO])
        for item in items:
            data = planner.resolve_data(item)
            offset = buf.tell()
            if item.type == WriteItemType.BYTE_IO:
                buf.write(data.getbuffer())
            else:
                t = data.detach().cpu()
                if t.untyped_storage().nbytes() != t.nbytes:
                    t = t.clone()  # a view would serialise its whole base storage
                torch.save(t, buf)
            spans.append((item.index, offset, buf.tell() - offset))
        disp = self.code.encode(buf.getvalue())
        root = disp.commitment.root  # ties the metadata to exactly this save's fragments
        results = [WriteResult(index=i, size_in_bytes=n, storage_data=(owner, off, n, root))
                   for i, off, n in spans]
        for loc, frag in zip(self.locations, disp.fragments, strict=True):
            _store.write(_store.dcp_fragment(loc, owner), frag)
            _store.write(_store.dcp_commitment(loc, owner), disp.commitment)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
        metadata.storage_meta = StorageMeta()
        body = _dcp_meta.encode(metadata)
        for loc in self.locations:
            _store.write_metadata(loc / _store.DCP_METADATA, body)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


class CodedStorageReader(StorageReader):
    """DCP ``StorageReader`` for :class:`CodedStorageWriter` checkpoints: decodes every blob from
    any k of the n ``locations`` (missing or corrupted ones are skipped and logged)."""

    def __init__(self, locations, *, hash: str = "blake3") -> None:
        super().__init__()
        self._roots = self.locations = _locations(locations)
        self.hash = hash
        self.storage_data: dict = {}
        self.skipped: dict[str, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A ``checkpoint_id`` (a relative name) selects that subfolder of every location."""
        self.locations = _subfolders(self._roots, checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata that a quorum of the n locations holds byte for byte (see the module
        docstring); decoded from JSON, never unpickled. Locations that disagree are logged."""
        _distinct(self.locations)  # one folder under two names would count its metadata twice
        n = len(self.locations)
        quorum = n - (n - 1) // 3
        held: dict[bytes, list[Path]] = {}
        problems = []
        for loc in self.locations:
            try:
                body = _store.read_metadata(loc / _store.DCP_METADATA)
            except OSError as e:
                problems.append(f"{loc}: {e.strerror or e}")
                continue
            except (ValueError, MemoryError) as e:
                problems.append(f"{loc}: {e}")
                continue
            held.setdefault(body, []).append(loc)
        agreed = [body for body, locs in held.items() if len(locs) >= quorum]
        for body, locs in held.items():
            if body not in agreed:
                problems.append(f"{', '.join(map(str, locs))}: metadata differs from the other locations'")
        if problems:
            self.skipped.update({"metadata": "; ".join(problems)})
            log.warning("coded DCP metadata: %s", "; ".join(problems))
        if not agreed:
            raise FileNotFoundError(f"no coded DCP metadata that {quorum} of the {n} locations agree on: "
                                    + "; ".join(problems or ["the locations disagree"]))
        return _dcp_meta.decode(agreed[0])

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _blob(self, owner: int, root: bytes) -> bytes:
        """Rank ``owner``'s blob, from the fragments whose commitment is the one the metadata
        names (a location holding another save's files is skipped, not trusted)."""
        com: Commitment | None = None
        frags: list[tuple[Path, Fragment]] = []

        def skip(loc: Path, why: str) -> None:
            self.skipped[f"{loc}/{owner}"] = why
            log.warning("coded DCP read: skipping %s for rank %d's data: %s", loc, owner, why)

        for loc in self.locations:
            try:
                c = _store.read_commitment(_store.dcp_commitment(loc, owner))
                if c.root != root:
                    raise ValueError("its commitment belongs to another save")
                com = c
                frags.append((loc, _store.read_fragment(_store.dcp_fragment(loc, owner), c)))
            except (OSError, ValueError, MemoryError) as e:
                skip(loc, str(e))
        if com is None:
            raise RuntimeError(f"rank {owner}'s data cannot be decoded: no location holds the commitment "
                               f"the metadata names (skipped: {self.skipped})")
        rejected: list[int] = []  # fragments that fail the commitment: their locations are named
        code = Code2D(com.n, com.t, hash=com.hash)
        try:
            return code.retrieve([f for _, f in frags], com, rejected=rejected)
        except NotEnoughSymbols as e:
            err = e
        finally:
            for pos in rejected:
                skip(frags[pos][0], "fragment does not match the commitment (corrupted or foreign)")
        raise RuntimeError(f"rank {owner}'s data cannot be decoded: {err} (skipped: {self.skipped})") from err

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        blobs: dict[int, memoryview] = {}
        for req in plan.items:
            owner, offset, length, root = self.storage_data[req.storage_index]
            if owner not in blobs:
                blobs[owner] = memoryview(self._blob(owner, root))
            chunk = io.BytesIO(blobs[owner][offset:offset + length].tobytes())
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, _weights_only(chunk, req.storage_index.fqn))
                continue
            t = torch.load(chunk, map_location="cpu", weights_only=True)
            for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                t = t.narrow(dim, o, n)
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise RuntimeError(f"{req.storage_index}: stored {tuple(t.size())}, "
                                   f"expected {tuple(target.size())}")
            target.copy_(t)
            planner.commit_tensor(req, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False
