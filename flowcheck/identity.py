"""A run's identity, bound to its store by the first writer.

Two experiments left at the default run name in one local root would share one run: each one's ``--step latest``
would read the other's newest state, and a day later GC would delete one of them as an abandoned branch.  So the
first config that writes a run records who it is (``identity`` under the run's local root: run, object URL, local
root, node, when); a writer whose config points the run at another object store is another experiment and is
refused, naming both.  A config that had no object tier may gain one (the record then takes its URL), and a
store copied or mounted at another path is bound again where it is now.  A reader
whose config differs is warned, not refused: looking at another experiment's steps is legitimate.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from flowcheck.config import Config
from flowcheck.errors import ConfigError

log = logging.getLogger(__name__)

IDENTITY = "identity"  # the record's name under the run's local root


class RunIdentityError(ConfigError):
    """A config that would write another experiment's run."""


@dataclass(frozen=True)
class RunIdentity:
    run: str
    object_url: str | None  # None: the experiment had no object tier
    local_root: str
    node: str
    created_at: str = ""

    @classmethod
    def of(cls, config: Config) -> RunIdentity:
        obj = config.tiers.object
        url = obj.url if obj.enabled and obj.url else None
        if url is not None and url.startswith("file://") and not url.startswith("file:///"):
            url = "file://" + os.path.abspath(url[len("file://"):])  # embedded defaults: relative to the cwd
        return cls(config.run, url, os.path.abspath(config.tiers.local.root), config.node)

    @classmethod
    def parse(cls, raw: bytes, where: str) -> RunIdentity:
        try:
            body = json.loads(raw)
            return cls(str(body["run"]), body["object_url"], str(body["local_root"]), str(body["node"]),
                       str(body.get("created_at", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise RunIdentityError(f"{where}: expected a run identity record (run, object_url, local_root, node), "
                                   f"found an unreadable one ({e}); remove it to bind the run to this config") from e

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode() + b"\n"

    def conflict(self, other: RunIdentity) -> bool:
        """Whether ``other`` (a config's identity) is another experiment than this bound one: it names the same
        local root (a store copied or mounted elsewhere is rebound, not refused) and another object store."""
        return self.object_url is not None and other.object_url != self.object_url \
            and other.local_root == self.local_root

    def describe(self) -> str:
        return (f"object tier {self.object_url or '(none)'}, node {self.node!r}"
                + (f", since {self.created_at}" if self.created_at else ""))


def bound(tier: Any) -> RunIdentity | None:
    """The identity recorded under a local tier's run root (None: no writer recorded one yet)."""
    raw = tier.get_record(IDENTITY)
    return None if raw is None else RunIdentity.parse(raw, os.path.join(tier.root, IDENTITY))


def claim(config: Config, tier: Any) -> bool:
    """Before a write: RunIdentityError if the run belongs to another experiment; else whether this config's
    identity is still to be recorded (``record``, once something was written: a refused write leaves nothing)."""
    mine, held = RunIdentity.of(config), bound(tier)
    if held is not None and held.conflict(mine):
        raise RunIdentityError(_conflict_message(config, tier, held, mine))
    return held is None or (held.object_url, held.local_root) != (mine.object_url, mine.local_root)


def warn_if_foreign(config: Config, tier: Any) -> None:
    """Before reads: warn when the run was bound by another experiment's config."""
    try:
        held = bound(tier)
    except RunIdentityError as e:
        log.warning("%s", e)
        return
    except OSError:
        return  # an unreadable local root: the tier's own checks name it when it is used
    mine = RunIdentity.of(config)
    if held is not None and held.conflict(mine):
        log.warning("%s", _conflict_message(config, tier, held, mine, reading=True))


def record(config: Config, tier: Any) -> None:
    mine = RunIdentity.of(config)
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    tier.put_record(IDENTITY, RunIdentity(mine.run, mine.object_url, mine.local_root, mine.node, now).to_bytes())


def _conflict_message(config: Config, tier: Any, held: RunIdentity, mine: RunIdentity, reading: bool = False) -> str:
    what = "reads" if reading else "would write"
    return (f"run {config.run!r} in {tier.root} belongs to another experiment ({held.describe()}); this config "
            f"{what} it with object tier {mine.object_url or '(none)'}: two experiments in one run read and prune "
            "each other's steps.  Give this experiment its own run name (`run:` in its config, or --run NAME) or "
            f"local root; if it is the same experiment moved to a new object store, remove "
            f"{os.path.join(tier.root, IDENTITY)} to bind the run to this config")
