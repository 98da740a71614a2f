"""Where a node's checkpoint files are copied: rendezvous (HRW) hashing over node names,
spread across failure domains.

``holders(src, nodes, replicas)`` returns the ``replicas - 1`` other nodes that keep copies of
``src``'s files. Every node computes the same answer from the same node list (sorted, with
their failure domains); the step does not enter the hash, so a node's holders stay the same
from step to step (a restore asks every live node anyway, see :mod:`.offer`).

How it picks: every other node ``h`` gets the score ``sha256(src | h)``; candidates are taken in
score order, first one per failure domain not used yet (and never ``src``'s own domain), then,
when there are fewer domains than copies, the best-scored remaining nodes. So:

* copies are on ``replicas`` distinct nodes; with at least ``replicas`` labelled domains, on
  ``replicas`` distinct domains;
* the holders are not neighbours in any order (a rack of consecutive nodes losing power takes
  neighbours together): HRW scores are independent per pair;
* a node joining or leaving changes only the placements that involved it (HRW's property);
* what N copies survive: any ``N - 1`` lost nodes (every file has N copies on N distinct nodes),
  and, when ``ZEROSTALL_FAILURE_DOMAIN`` labels at least N domains, any ``N - 1`` lost domains.

Pure functions; any thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError


@dataclass(frozen=True, order=True)
class Node:
    """One node of the job: its name (``ZEROSTALL_NODE``) and failure domain."""

    name: str
    domain: str


def _score(src: str, cand: str) -> bytes:
    return hashlib.sha256(f"zerostall-peers|{src}|{cand}".encode()).digest()


def ranking(src: str, nodes: Sequence[Node]) -> list[Node]:
    """Every node but ``src``, best holder first (domain spread, then HRW score)."""
    by_name = {n.name: n for n in nodes}
    if src not in by_name:
        raise ConfigError(f"node {src!r} is not one of the job's nodes {sorted(by_name)}")
    home = by_name[src].domain
    others = sorted((n for n in by_name.values() if n.name != src), key=lambda n: _score(src, n.name), reverse=True)
    first, rest, used = [], [], {home}
    for n in others:
        if n.domain not in used:
            used.add(n.domain)
            first.append(n)
        else:
            rest.append(n)
    return first + rest


def holders(src: str, nodes: Sequence[Node], replicas: int) -> tuple[str, ...]:
    """The ``replicas - 1`` nodes that keep copies of ``src``'s files (see the module doc)."""
    if replicas < 1:
        raise ConfigError(f"replicas={replicas} must be >= 1")
    if replicas - 1 > len({n.name for n in nodes}) - 1:
        raise ConfigError(f"replicas={replicas} needs at least {replicas} nodes; the job has "
                          f"{len({n.name for n in nodes})} (set ZEROSTALL_NODE per node, or lower replicas)")
    return tuple(n.name for n in ranking(src, nodes)[:replicas - 1])
