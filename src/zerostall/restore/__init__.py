"""The restore stage: find the newest step that verifies and load it (one entry: :func:`load`,
caller's thread). :mod:`.pipeline` walks the candidates; :mod:`.step` and :mod:`.stream` read
one; :mod:`.state` places the tensors; :mod:`.download` fetches a remote's steps.
"""

from .download import FETCH_LOCK_NAME
from .pipeline import LoadRequest, load
from .state import LoadReport
from .step import load_step, verify_step, verify_tier_step

__all__ = ["FETCH_LOCK_NAME", "LoadReport", "LoadRequest", "load", "load_step", "verify_step", "verify_tier_step"]
