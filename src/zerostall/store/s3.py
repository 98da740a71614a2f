"""The S3 tier (boto3): ``s3://bucket/prefix``.

Endpoint and credentials come from the standard AWS chain (``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``) and
are never logged. Uploads are multipart with ``max_concurrency`` parallel parts and an
optional bandwidth cap (s3transfer's ``max_bandwidth``); botocore's ``adaptive`` retry mode
backs off exponentially with jitter on throttling and 5xx, and our own loop retries
connection failures. Integrity: every object's size is checked after upload and download,
and every byte is verified against the manifest's crc32c when the checkpoint is loaded
(servers without flexible checksums, e.g. Ceph 16, are supported: the SDK's own checksums
are only sent when required).

Why boto3 over obstore: it is the SDK every S3-compatible server is tested against
(radosgw included), and s3transfer gives parallel multipart with a bandwidth cap out of
the box; the upload runs in a background thread, so obstore's lower per-request overhead
would not change what the training loop sees.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from ..config import ALIGN_BYTES, IOConfig
from ..errors import StorageError
from ..format.manifest import MANIFEST_NAME
from .remote import RemoteTier, retry


class S3Tier(RemoteTier):
    def __init__(self, url: str, io: IOConfig | None = None, *, max_concurrency: int = 4,
                 part_bytes: int = 64 << 20, max_bandwidth_bytes: int | None = None, attempts: int = 8):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        u = urlparse(url)
        self.url, self.bucket, self.prefix = url, u.netloc, u.path.strip("/")
        self.io = io or IOConfig()
        self.attempts = attempts
        cfg = Config(retries={"max_attempts": attempts, "mode": "adaptive"}, connect_timeout=5, read_timeout=60,
                     request_checksum_calculation="when_required", response_checksum_validation="when_required",
                     max_pool_connections=max(10, 2 * max_concurrency))
        self.client = boto3.session.Session().client("s3", config=cfg)
        self.transfer = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes,
                                       max_concurrency=max_concurrency, max_bandwidth=max_bandwidth_bytes,
                                       use_threads=max_concurrency > 1)

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _retry(self, fn: Any, what: str) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError
        return retry(fn, what, attempts=self.attempts, retry_on=(BotoCoreError, ClientError, OSError))

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.client.create_bucket(Bucket=self.bucket)

    def upload(self, local_path: str, rel: str) -> None:
        key = self._key(rel)
        size = os.path.getsize(local_path)
        self._retry(lambda: self.client.upload_file(local_path, self.bucket, key, Config=self.transfer),
                    f"upload of {rel} to {self.url}")
        got = self._retry(lambda: self.client.head_object(Bucket=self.bucket, Key=key), f"head {rel}")["ContentLength"]
        if got != size:
            raise StorageError(f"{self.url}/{rel}: uploaded {got} bytes, expected {size}")

    def upload_bytes(self, data: bytes, rel: str) -> None:
        self._retry(lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=data),
                    f"upload of {rel} to {self.url}")

    def download(self, rel: str, local_path: str, size: int) -> None:
        """Stream the object through an aligned buffer into ``local_path`` with direct I/O."""
        from ..io import choose_engine
        from ..staging.arena import Arena
        d = os.path.dirname(local_path)
        eng = choose_engine(d, self.io)
        buf = Arena(min(64 << 20, max(size, ALIGN_BYTES)), mlock=False)

        def fetch() -> None:
            if os.path.exists(local_path):
                os.unlink(local_path)
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(rel))["Body"]
            with eng.open_write(local_path, size) as w:
                off = 0
                while off < size:
                    n = min(buf.nbytes, size - off)
                    got = 0
                    while got < n:
                        chunk = body.read(n - got)
                        if not chunk:
                            raise StorageError(f"{self.url}/{rel}: object ended at {off + got} of {size} bytes")
                        buf.mv[got:got + len(chunk)] = chunk
                        got += len(chunk)
                    w.write([(off, buf.mv[:n])])
                    off += n
                w.finish()

        try:
            self._retry(fetch, f"download of {rel} from {self.url}")
        finally:
            eng.close()
            buf.close()

    def read_bytes(self, rel: str, limit: int) -> bytes:
        obj = self._retry(lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(rel)), f"read {rel}")
        return obj["Body"].read(limit + 1)

    def exists(self, rel: str) -> bool:
        from botocore.exceptions import ClientError
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(rel))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def list_dirs(self) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[str] = []
        pager = self.client.get_paginator("list_objects_v2")
        for page in pager.paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                out.append(cp["Prefix"][len(base):].rstrip("/"))
        return out

    def delete_step(self, step: int) -> None:
        base = self._key(f"step-{step}/")
        self._retry(lambda: self.client.delete_object(Bucket=self.bucket, Key=base + MANIFEST_NAME), "delete manifest")
        pager = self.client.get_paginator("list_objects_v2")
        for page in pager.paginate(Bucket=self.bucket, Prefix=base):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
