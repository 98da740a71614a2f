"""Distributed: rank discovery and the cross-rank commit protocol (and, later, DCP storage).

Imports ``store``, ``format`` and ``staging`` (downward); nothing here imports the
checkpointer or the CLI.
"""

from .commit import StoreCommitter, commit_round, setup_protocol
from .ranks import RankInfo, discover

__all__ = ["RankInfo", "StoreCommitter", "commit_round", "discover", "setup_protocol"]
