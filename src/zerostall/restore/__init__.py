"""The restore stage: find the newest step that verifies and load it (one entry: :func:`load`).

Called from the caller's thread (``zerostall.load``, ``Checkpointer.load``, the CLI).
Modules, downward only:

- :mod:`.pipeline` -- candidate steps newest first, per step: manifest, files, bytes, fallback;
  remote fetch; ``verify_step``/``verify_tier_step`` for the CLI.
- :mod:`.state` -- where restored tensors go (in place, new, ``keys=``) and the :class:`LoadReport`.
- :mod:`.refs` -- incremental steps' borrowed bytes (reference files).
- :mod:`.retry` -- the rule for a step that changes while it is read (load and verify share it).
"""

from .pipeline import FETCH_LOCK_NAME, LoadRequest, fetch_remote_step, load, load_step, verify_step, verify_tier_step
from .state import LoadReport

__all__ = ["FETCH_LOCK_NAME", "LoadReport", "LoadRequest", "fetch_remote_step", "load", "load_step", "verify_step",
           "verify_tier_step"]
