"""Peer replicas: each committed step copied to other nodes' local roots (whole, or as coded
fragments), and restored from them when a node is replaced (local -> peers -> remote).

:mod:`.service`'s :class:`~.service.Peers` is what the Checkpointer holds; the save side is
:mod:`.replicate` / :mod:`.coded`, the restore side :mod:`.fetch`,
:mod:`.coded_restore`. This ``__init__`` imports nothing: :mod:`.status` needs no torch.
"""
