"""The restore stage: find the newest step that verifies and load it (one entry: :func:`load`).

Called from the caller's thread (``zerostall.load``, ``Checkpointer.load``, the CLI).
Modules, downward only:

- :mod:`.pipeline` -- candidate steps newest first, per step (:mod:`.step`, :mod:`.stream`),
  fallback; a remote's steps through :mod:`.download`.
- :mod:`.state` -- where restored tensors go (in place, new, ``keys=``) and the :class:`LoadReport`.
- :mod:`.retry` -- the rule for a step that changes while it is read (load and verify share it).
"""

from .download import FETCH_LOCK_NAME
from .pipeline import LoadRequest, load
from .state import LoadReport
from .step import load_step, verify_step, verify_tier_step

__all__ = ["FETCH_LOCK_NAME", "LoadReport", "LoadRequest", "load", "load_step", "verify_step", "verify_tier_step"]
