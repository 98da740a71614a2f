"""Host memory for staging and restore: the arena (:mod:`.arena`), the ring of blocks (:mod:`.ring`),
the budget (:mod:`.host`: the share of host RAM a node's ranks may pin). Imports ``io`` and ``format``
at most. Each module is imported by name: :mod:`.host` needs no torch (``zerostall doctor`` reads the
budget without it).
"""
