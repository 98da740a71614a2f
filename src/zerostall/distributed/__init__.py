"""Distributed: node identity and ranks (:mod:`.node`), the start-up round (:mod:`.session`),
the cross-rank commit protocol (:mod:`.commit`), the load and room agreements (:mod:`.agree`), over
zerostall's own store connection (:mod:`.store`).

Imports ``store`` and ``format`` (downward); nothing here imports the checkpointer or the CLI.
"""
