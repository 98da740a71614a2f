"""The extension surface: what an adapter of a framework's own checkpoint files may use beside
the public API (:mod:`zerostall`). The framework adapters in :mod:`zerostall.integrations`
use only these and the public API (a test checks it); third-party adapters should too.

* :func:`publish_dir`, :func:`discard`, :func:`fsync_dir`, :func:`write_file_durable`: the
  atomic file operations every commit uses (rename or exchange, fsync of the parent; a tree
  renamed aside, then removed);
* :class:`RootLock`: the lock that makes one process the writer of a root;
* :func:`open_root`: a root's tier (its committed steps);
* :class:`Worker`: a daemon thread draining a queue in order (e.g. a post-commit publisher);
* :class:`TaggedData`: the stored form of an object kept as its data (``export`` unwraps it);
* :func:`as_python_state`, :func:`as_numpy_state`: a saved :func:`~zerostall.rng_state` entry in
  the form ``random``/``numpy`` give (for a framework's own RNG files).
"""

from ._util import Worker
from .format.objects import TaggedData
from .rng import as_numpy_state, as_python_state
from .store import open_root
from .store.atomic import discard, fsync_dir, publish_dir, write_file_durable
from .store.owner import RootLock

__all__ = ["RootLock", "TaggedData", "Worker", "as_numpy_state", "as_python_state", "discard", "fsync_dir",
           "open_root", "publish_dir", "write_file_durable"]
