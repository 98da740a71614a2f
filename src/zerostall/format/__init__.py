"""On-disk format: shard layout, manifest, dtypes, the state-dict tree and checksums.

Pure functions and frozen records; this layer performs no I/O of its own except reading
and writing the small manifest. It never unpickles anything read from a
file: the only unpickler (:mod:`.frozen`) reads the caller's own in-memory snapshot of builtin
containers and resolves no global but the builtin value types.
"""

from .dtypes import dtype_from_name, dtype_name
from .layout import HEADER_BYTES, ShardHeader, align_up
from .manifest import FORMAT_VERSION, FileEntry, Manifest, TensorEntry
from .tree import TensorLeaf, decode_tree, encode_tree

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "FileEntry",
    "Manifest",
    "ShardHeader",
    "TensorEntry",
    "TensorLeaf",
    "align_up",
    "decode_tree",
    "dtype_from_name",
    "dtype_name",
    "encode_tree",
]
