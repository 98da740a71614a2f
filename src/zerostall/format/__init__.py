"""On-disk format: shard layout, manifest, dtypes, the state-dict tree and checksums.

Pure functions and frozen records; this layer performs no I/O of its own except reading
and writing the small manifest. It never unpickles anything read from a file: the only
unpickler (:mod:`.frozen`) reads the caller's own in-memory snapshot of builtin containers.
Reading a manifest (:mod:`.manifest`, :mod:`.decode`) imports no torch; the tensor side
(:mod:`.tree`, :mod:`.dtypes`, :mod:`.shard`, :mod:`.bulk`) does, and is imported by name.
"""

from .manifest import FileEntry, Manifest, TensorEntry

__all__ = ["FileEntry", "Manifest", "TensorEntry"]
