"""Distributed: rank discovery and the cross-rank commit protocol (and, later, DCP storage).

Imports ``store``, ``format`` and ``staging`` (downward); nothing here imports the
checkpointer or the CLI.
"""

from .commit import StoreCommitter, commit_round
from .ranks import RankInfo, discover
from .node import failure_domain, node_id
from .session import Session, join, namespace
from .store import Store, StoreTimeout

__all__ = ["RankInfo", "Session", "Store", "StoreCommitter", "StoreTimeout", "commit_round", "discover",
           "failure_domain", "join", "namespace", "node_id"]
