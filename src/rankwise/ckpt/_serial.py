"""Serialisation buffers of the checkpointer: the state to bytes without copying it twice
(:class:`_Sink`), bytes back to objects (``weights_only`` by default), CPU snapshots of a
state, and the (n, L) buffer a restore receives rows into, from which the tensors are mapped
(:class:`_Rows`, :func:`_load_rows`)."""

from __future__ import annotations

import copy as _copy
import io
import os
from typing import Any

import numpy as np
import torch

from ._code2d import Code2D


def serialize(state: Any) -> bytes:
    """Deterministic bytes of a state dict (``torch.save``; same state, same bytes)."""
    return bytes(_Sink().dump(state))


class _Sink:
    """A write-only stream for ``torch.save`` into one reusable buffer: sized from the state's
    tensors on first use and kept, so that a checkpointer that saves every few steps neither
    grows a ``BytesIO`` by copies nor faults in fresh pages at every save."""

    def __init__(self) -> None:
        self.buf, self.size = np.empty(0, np.uint8), 0

    def dump(self, state: Any) -> memoryview:
        """``torch.save(state)`` into the buffer -> a view of the bytes (valid until the next dump)."""
        self.size = 0
        nbytes, count = _tensor_bytes(state)
        self._reserve(nbytes + 2**20 + 1024 * count)  # (torch.save adds about 300 bytes a tensor)
        torch.save(state, self)
        return memoryview(self.buf[:self.size])

    def _reserve(self, total: int) -> None:
        if total > len(self.buf):
            new = np.empty(total, np.uint8)
            new[:self.size] = self.buf[:self.size]
            self.buf = new

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        if self.size + len(b) > len(self.buf):
            self._reserve(max(self.size + len(b), len(self.buf) + len(self.buf) // 4))
        self.buf[self.size:self.size + len(b)] = np.frombuffer(b, np.uint8)
        self.size += len(b)
        return len(b)

    def flush(self) -> None:
        pass


def _tensor_bytes(obj: Any) -> tuple[int, int]:
    """(bytes, count) of the tensors in a state: a size hint for :class:`_Sink`."""
    if isinstance(obj, torch.Tensor):
        try:
            return obj.untyped_storage().nbytes(), 1
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return obj.numel() * obj.element_size(), 1
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    sizes = [_tensor_bytes(v) for v in items]
    return sum(b for b, _ in sizes), sum(c for _, c in sizes)


class _ViewReader(io.RawIOBase):
    """A seekable read-only stream over a buffer (``io.BytesIO`` would copy it first)."""

    def __init__(self, data) -> None:
        self.mv, self.pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        got = self.mv[self.pos:self.pos + len(b)]
        memoryview(b).cast("B")[:len(got)] = got
        self.pos += len(got)
        return len(got)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.mv)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos


def deserialize(blob: bytes | memoryview, *, weights_only: bool = True) -> Any:
    """``torch.load`` from a buffer, reading the tensors straight out of it."""
    return torch.load(_ViewReader(blob), weights_only=weights_only)


def _to_cpu(obj: Any, *, copy: bool = False) -> Any:
    """Tensors moved to the CPU (``torch.save`` records devices, so GPU ranks would otherwise
    serialise the same state to different bytes). Containers are rebuilt only where something
    moved, keeping a state dict's ``_metadata``; CPU-only states come back as they are.

    With `copy`, every tensor is copied to host memory and every container rebuilt (other
    leaves deep-copied): the snapshot a background save encodes while training goes on
    changing the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if copy or obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        new = {k: _to_cpu(v, copy=copy) for k, v in obj.items()}
        if not copy and all(new[k] is v for k, v in obj.items()):
            return obj
        out = type(obj)(new.items())
        if hasattr(obj, "_metadata"):
            out._metadata = _copy.deepcopy(obj._metadata) if copy else obj._metadata
        return out
    if type(obj) in (list, tuple):
        new = [_to_cpu(v, copy=copy) for v in obj]
        return obj if not copy and all(a is b for a, b in zip(new, obj, strict=True)) else type(obj)(new)
    return _copy.deepcopy(obj) if copy else obj


class _Rows:
    """The (n, L) buffer a restore receives rows into. On Linux it is a memfd (an anonymous
    in-memory file, gone with its last mapping) so that ``torch.load(mmap=True)`` can map the
    state's tensors from the received pages; elsewhere plain memory."""

    def __init__(self, n: int, L: int) -> None:
        self.fd: int | None = None
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            try:
                self.fd = os.memfd_create("rankwise-restore", os.MFD_CLOEXEC)
                os.ftruncate(self.fd, n * L)
                storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{self.fd}", True, n * L)
                self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage).view(n, L)
            except (OSError, RuntimeError):
                self.close()
        if self.fd is None:
            self.tensor = torch.empty((n, L), dtype=torch.uint8)
        self.array = self.tensor.numpy()

    def close(self) -> None:
        """Drop this buffer's mapping and descriptor (tensors mapped from it stay valid)."""
        self.tensor = self.array = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _load_rows(rows: _Rows, idx: list[int], data_len: int, code: Code2D, weights_only: bool) -> Any:
    """The saved object from k verified rows ``rows[idx]`` (then `rows` is closed). From the
    systematic rows in a memfd, the tensors are mapped from the received bytes
    (``torch.load(mmap=True)``: no second copy of the state); otherwise decoded and read from
    memory."""
    k = code.k
    try:
        if idx == list(range(k)) and rows.fd is not None:
            os.ftruncate(rows.fd, data_len)  # the file is now exactly the torch.save bytes
            return torch.load(f"/proc/self/fd/{rows.fd}", mmap=True, weights_only=weights_only)
        C = rows.array[:k] if idx == list(range(k)) else rows.array[idx]
        return deserialize(code.decode_rows(C, idx, data_len), weights_only=weights_only)
    finally:
        rows.close()
