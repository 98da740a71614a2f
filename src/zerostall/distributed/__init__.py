"""Distributed: rank discovery and the cross-rank commit protocol (and, later, DCP storage).

Imports ``store``, ``format`` and ``staging`` (downward); nothing here imports the
checkpointer or the CLI.
"""

from .commit import StoreCommitter, commit_round
from .ranks import RankInfo, discover
from .session import Session, Store, join, namespace

__all__ = ["RankInfo", "Session", "Store", "StoreCommitter", "commit_round", "discover", "join", "namespace"]
