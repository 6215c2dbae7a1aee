"""The production backend: any S3-compatible store through boto3.

The endpoint and credentials come from the usual AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``). Manifests are
published with a conditional write (``If-None-Match: *``), so of two writers of one name
exactly one wins; the collector aborts multipart uploads left incomplete under the prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from gpucloud.checkpoints.store import ManifestExists, StoreError
from gpucloud.core.errors import NotFound

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_EXISTS = {"412", "PreconditionFailed", "ConditionalRequestConflict"}


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


class S3Store:
    def __init__(self, bucket: str, prefix: str, client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.s3: Any = client or boto3.client("s3")

    def _chunk(self, project: str, digest: str) -> str:
        return f"{self.prefix}{project}/chunks/{digest}"

    def _manifest(self, project: str, name: str) -> str:
        return f"{self.prefix}{project}/manifests/{name}.json"

    def _fail(self, what: str, error: Exception) -> StoreError:
        return StoreError(f"checkpoint store s3://{self.bucket}/{self.prefix}: {what}: {error}")

    def missing(self, project: str, digests: Iterable[str]) -> list[str]:
        wanted = set(digests)
        if not wanted:
            return []
        return sorted(wanted - self.list_chunks(project))

    def put_chunk(self, project: str, digest: str, source: Path) -> None:
        try:
            with source.open("rb") as body:
                self.s3.put_object(Bucket=self.bucket, Key=self._chunk(project, digest),
                                   Body=body)
        except (BotoCoreError, ClientError) as error:
            raise self._fail(f"storing chunk {digest}", error) from None
        source.unlink(missing_ok=True)

    def get_chunk(self, project: str, digest: str) -> bytes:
        return self._get(self._chunk(project, digest), f"chunk {digest}")

    def _get(self, key: str, what: str) -> bytes:
        try:
            body: bytes = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as error:
            if _code(error) in _NOT_FOUND:
                raise NotFound(f"{what} is not in the store") from None
            raise self._fail(f"reading {what}", error) from None
        except BotoCoreError as error:
            raise self._fail(f"reading {what}", error) from None
        return body

    def list_chunks(self, project: str) -> set[str]:
        prefix = f"{self.prefix}{project}/chunks/"
        found: set[str] = set()
        try:
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                      Prefix=prefix)
            for page in pages:
                found.update(item["Key"][len(prefix):] for item in page.get("Contents", []))
        except (BotoCoreError, ClientError) as error:
            raise self._fail("listing chunks", error) from None
        return found

    def delete_chunk(self, project: str, digest: str) -> None:
        self._delete(self._chunk(project, digest))

    def _delete(self, key: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as error:
            raise self._fail(f"deleting {key}", error) from None

    def put_manifest(self, project: str, name: str, data: bytes) -> None:
        try:
            self.s3.put_object(Bucket=self.bucket, Key=self._manifest(project, name),
                               Body=data, IfNoneMatch="*")
        except ClientError as error:
            if _code(error) in _EXISTS:
                raise ManifestExists(f"manifest {name} exists already") from None
            raise self._fail(f"publishing manifest {name}", error) from None
        except BotoCoreError as error:
            raise self._fail(f"publishing manifest {name}", error) from None

    def get_manifest(self, project: str, name: str) -> bytes:
        return self._get(self._manifest(project, name), f"manifest {name}")

    def delete_manifest(self, project: str, name: str) -> None:
        self._delete(self._manifest(project, name))

    def abort_incomplete(self, older_than: datetime) -> int:
        """Abort the multipart uploads under the prefix begun before ``older_than``."""
        aborted = 0
        try:
            pages = self.s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"] < older_than:
                        self.s3.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                       UploadId=upload["UploadId"])
                        aborted += 1
        except (BotoCoreError, ClientError) as error:
            raise self._fail("aborting incomplete multipart uploads", error) from None
        return aborted
