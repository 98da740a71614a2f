"""``torch.distributed.checkpoint`` storage on zerostall: ``Writer`` and ``Reader``.

Drop-ins for ``FileSystemWriter``/``FileSystemReader``; see :mod:`zerostall.distributed.dcp_storage`
(saving) and :mod:`zerostall.distributed.dcp_read` (loading, also FileSystemWriter checkpoints).
"""

from .distributed.dcp_read import Reader
from .distributed.dcp_storage import CheckpointAlreadyExists, UnsupportedCheckpoint, Writer

__all__ = ["CheckpointAlreadyExists", "Reader", "UnsupportedCheckpoint", "Writer"]
