"""On-disk format: shard layout, manifest, dtypes, the state-dict tree and checksums.

Pure functions and frozen records; no I/O but the small manifest's. Never unpickles anything
read from a file (:mod:`.frozen` unpickles only the caller's in-memory snapshot). Reading a
manifest imports no torch; the tensor side (:mod:`.tree`, :mod:`.shard`, ...) is imported by name.
"""

from .manifest import FileEntry, Manifest, TensorEntry

__all__ = ["FileEntry", "Manifest", "TensorEntry"]
