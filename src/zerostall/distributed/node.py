"""Node identity: which machine (and failure domain) a process runs on.

A node is named by ``ZEROSTALL_NODE`` when set, else by the host name. Containers that share
one host name, or several simulated nodes on one machine (every multi-node test here), set
``ZEROSTALL_NODE`` per node. ``ZEROSTALL_FAILURE_DOMAIN`` optionally labels what fails
together (a rack, a power domain); unset, each node is its own domain.

Read once per call from any thread; no state.
"""

from __future__ import annotations

import os
import re
import socket

from ..errors import ConfigError

NODE_ENV = "ZEROSTALL_NODE"
DOMAIN_ENV = "ZEROSTALL_FAILURE_DOMAIN"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _check(env: str, value: str) -> str:
    if not _NAME_RE.match(value):
        raise ConfigError(f"{env}={value!r} is not a valid name: use 1-128 letters, digits, '.', '_', ':' "
                          "or '-', starting with a letter or digit")
    return value


def node_id() -> str:
    """This process's node name: ``$ZEROSTALL_NODE``, else the host name."""
    value = os.environ.get(NODE_ENV, "").strip()
    return _check(NODE_ENV, value) if value else socket.gethostname()


def failure_domain() -> str:
    """This node's failure domain: ``$ZEROSTALL_FAILURE_DOMAIN``, else the node itself."""
    value = os.environ.get(DOMAIN_ENV, "").strip()
    return _check(DOMAIN_ENV, value) if value else node_id()
