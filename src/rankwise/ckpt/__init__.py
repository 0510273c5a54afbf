"""Two-dimensional coded checkpoints with peer repair: codec, commitments, on-disk format."""

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
from ._store import fragment_path as fragment_path
from ._store import load_commitment as load_commitment
from ._store import load_fragments as load_fragments
from ._store import read_commitment as read_commitment
from ._store import read_fragment as read_fragment
from ._store import save_dispersal as save_dispersal
