"""Small bookkeeping records under a branch folder: pruning records (``pruned/step-….json``) and their seal.

A pruning record says a state was deleted on purpose — by GC's retention or by an explicit ``Store.delete`` —
so audit tells a deliberate gap from a lost step, and ``show`` can say when it went.  Fields:
``{step, manifest_digest, branch, parent, pruned_at, by}``; records written before ``pruned_at`` / ``by``
existed lack them and still read (``pruned_at`` None, ``by`` "gc": GC was then their only writer).
With signing on, a record carries an HMAC (``signature``) and an unsigned or forged one is ignored.
"""
from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flowcheck.branches import parse_time
from flowcheck.manifest import Manifest, ParentRef, canonical_json, now_utc

log = logging.getLogger(__name__)

PRUNED = "pruned"
BY = ("gc", "delete")


@dataclass(frozen=True)
class PrunedRecord:
    """One deletion on record: which state, from which tier and branch, when and by what."""

    tier: str
    branch: str
    step: int
    manifest_digest: str | None  # None: the manifest was unreadable when the state was deleted
    parent: ParentRef | None
    pruned_at: datetime | None  # None: a record from before the time was recorded
    by: str = "gc"  # "gc" (retention) | "delete" (Store.delete / `flowcheck delete`)

    def describe(self) -> str:
        """``pruned by GC at 2025-01-02T03:04:05Z`` / ``deleted on request at …`` (``at an unrecorded time``)."""
        when = f"at {self.pruned_at.strftime('%Y-%m-%dT%H:%M:%SZ')}" if self.pruned_at else "at an unrecorded time"
        return f"{'deleted on request' if self.by == 'delete' else 'pruned by GC'} {when}"


def record_name(step: int, step_dir: str, digest: str | None, earlier: bytes | None) -> str:
    """``pruned/step-….json``; when another state of this step number was pruned before (a rollback reused the
    number), a second name so both deletions stay on record."""
    name = f"{PRUNED}/{step_dir}.json"
    if earlier is not None and digest is not None and digest.encode() not in earlier:
        name = f"{PRUNED}/{step_dir}.{digest.split(':')[-1][:16]}.json"
    return name


def record_body(step: int, branch: str, manifest: Manifest | None, by: str) -> dict[str, Any]:
    """What a pruning record holds (``manifest`` None: unreadable — the record still says the step went on purpose)."""
    if by not in BY:
        raise ValueError(f"pruning record 'by': expected one of {BY}, found {by!r}")
    parent = None
    if manifest is not None and manifest.parent is not None:
        parent = {"step": manifest.parent.step, "manifest_digest": manifest.parent.manifest_digest}
    return {"step": step, "manifest_digest": None if manifest is None else manifest.digest(), "branch": branch,
            "parent": parent, "pruned_at": now_utc(), "by": by}


def parse_record(body: dict[str, Any], tier: str, branch: str) -> PrunedRecord:
    """A record's fields (KeyError / TypeError / ValueError when it is not one)."""
    step = body["step"]
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step: expected an integer, found {step!r}")
    raw_parent = body.get("parent")
    parent = None
    if isinstance(raw_parent, dict) and isinstance(raw_parent.get("step"), int):
        parent = ParentRef(raw_parent["step"], str(raw_parent.get("manifest_digest")))
    at = body.get("pruned_at")
    return PrunedRecord(tier, str(body.get("branch") or branch), step, body.get("manifest_digest"), parent,
                        parse_time(at) if isinstance(at, str) else None,
                        body.get("by") if body.get("by") in BY else "gc")


def seal(body: dict[str, Any], key: bytes | None) -> bytes:
    """A record as JSON, with an HMAC when signing is on, so a hand-written record can neither hide a deleted
    step nor move "latest"."""
    body = {k: v for k, v in body.items() if k != "signature"}
    if key:
        body["signature"] = hmac.new(key, canonical_json(body), "sha256").hexdigest()
    return canonical_json(body) + b"\n"


def unseal(raw: bytes | None, key: bytes | None, where: str) -> dict[str, Any] | None:
    """A record's body — None when it is missing, unreadable, or (signing on) unsigned or forged."""
    try:
        body = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        if raw is not None:
            log.warning("%s is not a JSON object; ignored", where)
        return None
    if key:
        mac = body.pop("signature", None)
        want = hmac.new(key, canonical_json(body), "sha256").hexdigest()
        if not isinstance(mac, str) or not hmac.compare_digest(mac, want):
            log.warning("%s is %s; ignored (signing is on)", where,
                        "unsigned" if mac is None else "signed with another key or altered")
            return None
    return body
