"""Parallel multipart upload of a staged file to S3 through boto3's transfer manager.

s3fs's ``put_file(max_concurrency=N)`` sends parts in lock-step batches of N
and spends its client CPU in one asyncio thread; on the promotion benchmark it
reached 0.74x of boto3's TransferManager, and a continuous asyncio window over
s3fs's client 0.7x (BENCHMARKS.md).  boto3 keeps N parts in flight on N
threads, so S3 uploads go through it; listing, reads and the exclusive
manifest commit stay on fsspec.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def s3_client(endpoint_url: str | None, region: str | None, storage_options: dict[str, Any],
              config_kwargs: dict[str, Any] | None = None):
    """A boto3 S3 client for the same endpoint, credentials and botocore settings (timeouts,
    retries) as the tier's s3fs filesystem."""
    import boto3
    from botocore.config import Config

    creds = {
        "aws_access_key_id": storage_options.get("key"),
        "aws_secret_access_key": storage_options.get("secret"),
        "aws_session_token": storage_options.get("token"),
    }
    session = boto3.session.Session(profile_name=storage_options.get("profile"), **{k: v for k, v in creds.items() if v})
    return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=Config(**(config_kwargs or {})))


def upload_file(client, local: str, remote: str, config, progress: Callable[[int], None] | None = None) -> None:
    """Upload ``local`` to ``remote`` (``bucket/key``) as boto3's TransferConfig ``config`` says.

    Each request is retried by the client's botocore config; a part that runs out of attempts
    fails the upload, which the transfer manager then aborts (best effort: GC aborts what is left).
    The caller retries the whole file."""
    bucket, key = remote.split("/", 1)
    client.upload_file(os.fspath(local), bucket, key, Config=config, Callback=progress)
