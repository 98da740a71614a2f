"""``torch.distributed.checkpoint`` storage on zerostall: ``Writer`` and ``Reader``.

See :mod:`zerostall.dist.dcp_storage`.
"""

from .dist.dcp_storage import Reader, Writer

__all__ = ["Reader", "Writer"]
