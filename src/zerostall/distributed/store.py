"""zerostall's own connection to the c10d store: bounded calls, errors translated, polling waits.

One :class:`Store` per ``Checkpointer`` (join, commit rounds on the persist thread, failure
reports) and one per collective ``load``; safe from any thread. Two rules:

- **Own client**: ``store.clone()`` (a new connection, same server and prefix), because a c10d
  client serialises its requests: a training thread blocked in ``store.get()`` would hold
  up a commit round.
- **Bounded calls**: a plain c10d request has no timeout (a SIGSTOPped store host blocks it),
  so each runs on a daemon thread and the caller waits at most until its deadline; on
  :class:`StoreTimeout` the connection (out of step) is abandoned, the next call opens a new
  one. In :meth:`Store.bounded`, requests past the deadline share :data:`LATE_CALL_S` and,
  once one timed out, the rest fail at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from .._util import Worker
from ..errors import DistributedError

log = logging.getLogger("zerostall")

DEFAULT_CALL_TIMEOUT_S = 60.0
LATE_CALL_S = 0.5  # what the requests past a Store.bounded deadline may take, all together

fault_hook: Callable[[str], None] | None = None
"""Test seam: ``fault_hook(what)`` on the request thread before each request (a test blocks
it to cut the process off the store)."""


@dataclass
class _Bound:
    """One thread's :meth:`Store.bounded` scope: its deadline and the request that timed out."""

    until: float
    dead: str | None = None
    late: tuple[float, float] | None = None  # (until, end of the late allowance) once past until


class StoreTimeout(DistributedError):
    """The c10d store did not answer a request in time: its outcome is unknown to this rank."""


class _Caller(Worker[tuple[Callable[[], Any], Future[Any]]]):
    """The daemon thread running store requests in order; abandoned (``stop(0)``) when one
    outlives its deadline."""

    def handle(self, item: tuple[Callable[[], Any], Future[Any]]) -> None:
        fn, fut = item
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            fut.set_exception(exc)

    def call(self, fn: Callable[[], Any], timeout: float) -> Future[Any] | None:
        """``fn()``'s future once done; None while it still runs after ``timeout`` seconds."""
        fut: Future[Any] = Future()
        self.submit((fn, fut))
        return fut if wait([fut], max(timeout, 0.0)).done else None


def _hook(what: str) -> None:
    if fault_hook is not None:
        fault_hook(what)


class Store:
    """A c10d store behind its own connection; errors arrive as :class:`DistributedError`
    with torch's chained. ``own_client=False`` shares ``store`` itself (tests)."""

    def __init__(self, store: Any, *, own_client: bool = True, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self.origin = store
        self.own_client = own_client
        self.call_timeout_s = call_timeout_s
        self._mu = threading.Lock()
        self._caller = _Caller("zerostall-store")
        self._scope = threading.local()
        self.raw: Any = self._clone(store) if own_client else store

    def _clone(self, store: Any, timeout: float | None = None) -> Any:
        clone = getattr(store, "clone", None)
        if clone is None:
            log.warning("zerostall: this c10d store (%s) cannot open a second connection; sharing the "
                        "training's, whose blocking calls may then delay checkpoint commits", type(store).__name__)
            return store
        t = self.call_timeout_s if timeout is None else timeout
        got = self._caller.call(lambda: (_hook("connect"), clone())[1], t)
        if got is None:
            self._abandon()
            raise StoreTimeout(f"could not open a connection to the c10d store within {t:.3g} s "
                               "(is the process hosting it, rank 0 or the launcher's agent, alive and running?)")
        if (exc := got.exception()) is not None:
            raise DistributedError(f"could not open a connection to the c10d store: {exc}") from exc
        return got.result()

    def _abandon(self) -> None:
        self._caller.stop(0)  # runs after the blocked request, if it ever returns
        self._caller = _Caller("zerostall-store")

    @contextlib.contextmanager
    def bounded(self, until: float) -> Iterator[_Bound]:
        """Every request of the calling thread in this block ends by the monotonic ``until``
        (which its owner may move later)."""
        prev = getattr(self._scope, "bound", None)
        b = self._scope.bound = _Bound(until)
        try:
            yield b
        finally:
            self._scope.bound = prev

    def _call(self, what: str, fn: Callable[[Any], Any], timeout: float | None = None) -> Any:
        t = self.call_timeout_s if timeout is None else timeout
        b: _Bound | None = getattr(self._scope, "bound", None)
        if b is not None:
            if b.dead is not None:
                raise StoreTimeout(f"{what}: not sent, the c10d store did not answer {b.dead} before it")
            now = time.monotonic()
            if now < b.until:
                t = min(t, max(b.until - now, LATE_CALL_S))
            else:  # past the deadline: one LATE_CALL_S for all the scope's requests (moved with until)
                if b.late is None or b.late[0] != b.until:
                    b.late = (b.until, now + LATE_CALL_S)
                t = min(t, b.late[1] - now)
                if t <= 0:
                    raise StoreTimeout(f"{what}: not sent, {LATE_CALL_S:g} s past the deadline of its round")
        try:
            return self._call_once(what, fn, t)
        except StoreTimeout:
            if b is not None:
                b.dead = what
            raise

    def _call_once(self, what: str, fn: Callable[[Any], Any], t: float) -> Any:
        # bounded, never a plain `with`: close() may run this from a signal handler that
        # interrupted this same thread inside the block
        if not self._mu.acquire(timeout=max(t, 0.001)):
            raise StoreTimeout(f"the c10d connection stayed busy for {t:.3g} s ({what})")
        try:
            raw = self.raw
            if raw is None:  # the last connection timed out: a new one
                raw = self.raw = self._clone(self.origin, t)
            caller = self._caller
        finally:
            self._mu.release()
        got = caller.call(lambda: (_hook(what), fn(raw))[1], t)
        if got is None:
            if self._mu.acquire(timeout=1.0):
                try:
                    if self.raw is raw and self.own_client:
                        self.raw = None
                        self._abandon()
                finally:
                    self._mu.release()
            raise StoreTimeout(f"the c10d store did not answer {what} within {t:.3g} s (is the process "
                               "hosting it, rank 0 or the launcher's agent, stopped or overloaded?)")
        if (exc := got.exception()) is None:
            return got.result()
        if isinstance(exc, DistributedError):
            raise exc
        raise DistributedError(f"the c10d store failed on {what}: {exc} (is rank 0, which hosts the "
                               "store, still alive?)") from exc

    # -- requests ------------------------------------------------------------------------------
    def set(self, key: str, value: str, timeout: float | None = None) -> None:
        self._call(f"set {key!r}", lambda s: s.set(key, value), timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._call(f"get {key!r}", lambda s: s.get(key), timeout)

    def get_json(self, key: str, timeout: float | None = None) -> Any:
        return json.loads(self.get(key, timeout))

    def compare_set(self, key: str, expected: str, desired: str, timeout: float | None = None) -> bytes:
        """Atomically set ``key`` to ``desired`` if it holds ``expected`` ("" : absent); returns
        the value it holds afterwards (ours, or the one that was there first)."""
        return self._call(f"compare_set {key!r}", lambda s: s.compare_set(key, expected, desired), timeout)

    def multi_get_json(self, keys: list[str], timeout: float | None = None) -> list[Any]:
        if not keys:
            return []
        vals = self._call(f"multi_get of {len(keys)} keys",
                          lambda s: s.multi_get(keys) if hasattr(s, "multi_get") else [s.get(k) for k in keys],
                          timeout)
        return [json.loads(v) for v in vals]

    def add(self, key: str, n: int, timeout: float | None = None) -> int:
        return int(self._call(f"add {key!r}", lambda s: s.add(key, n), timeout))

    def check(self, keys: list[str], timeout: float | None = None) -> bool:
        return bool(self._call(f"check of {len(keys)} keys", lambda s: s.check(keys), timeout))

    def delete(self, *keys: str) -> None:
        """Best effort: a key that is gone, or a store that is gone, is not an error here."""
        for k in keys:
            try:
                self._call(f"delete {k!r}", lambda s, k=k: s.delete_key(k), min(self.call_timeout_s, 5.0))
            except DistributedError as exc:
                log.debug("zerostall: could not delete store key %s: %s", k, exc)
                return

    def poll(self, keys: list[str], deadline: float, abort: str | None = None) -> str:
        """Wait until every key exists (``"ok"``), ``abort`` exists (``"abort"``) or the
        monotonic ``deadline`` passes (``"timeout"``). A store that stops answering raises
        :class:`StoreTimeout` at the deadline (plus one second), never later."""
        delay = 0.002
        while True:
            bound = max(deadline - time.monotonic(), 0.0) + 1.0
            if self.check(keys, bound):
                return "ok"
            if abort is not None and self.check([abort], bound):
                return "abort"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, 0.1)

    def missing(self, keys: list[str], timeout: float | None = None) -> list[str]:
        """The keys that do not exist, in order, by halving the list (a lost node's keys are
        contiguous: ~2 log2(len(keys)) requests, not one per key)."""
        if not keys or self.check(keys, timeout):
            return []
        if len(keys) == 1:
            return list(keys)
        half = len(keys) // 2
        return self.missing(keys[:half], timeout) + self.missing(keys[half:], timeout)

    def missing_ranks(self, base: str, ranks: Iterable[int], timeout: float | None = None) -> list[int]:
        """The ranks R whose key ``<base>/r<R>`` does not exist, in order (:meth:`missing`)."""
        return [int(k.rsplit("/r", 1)[1]) for k in self.missing([f"{base}/r{r}" for r in ranks], timeout)]

    def gather(self, base: str, ranks: Sequence[int], deadline: float, failure: Callable[[str], str]) -> list[Any]:
        """Every ``<base>/r<R>`` of ``ranks`` once all exist, by the monotonic ``deadline``; else
        :class:`DistributedError` naming the missing ranks, ``failure("rank(s) 1, 3")`` its message."""
        keys = [f"{base}/r{r}" for r in ranks]
        if self.poll(keys, deadline) == "timeout":
            missing = self.missing_ranks(base, ranks)
            raise DistributedError(failure(f"rank(s) {', '.join(map(str, missing))}"), missing_ranks=tuple(missing))
        return self.multi_get_json(keys)

    def close(self) -> None:
        """Stop the request thread (the connection closes with the last reference)."""
        self._caller.stop(0)
