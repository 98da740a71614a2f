"""On-disk format: shard layout, manifest, dtypes, the state-dict tree and checksums.

Pure functions and frozen records; this layer performs no I/O of its own except reading
and writing the small manifest. It never unpickles anything read from a
file: the only unpickler (:mod:`.frozen`) reads the caller's own in-memory snapshot of builtin
containers and resolves no global but the builtin value types. Reading a manifest
(:mod:`.manifest`, :mod:`.decode`) imports no torch; the tensor side (:mod:`.tree`'s
encoder, :mod:`.dtypes`, :mod:`.shard`, :mod:`.bulk`) does, and is imported by name.
"""

from .decode import decode_tree
from .layout import HEADER_BYTES, ShardHeader, align_up
from .manifest import FORMAT_VERSION, FileEntry, Manifest, TensorEntry

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "FileEntry",
    "Manifest",
    "ShardHeader",
    "TensorEntry",
    "align_up",
    "decode_tree",
]
