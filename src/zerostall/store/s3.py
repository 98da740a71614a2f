"""The S3 tier (boto3): ``s3://bucket/prefix``.

Endpoint and credentials come from the standard AWS chain (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``) and are never logged; the bucket
is created on first use. Requests use botocore's ``standard`` retries (``attempts``, only
connection errors, 5xx, throttling, 408) with short timeouts.

S3's flexible checksum headers cannot be trusted (radosgw ignores them), so each uploaded
object is read back and its crc32c compared with the local file's; the crc is also stored as
``x-amz-meta-zerostall-crc32c``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, NoReturn
from urllib.parse import urlparse

import crc32c as _crc

from ..config import IOConfig
from ..errors import CheckpointNotFound, RemoteError, RootNotFound
from ..format.manifest import MANIFEST_NAME
from .remote import RemoteTier, ShardIO, step_of

log = logging.getLogger("zerostall")
_NOT_FOUND = ("404", "NoSuchKey", "NotFound", "NoSuchBucket")
_HINTS = {
    "403": "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws) and the bucket policy",
    "AccessDenied": "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws) and the bucket policy",
    "InvalidAccessKeyId": "check AWS_ACCESS_KEY_ID",
    "SignatureDoesNotMatch": "check AWS_SECRET_ACCESS_KEY",
    "NoSuchBucket": "the bucket does not exist",
}
META_CRC = "zerostall-crc32c"


class S3Tier(RemoteTier):
    def __init__(self, url: str, io: IOConfig | None = None, *, max_concurrency: int = 4,
                 part_bytes: int = 64 << 20, max_bandwidth_bytes: int | None = None, attempts: int = 3,
                 connect_timeout_s: float = 3.0, read_timeout_s: float = 30.0):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        u = urlparse(url)
        self.url, self.bucket, self.prefix = url, u.netloc, u.path.strip("/")
        if not self.bucket:
            raise RemoteError(f"{url}: no bucket in the URL (use s3://bucket/prefix)", url=url)
        self.io = io or IOConfig()
        cfg = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=connect_timeout_s,
                     read_timeout=read_timeout_s, request_checksum_calculation="when_required",
                     response_checksum_validation="when_required", max_pool_connections=max(10, 2 * max_concurrency))
        self.client = boto3.session.Session().client("s3", config=cfg)
        self.transfer = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes,
                                       max_concurrency=max_concurrency, max_bandwidth=max_bandwidth_bytes,
                                       use_threads=max_concurrency > 1)
        self._cancel = threading.Event()

    # -- the error boundary ---------------------------------------------------------------------
    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _fail(self, action: str, rel: str, exc: BaseException) -> NoReturn:
        code = _code(exc)
        hint = _HINTS.get(code, "") if code else "is the endpoint (AWS_ENDPOINT_URL) reachable?"
        msg = f"{action} {self.where(rel)} failed: {exc}" + (f" ({hint})" if hint else "")
        raise self.error(rel, msg) from exc

    def _call(self, action: str, rel: str, fn: Callable[[], Any], missing: Callable[[], Any] | None = None) -> Any:
        """``fn()``, its botocore and OS errors translated; a not-found error returns ``missing()``."""
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return fn()
        except ClientError as exc:
            if missing is not None and _code(exc) in _NOT_FOUND:
                return missing()
            self._fail(action, rel, exc)
        except (BotoCoreError, OSError) as exc:
            self._fail(action, rel, exc)

    # -- reading ------------------------------------------------------------------------------
    def _objects(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under ``prefix`` (none while the bucket does not exist)."""
        from botocore.exceptions import ClientError

        def run() -> list[dict[str, Any]]:
            pager = self.client.get_paginator("list_objects_v2")
            try:
                return [o for page in pager.paginate(Bucket=self.bucket, Prefix=self._key(prefix))
                        for o in page.get("Contents", [])]
            except ClientError as exc:
                if _code(exc) == "NoSuchBucket":  # nothing replicated yet; any other not-found is an error
                    return []
                raise

        return self._call("listing", prefix, run)

    def _head(self, rel: str, missing: Callable[[], Any] | None = None) -> Any:
        return self._call("stat of", rel, lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(rel)),
                          missing)

    def _manifests(self) -> dict[int, tuple[Any, ...]]:
        base = self._key("")
        out: dict[int, tuple[Any, ...]] = {}
        for o in self._objects(""):
            rel = o["Key"][len(base):]
            parts = rel.split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME and (s := step_of(rel)) is not None:
                out[s] = (o.get("ETag"), o.get("Size"), str(o.get("LastModified")))
        return out

    def check_root(self) -> None:
        def missing() -> NoReturn:
            raise RootNotFound(f"{self.url}: bucket {self.bucket!r} does not exist at "
                               f"{self.client.meta.endpoint_url} (check the URL and AWS_ENDPOINT_URL; "
                               "the replicator creates it at its first upload)", root=self.url)

        self._call("checking", "", lambda: self.client.head_bucket(Bucket=self.bucket), missing)

    def stat(self, rel: str) -> int | None:
        head = self._head(rel, lambda: None)
        return None if head is None else int(head["ContentLength"])

    def _get(self, rel: str, **kw: Any) -> Any:
        def missing() -> NoReturn:
            raise CheckpointNotFound(f"{self.where(rel)} does not exist")

        return self._call("reading", rel, lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(rel), **kw),
                          missing)

    def _read_into(self, body: Any, mv: memoryview, rel: str, off: int) -> None:
        """Fill ``mv`` (bytes from ``off`` of ``rel``) from a response body, straight into the
        buffer in reads of at most 8 MiB; RemoteError if the object ends first."""
        got, n = 0, len(mv)
        while got < n:
            k = body.readinto(mv[got:got + min(n - got, 8 << 20)])
            if not k:
                raise self.error(rel, f"{self.where(rel)}: object ended at {off + got}")
            got += k

    def _open_read(self, rel: str, size: int, engine: Any) -> Any:
        head = self._head(rel)
        return ShardIO(_RangeReader(self, rel, int(head["ContentLength"]), head.get("ETag")))

    def read_bytes(self, rel: str, limit: int) -> bytes:
        body = self._get(rel)["Body"]
        return self._call("reading", rel, lambda: body.read(limit + 1))

    def checksum(self, rel: str) -> tuple[int, int]:
        body = self._get(rel)["Body"]

        def run() -> tuple[int, int]:
            crc, size = 0, 0
            while chunk := body.read(8 << 20):
                if self._cancel.is_set():
                    raise self.error(rel, f"reading back {self.where(rel)}: cancelled")
                crc = _crc.crc32c(chunk, crc)
                size += len(chunk)
            return size, crc

        return self._call("reading back", rel, run)

    # -- writing (replicator thread) ------------------------------------------------------------
    def ensure_root(self) -> None:
        if self._call("checking bucket", "", lambda: self.client.head_bucket(Bucket=self.bucket), lambda: None):
            return  # it exists
        try:
            self.client.create_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001 - botocore's or the OS's
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                self._fail("creating bucket", "", exc)

    def _put_file(self, local_path: str, rel: str, crc: int) -> None:
        """Parallel multipart upload (s3transfer), abandoned if :meth:`cancel` is called."""
        from boto3.s3.transfer import create_transfer_manager
        tm = create_transfer_manager(self.client, self.transfer)
        cancelled = False
        try:
            fut = tm.upload(local_path, self.bucket, self._key(rel), extra_args={"Metadata": {META_CRC: f"{crc:08x}"}})
            while not fut.done():
                if self._cancel.wait(0.1):
                    fut.cancel()
                    cancelled = True
                    raise self.error(rel, f"upload of {self.where(rel)} abandoned (close_timeout_s passed)")
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - botocore's, s3transfer's or the OS's
                self._fail("uploading", rel, exc)
        finally:
            tm.shutdown(cancel=cancelled)

    def _put_bytes(self, data: bytes, rel: str) -> None:
        import base64
        import hashlib
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - S3's own integrity header
        self._call("uploading", rel, lambda: self.client.put_object(
            Bucket=self.bucket, Key=self._key(rel), Body=data, ContentMD5=md5,
            Metadata={META_CRC: f"{_crc.crc32c(data):08x}"}))

    def _delete(self, rel: str) -> None:
        self._call("deleting", rel, lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(rel)))

    def _delete_prefix(self, rel: str) -> None:
        keys = [{"Key": o["Key"]} for o in self._objects(rel)]
        for i in range(0, len(keys), 1000):
            self._call("deleting", rel, lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True}))

    def names_in(self, step: int) -> list[str]:
        base = self._key(f"step-{step}/")
        return sorted(o["Key"][len(base):] for o in self._objects(f"step-{step}/"))

    def _copy_within(self, src: str, dst: str) -> bool:
        """Server-side copy (multipart for large objects, through s3transfer); checked by the caller."""
        self._call(f"copying {self.where(src)} to", dst, lambda: self.client.copy(
            {"Bucket": self.bucket, "Key": self._key(src)}, self.bucket, self._key(dst), Config=self.transfer))
        return False

    def stored_crc(self, rel: str) -> int:
        """The crc32c recorded at upload (``x-amz-meta-zerostall-crc32c``), else read back."""
        rec = (self._head(rel).get("Metadata") or {}).get(META_CRC, "")
        try:
            return int(rec, 16)
        except ValueError:
            return self.checksum(rel)[1]

    def cancel(self) -> None:
        self._cancel.set()


def _code(exc: BaseException) -> str:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        return str(resp.get("Error", {}).get("Code", "") or resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


class _RangeReader:
    """Reads a shard with one ranged GET per extent, each pinned to the ETag seen at open
    (``ident``): a version uploaded since fails the read (412) instead of mixing two versions."""

    def __init__(self, tier: S3Tier, rel: str, size: int, etag: str | None = None):
        self.tier, self.rel, self.size, self.ident = tier, rel, size, etag

    def read(self, extents: Any) -> None:
        for off, mv in extents:
            n = len(mv)
            if n == 0:
                continue
            if off + n > self.size:
                raise self.tier.error(self.rel, f"{self.tier.where(self.rel)}: read of [{off}, {off + n}) beyond "
                                      f"its {self.size} bytes")
            pin = {"IfMatch": self.ident} if self.ident else {}
            body = self.tier._get(self.rel, Range=f"bytes={off}-{off + n - 1}", **pin)["Body"]
            self.tier._call("reading", self.rel, lambda body=body, mv=mv, off=off: self.tier._read_into(
                body, mv, self.rel, off))
