"""Two-dimensional coded checkpoints with peer repair: codec, commitments, on-disk format.

The names are loaded on first use (as :mod:`rankwise` does), so that reading a commitment or
checking a command's arguments does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the private module that defines it
_LAZY: dict[str, str] = {
    "CodedCheckpointer": "_checkpointer",
    "Restored": "_checkpointer",
    "Code2D": "_code2d",
    "Dispersal": "_code2d",
    "NotEnoughSymbols": "_code2d",
    "CodedStorageReader": "_dcp",
    "CodedStorageWriter": "_dcp",
    "Commitment": "_format",
    "Fragment": "_format",
    "RepairSymbols": "_format",
    "read_commitment": "_store",
    "read_fragment": "_store",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # what static tools and IDEs see
    from ._checkpointer import CodedCheckpointer as CodedCheckpointer
    from ._checkpointer import Restored as Restored
    from ._code2d import Code2D as Code2D
    from ._code2d import Dispersal as Dispersal
    from ._code2d import NotEnoughSymbols as NotEnoughSymbols
    from ._dcp import CodedStorageReader as CodedStorageReader
    from ._dcp import CodedStorageWriter as CodedStorageWriter
    from ._format import Commitment as Commitment
    from ._format import Fragment as Fragment
    from ._format import RepairSymbols as RepairSymbols
    from ._store import read_commitment as read_commitment
    from ._store import read_fragment as read_fragment


def __getattr__(name: str) -> Any:
    if name == "testing":  # (the test doubles: a lying rank)
        return importlib.import_module("rankwise.ckpt.testing")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rankwise.ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rankwise.ckpt.{module}"), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    """The public names and the test doubles' module (not this module's own imports)."""
    return sorted({*_LAZY, "testing"})
