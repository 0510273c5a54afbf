"""Two-dimensional coded checkpoints with peer repair: codec, commitments, on-disk format."""

from ._checkpointer import CodedCheckpointer as CodedCheckpointer
from ._code2d import Code2D as Code2D
from ._code2d import Commitment as Commitment
from ._code2d import Dispersal as Dispersal
from ._code2d import Fragment as Fragment
from ._code2d import NotEnoughSymbols as NotEnoughSymbols
from ._code2d import RepairSymbols as RepairSymbols
from ._dcp import CodedStorageReader as CodedStorageReader
from ._dcp import CodedStorageWriter as CodedStorageWriter
from ._store import fragment_path as fragment_path
from ._store import load_commitment as load_commitment
from ._store import load_fragments as load_fragments
from ._store import save_dispersal as save_dispersal
