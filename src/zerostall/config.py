"""Typed, frozen settings for every component, composed into one :class:`CheckpointConfig`.

Units are in the names (``_bytes``, ``_s``, ``_fraction``). Every config validates itself
in ``__post_init__`` and raises :class:`~zerostall.errors.ConfigError` naming the field.
docs/configuration.md documents every field and the ``ZEROSTALL_*`` environment overrides
(``_ENV``; read only by :meth:`CheckpointConfig.from_env`, which ``Checkpointer`` calls when it
is given no config).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError

__all__ = ["CheckpointConfig", "IOConfig", "PeersConfig", "StagingConfig", "ALIGN_BYTES"]

ALIGN_BYTES = 4096
"""Alignment of every offset, length and buffer that reaches an O_DIRECT file."""

MiB = 1 << 20


def _require(cfg: object, name: str, ok: bool, what: str) -> None:
    """Unless ``ok``: :class:`ConfigError` naming field ``name`` (``peers.x``: ``x``) of ``cfg`` and its value."""
    if not ok:
        raise ConfigError(f"{name}={getattr(cfg, name.rpartition('.')[2])!r} is invalid: {what}")


def _int_in(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


@dataclass(frozen=True, kw_only=True)
class IOConfig:
    """How shard files are written and read (``io/``)."""

    engine: str = "auto"  # auto | uring | threads | buffered | any registered name
    chunk_bytes: int = 8 * MiB
    queue_depth: int = 16
    threads: int = 4
    buffered_dirty_limit_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        _require(self, "engine", isinstance(self.engine, str) and self.engine != "",
                 "choose auto, uring, threads or buffered")
        _require(self, "chunk_bytes", self.chunk_bytes >= ALIGN_BYTES and self.chunk_bytes % ALIGN_BYTES == 0,
                 f"must be a positive multiple of {ALIGN_BYTES}")
        _require(self, "queue_depth", 1 <= self.queue_depth <= 1024, "must be 1..1024")
        _require(self, "threads", 1 <= self.threads <= 256, "must be 1..256")
        _require(self, "buffered_dirty_limit_bytes", self.buffered_dirty_limit_bytes >= self.chunk_bytes,
                 "must be at least chunk_bytes")


@dataclass(frozen=True, kw_only=True)
class StagingConfig:
    """The staging pool (:mod:`zerostall.memory`): one page-aligned region per process, shared, reused.
    Fields: docs/configuration.md."""

    budget_bytes: int | None = None
    budget_fraction: float = 0.4
    block_bytes: int = 8 * MiB
    slots: int = 1
    mlock: bool = True
    hugepages: bool = True

    def __post_init__(self) -> None:
        _require(self, "budget_bytes", self.budget_bytes is None or self.budget_bytes >= 2 * self.block_bytes,
                 f"must hold at least two blocks ({2 * self.block_bytes} bytes)")
        _require(self, "budget_fraction", 0.0 < self.budget_fraction <= 0.9, "must be in (0, 0.9]")
        _require(self, "block_bytes", self.block_bytes >= ALIGN_BYTES and self.block_bytes % ALIGN_BYTES == 0,
                 f"must be a positive multiple of {ALIGN_BYTES}")
        _require(self, "slots", self.slots >= 1, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class PeersConfig:
    """Peer replicas (``peers/``), used when ``CheckpointConfig.replicas > 1``. Fields: docs/configuration.md."""

    timeout_s: float = 30.0
    bandwidth_bytes: int | None = None
    receive_bandwidth_bytes: int | None = None
    quota_bytes: int | None = None
    quota_fraction: float | None = None
    replica_timeout_s: float = 600.0
    cpu_priority: str = "idle"
    code: str | None = None
    data_fragments: int = 4
    parity_fragments: int = 2
    listen_host: str | None = None
    listen_port: int = 0

    def __post_init__(self) -> None:
        _require(self, "peers.timeout_s", self.timeout_s > 0, "must be > 0 seconds")
        _require(self, "peers.quota_bytes", self.quota_bytes is None or self.quota_bytes >= 0,
                 "must be None or >= 0 bytes")
        _require(self, "peers.quota_fraction", self.quota_fraction is None or 0 < self.quota_fraction <= 1,
                 "must be None or a fraction in (0, 1] of the root's filesystem")
        _require(self, "peers.cpu_priority", self.cpu_priority in ("idle", "nice", "normal"),
                 "must be 'idle', 'nice' or 'normal'")
        _require(self, "peers.replica_timeout_s", self.replica_timeout_s > 0, "must be > 0")
        _require(self, "peers.code", self.code in (None, "rs"), "must be None (full copies) or 'rs'")
        _require(self, "peers.listen_port", _int_in(self.listen_port, 0, 65535),
                 "must be a TCP port 1..65535, or 0 for one the kernel picks")
        for name in ("data_fragments", "parity_fragments"):
            _require(self, f"peers.{name}", _int_in(getattr(self, name), 1, 32), "must be an int in 1..32")
        for name in ("bandwidth_bytes", "receive_bandwidth_bytes"):
            rate = getattr(self, name)
            _require(self, f"peers.{name}", rate is None or rate >= MiB, "must be None or at least 1 MiB/s")
            # a paced transfer moves pieces of rate * timeout_s / 8 bytes (peers.stream.Pacer):
            # at least a MiB per timeout keeps pieces useful and every pause well within it
            if rate is not None and rate * self.timeout_s < MiB:
                raise ConfigError(f"peers.{name}={rate} with peers.timeout_s={self.timeout_s:g}: a holder fails a "
                                  "transfer that makes no progress for timeout_s, and at this rate less than 1 MiB "
                                  f"moves in that time; raise peers.timeout_s to at least {MiB / rate:.3g} s "
                                  "or the cap")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Everything a :class:`~zerostall.Checkpointer` needs; pass overrides as keywords. Each field
    (default, meaning, the docs page that explains it): docs/configuration.md."""

    io: IOConfig = field(default_factory=IOConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    backpressure: Literal["block", "skip"] = "block"
    keep_last: int | None = None
    overwrite: bool = False
    verify_on_load: bool = True
    fallback: bool = True
    raise_on_background_error: bool = True
    telemetry_interval_s: float = 0.1
    metrics_jsonl: str | None = None
    prometheus: bool = False
    dist_mode: Literal["per_rank", "replicated", "local"] = "per_rank"
    commit_timeout_s: float = 300.0
    join_timeout_s: float = 60.0
    dist_name: str | None = None
    remote: str | None = None
    keep_last_remote: int | None = None
    keep_every_remote: int | None = None
    remote_bandwidth_bytes: int | None = None
    remote_concurrency: int = 4
    close_timeout_s: float = 30.0
    remote_retry_max_s: float = 60.0
    lock_timeout_s: float = 0.0
    spare_shard: bool = True
    allow_lower_steps: bool = False
    incremental: bool | str = False
    full_every: int | None = 10
    replicas: int = 1
    peers: PeersConfig = field(default_factory=PeersConfig)

    @property
    def peer_copies(self) -> bool:
        """Whether steps are protected on peers (``replicas > 1`` or ``peers.code``)."""
        return self.replicas > 1 or self.peers.code is not None

    def __post_init__(self) -> None:
        _require(self, "backpressure", self.backpressure in ("block", "skip"), "choose block or skip")
        for name in ("keep_last", "keep_last_remote", "keep_every_remote"):
            _require(self, name, getattr(self, name) is None or getattr(self, name) >= 1, "must be >= 1 or None")
        _require(self, "dist_mode", self.dist_mode in ("per_rank", "replicated", "local"),
                 "choose per_rank (each rank saves its own state), replicated (identical state on "
                 "every rank, each tensor written once) or local (this process saves alone)")
        for name in ("commit_timeout_s", "join_timeout_s", "telemetry_interval_s"):
            _require(self, name, getattr(self, name) > 0, "must be > 0")
        _require(self, "dist_name", self.dist_name is None or isinstance(self.dist_name, str)
                 and 0 < len(self.dist_name) <= 200, "must be a non-empty string (the same on every rank)")
        _require(self, "close_timeout_s", 0 <= self.close_timeout_s <= 3600, "must be in [0, 3600] seconds")
        _require(self, "remote_retry_max_s", self.remote_retry_max_s >= 1, "must be >= 1 s")
        _require(self, "remote_concurrency", self.remote_concurrency >= 1, "must be >= 1")
        _require(self, "lock_timeout_s", self.lock_timeout_s >= 0, "must be >= 0 seconds")
        _require(self, "incremental", self.incremental is True or self.incremental is False
                 or self.incremental in ("crc", "version"), "choose False, True (= 'crc': confirmed by crc32c) "
                 "or 'version'")
        _require(self, "replicas", _int_in(self.replicas, 1, 16), "must be an int in 1..16 (1: no peer copies)")
        _require(self, "peers", isinstance(self.peers, PeersConfig), "must be a PeersConfig")
        if self.peers.code is not None and self.replicas != 1:
            raise ConfigError(f"replicas={self.replicas} and peers.code={self.peers.code!r} are two ways to protect "
                              "a step on peers: keep replicas=1 with a code, or peers.code=None with replicas")
        _require(self, "full_every", self.full_every is None or isinstance(self.full_every, int)
                 and self.full_every >= 1, "must be an int >= 1 or None")

    def replace(self, **changes: object) -> "CheckpointConfig":
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, base: "CheckpointConfig | None" = None,
                 environ: "dict[str, str] | None" = None) -> "CheckpointConfig":
        """``base`` (default: defaults) with the ``ZEROSTALL_*`` overrides of the module docstring applied."""
        env = os.environ if environ is None else environ
        cfg = base or cls()
        for name, section, key, conv, what in _ENV:
            if name not in env:
                continue
            raw = env[name]
            try:
                value = conv(raw)
            except ValueError:
                raise ConfigError(f"environment variable {name}={raw!r} is not {what}") from None
            try:
                change = {key: value} if section is None else {section: dataclasses.replace(getattr(cfg, section),
                                                                                              **{key: value})}
                cfg = dataclasses.replace(cfg, **change)  # type: ignore[arg-type]
            except ConfigError as exc:
                raise ConfigError(f"environment variable {name}={raw!r}: {exc}") from None
        return cfg


_ENV = (  # variable, section of CheckpointConfig (None: its own field), field, conversion, what it must be
    ("ZEROSTALL_ENGINE", "io", "engine", str, "an engine name"),
    ("ZEROSTALL_CHUNK_BYTES", "io", "chunk_bytes", int, "a valid int"),
    ("ZEROSTALL_QUEUE_DEPTH", "io", "queue_depth", int, "a valid int"),
    ("ZEROSTALL_BUDGET_BYTES", "staging", "budget_bytes", int, "a valid int"),
    ("ZEROSTALL_BUDGET_FRACTION", "staging", "budget_fraction", float, "a valid float"),
    ("ZEROSTALL_BACKPRESSURE", None, "backpressure", str, "block or skip"),
    ("ZEROSTALL_DIST_MODE", None, "dist_mode", str, "a dist mode"),
    ("ZEROSTALL_PEER_PORT", "peers", "listen_port", int,
     "a number: set a TCP port 1..65535, or 0 for one the kernel picks"),
)
