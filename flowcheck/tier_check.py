"""Whether each configured tier exists and what it holds of the run: an error, "not created yet", or "empty".

Reading commands ask this first, so a mistyped bucket is never reported as an empty store. The rules, per
tier (``Tier.exists``): a missing local root is a store not created yet (the first snapshot creates it); a
``file://`` object folder likewise when its parent exists, while a missing parent too is a TierMissingError
(a typo, or a volume not mounted); an S3 bucket must exist (TierMissingError names it), and a prefix with no
objects under it is an existing, empty store (S3 has no folders to create).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flowcheck.config import Config
from flowcheck.tiers.base import Tier


class Store(Protocol):
    """What the check reads of a store (flowcheck/store.py's Store)."""

    config: Config

    def tiers(self, include_memory: bool = True) -> list[Tier]: ...
    def branch_tiers(self, name: str) -> list[Tier]: ...


@dataclass(frozen=True)
class TierState:
    """What a configured persistent tier holds for one run, as a reading command reports it (``Store.check_tiers``)."""

    tier: str  # "local" | "object"
    where: str  # the root folder or URL the config names
    field: str  # the config field naming it: tiers.local.root | tiers.object.url
    run: str
    created: bool  # False: its root does not exist yet (a new store; nothing was written there)
    states: int  # committed states of the run, over all its branches

    @property
    def empty(self) -> bool:
        return self.states == 0

    def describe(self) -> str:
        """``object tier s3://b/p exists and holds no steps of run r1`` and the like."""
        if not self.created:
            return f"{self.tier} tier {self.where} ({self.field}) is not created yet: it holds no steps of run {self.run}"
        if self.empty:
            return f"{self.tier} tier {self.where} exists and holds no steps of run {self.run}"
        return f"{self.tier} tier {self.where} holds {self.states} committed state(s) of run {self.run}"


def check_tiers(store: Store) -> list[TierState]:
    """Each persistent tier's TierState, fastest first; raises TierMissingError / TierAccessError (see the module)."""
    out = []
    for t in store.tiers(include_memory=False):
        where, field = ((store.config.tiers.local.root, "tiers.local.root") if t.name == "local"
                        else (store.config.tiers.object.url, "tiers.object.url"))
        created = t.exists()
        states = sum(len(bt.steps()) for bt in store.branch_tiers(t.name)) if created else 0
        out.append(TierState(t.name, where, field, store.config.run, created, states))
    return out
