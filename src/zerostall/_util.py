"""Small shared pieces: the background-worker pattern and lazy ``"module:attr"`` targets.

The bottom of the import graph: imports nothing from zerostall.
"""

from __future__ import annotations

import importlib
import queue
import threading
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def load_target(target: str) -> Any:
    """``"package.module:attr"`` -> the attribute (raises ImportError/AttributeError)."""
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


class Worker(Generic[T]):
    """One daemon thread draining a FIFO of items with ``handle(item)``, in order.

    ``submit`` may be called from any thread; ``stop`` processes what is queued, then joins.
    """

    def __init__(self, name: str):
        self._q: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> None:
        self._q.put(item)

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _loop(self) -> None:
        self.on_start()
        while True:
            item = self._q.get()
            if item is None:
                return
            self.handle(item)

    def on_start(self) -> None:
        """Runs first, in the worker thread."""

    def handle(self, item: T) -> None:
        raise NotImplementedError
