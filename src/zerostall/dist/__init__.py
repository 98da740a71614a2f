"""Deprecated alias of :mod:`zerostall.distributed` (renamed: ``dist`` is a build-output name that
linters and structure tools skip). Kept importable for one release, and so that DCP metadata
written before the rename (which pickles ``zerostall.dist.dcp_storage._ZSInfo``) still resolves.
"""

import importlib
import sys
import warnings

warnings.warn("zerostall.dist is renamed zerostall.distributed; the alias goes in the next release",
              DeprecationWarning, stacklevel=2)

for _name in ("commit", "dcp_inspect", "dcp_meta", "dcp_read", "dcp_storage", "ranks", "session"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"zerostall.distributed.{_name}")
    globals()[_name] = sys.modules[f"{__name__}.{_name}"]
del _name
