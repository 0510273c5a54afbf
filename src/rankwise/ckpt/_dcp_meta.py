"""DCP ``Metadata`` as JSON with every field written out: nothing is unpickled on the read path.

What is encoded: ``state_dict_metadata`` (tensors: dtype, layout, requires_grad, memory format,
pin_memory, size, chunks; bytes entries), ``planner_data`` (the default planners' tuples of
path components: strings and ints), ``storage_data`` (this storage's ``(owner, offset, length,
commitment root)`` per ``MetadataIndex``) and ``version``. Anything else (a custom planner's
objects) is refused at save time with a ``TypeError`` naming it, instead of being pickled.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ._layout import FORMAT

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.layout)}
_FORMATS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.memory_format)}


def _plain(x: Any, where: str) -> Any:
    """Strings, ints, floats, bools, None, and lists/tuples of them (tuples as lists)."""
    if x is None or isinstance(x, str | bool | int | float):
        return x
    if isinstance(x, list | tuple):
        return [_plain(v, where) for v in x]
    raise TypeError(f"coded DCP metadata: {where} holds a {type(x).__name__}, which is not written "
                    "(only strings, numbers and lists of them; no pickles)")


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def encode(md: Metadata) -> bytes:
    """`md` as canonical JSON bytes (sorted keys: the same metadata, the same bytes)."""
    entries = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes"}
        elif isinstance(m, TensorStorageMetadata):
            p = m.properties
            entries[fqn] = {"kind": "tensor", "dtype": str(p.dtype), "layout": str(p.layout),
                            "requires_grad": bool(p.requires_grad), "memory_format": str(p.memory_format),
                            "pin_memory": bool(p.pin_memory), "size": list(m.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
        else:
            raise TypeError(f"coded DCP metadata: {fqn} has storage metadata {type(m).__name__}")
    storage = []
    for idx, (owner, offset, length, root) in (md.storage_data or {}).items():
        storage.append([[idx.fqn, None if idx.offset is None else list(idx.offset), idx.index],
                        [int(owner), int(offset), int(length), bytes(root).hex()]])
    planner = md.planner_data
    if planner is not None and not isinstance(planner, dict):
        raise TypeError(f"coded DCP metadata: planner_data is a {type(planner).__name__}, not a dict")
    doc = {"format": FORMAT, "version": md.version, "state_dict_metadata": entries, "storage_data": storage,
           "planner_data": None if planner is None else
           {str(k): _plain(v, f"planner_data[{k!r}]") for k, v in planner.items()}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode(blob: bytes) -> Metadata:
    """The :class:`Metadata` of :func:`encode`; anything malformed raises ``ValueError``."""
    try:
        doc = json.loads(blob.decode("utf-8"))
        if doc.get("format") != FORMAT:
            raise ValueError(f"not {FORMAT} (format {doc.get('format')!r})")
        entries: dict[str, Any] = {}
        for fqn, e in doc["state_dict_metadata"].items():
            if e["kind"] == "bytes":
                entries[fqn] = BytesStorageMetadata()
                continue
            if e["kind"] != "tensor":
                raise ValueError(f"{fqn}: unknown kind {e['kind']!r}")
            props = TensorProperties(dtype=_DTYPES[e["dtype"]], layout=_LAYOUTS[e["layout"]],
                                     requires_grad=bool(e["requires_grad"]),
                                     memory_format=_FORMATS[e["memory_format"]],
                                     pin_memory=bool(e["pin_memory"]))
            chunks = [ChunkStorageMetadata(offsets=torch.Size(_ints(o)), sizes=torch.Size(_ints(s)))
                      for o, s in e["chunks"]]
            size = torch.Size(_ints(e["size"]))
            entries[fqn] = TensorStorageMetadata(properties=props, size=size, chunks=chunks)
        storage = {}
        for (fqn, offset, index), (owner, off, length, root) in doc["storage_data"]:
            key = MetadataIndex(fqn=str(fqn), offset=None if offset is None else torch.Size(_ints(offset)),
                                index=None if index is None else int(index))
            storage[key] = (int(owner), int(off), int(length), bytes.fromhex(root))
        planner = doc["planner_data"]
        planner = None if planner is None else {k: _tuples(v) for k, v in planner.items()}
        version = doc["version"]
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"coded DCP metadata is malformed: {type(e).__name__}: {e}") from None
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(), version=version)


def _ints(xs) -> list[int]:
    if not isinstance(xs, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in xs):
        raise ValueError(f"expected a list of ints; got {xs!r}")
    return xs


# ------------------------------------------------------------------ built by every rank
def share_doc(items: list, spans: list[tuple[int, int]], planner_data: Any) -> bytes:
    """What one rank wrote: its plan's items (name, chunk, properties) with each item's
    `(offset, length)` inside its share, and its planner's data; JSON, exchanged at save time so
    that every rank writes the same metadata (:func:`merged`)."""
    rows = []
    for item, (offset, length) in zip(items, spans, strict=True):
        idx, td = item.index, item.tensor_data
        tensor = None
        if td is not None:
            p = td.properties
            tensor = {"dtype": str(p.dtype), "layout": str(p.layout), "requires_grad": bool(p.requires_grad),
                      "memory_format": str(p.memory_format), "pin_memory": bool(p.pin_memory),
                      "size": list(td.size), "chunk": [list(td.chunk.offsets), list(td.chunk.sizes)]}
        rows.append([idx.fqn, None if idx.offset is None else list(idx.offset), idx.index, tensor,
                     int(offset), int(length)])
    if planner_data is not None and not isinstance(planner_data, dict):
        raise TypeError(f"coded DCP metadata: planner_data is a {type(planner_data).__name__}, not a dict")
    planner = None if planner_data is None else {str(k): _plain(v, f"planner_data[{k!r}]")
                                                  for k, v in planner_data.items()}
    return json.dumps({"items": rows, "planner_data": planner}, separators=(",", ":")).encode()


def merged(docs: list[bytes], starts: list[int], root: bytes) -> Metadata:
    """The DCP metadata of a save from every rank's :func:`share_doc` (rank order, as DCP's
    global plan orders chunks), rank r's share starting at ``starts[r]`` of the checkpoint whose
    commitment root is `root`: storage data ``(rank, offset, length, root)`` per item."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, tuple] = {}
    planner: dict[str, Any] | None = None
    for rank, (doc, start) in enumerate(zip(docs, starts, strict=True)):
        d = json.loads(doc.decode("utf-8"))
        for fqn, offset, index, tensor, off, length in d["items"]:
            key = MetadataIndex(fqn=fqn, offset=None if offset is None else torch.Size(offset), index=index)
            storage[key] = (rank, start + off, length, root)
            if tensor is None:
                entries[fqn] = BytesStorageMetadata()
                continue
            md = entries.setdefault(fqn, TensorStorageMetadata(
                properties=TensorProperties(dtype=_DTYPES[tensor["dtype"]], layout=_LAYOUTS[tensor["layout"]],
                                            requires_grad=tensor["requires_grad"],
                                            memory_format=_FORMATS[tensor["memory_format"]],
                                            pin_memory=tensor["pin_memory"]),
                size=torch.Size(tensor["size"]), chunks=[]))
            md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(tensor["chunk"][0]),
                                                  sizes=torch.Size(tensor["chunk"][1])))
        if d["planner_data"] is not None:
            planner = {**{k: _tuples(v) for k, v in d["planner_data"].items()}, **(planner or {})}
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta())


def encode_file(md: Metadata, commitment: bytes, leaves: bytes = b"") -> bytes:
    """A rank folder's metadata file body: :func:`encode` with the commitment's bytes and the
    n×n leaf hashes of the grid (row-major; checked against the commitment when read)."""
    doc = json.loads(encode(md))
    doc["commitment"] = commitment.hex()
    doc["leaves"] = leaves.hex()
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode_file(body: bytes) -> tuple[Metadata, bytes]:
    """The metadata and commitment bytes of :func:`encode_file` (``ValueError`` if malformed)."""
    try:
        doc = json.loads(body.decode("utf-8"))
        com = bytes.fromhex(doc.pop("commitment"))
        doc.pop("leaves", None)
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, AttributeError, RecursionError) as e:
        raise ValueError(f"coded DCP metadata is malformed: {type(e).__name__}: {e}") from None
    return decode(json.dumps(doc).encode("utf-8")), com


def leaves_of(body: bytes) -> bytes:
    """The leaf hashes :func:`encode_file` stored (``ValueError`` if there are none)."""
    try:
        return bytes.fromhex(json.loads(body.decode("utf-8"))["leaves"])
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"coded DCP metadata holds no leaf hashes: {type(e).__name__}: {e}") from None
