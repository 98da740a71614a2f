"""Peer replicas: each committed step copied to ``replicas - 1`` other nodes' local roots, and
restored from them when a node is replaced (the tier ladder local -> peers -> remote).

Modules, bottom up: :mod:`.placement` (who holds whose files), :mod:`.wire` (messages,
handshake, field checks), :mod:`.verify` (every byte against the manifest), :mod:`.store`
(the holder's area on disk), :mod:`.transport` (the interface) and :mod:`.tcp` (the TCP
implementation), :mod:`.exchange` (what ranks share through the c10d store),
:mod:`.replicate` (the post-commit stage) and :mod:`.offer` and :mod:`.fetch` (restore).

:mod:`.service`'s :class:`~.service.Peers` is what the Checkpointer holds. This package's
__init__ imports nothing: :mod:`.status` (what ``zerostall ls``/``doctor`` show) needs no torch.
"""
