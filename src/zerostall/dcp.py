"""``torch.distributed.checkpoint`` storage on zerostall: ``Writer`` and ``Reader``.

Drop-ins for ``FileSystemWriter``/``FileSystemReader``; see :mod:`zerostall.dist.dcp_storage`
(saving) and :mod:`zerostall.dist.dcp_read` (loading, also FileSystemWriter checkpoints).
"""

from .dist.dcp_read import Reader
from .dist.dcp_storage import CheckpointAlreadyExists, UnsupportedCheckpoint, Writer

__all__ = ["CheckpointAlreadyExists", "Reader", "UnsupportedCheckpoint", "Writer"]
