"""Distributed: node identity, rank discovery, the start-up round, the cross-rank commit
protocol and load agreement.

Imports ``store``, ``format`` and ``memory`` (downward); nothing here imports the
checkpointer or the CLI.
"""

from .commit import OutcomeUnknown, commit_round
from .node import failure_domain, node_id
from .ranks import RankInfo, discover
from .session import Session, join, namespace
from .store import Store, StoreTimeout

__all__ = ["OutcomeUnknown", "RankInfo", "Session", "Store", "StoreTimeout", "commit_round",
           "discover", "failure_domain", "join", "namespace", "node_id"]
