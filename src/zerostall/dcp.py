"""``torch.distributed.checkpoint`` storage on zerostall: ``Writer`` and ``Reader``.

Drop-ins for ``FileSystemWriter``/``FileSystemReader``; see :mod:`zerostall.integrations.dcp_writer`
(saving) and :mod:`zerostall.integrations.dcp_reader` (loading, also FileSystemWriter checkpoints).
"""

from .integrations.dcp_reader import Reader
from .integrations.dcp_writer import CheckpointAlreadyExists, UnsupportedCheckpoint, Writer

__all__ = ["CheckpointAlreadyExists", "Reader", "UnsupportedCheckpoint", "Writer"]
