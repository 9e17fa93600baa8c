"""What ``flowcheck ls`` lists: one row per committed step (or incomplete write) per tier and branch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowcheck.errors import FlowcheckError
from flowcheck.progress import human_bytes

if TYPE_CHECKING:
    from flowcheck.tier_check import TierState
    from flowcheck.tiers.base import Tier


@dataclass(frozen=True)
class StepRow:
    """A committed step (``status`` "committed", or "unreadable: …") or an incomplete write (``step`` None)."""

    tier: str
    branch: str
    current: bool  # the branch is the store's current one
    step: int | None
    bytes: int = 0
    created_at: str = ""
    source: str = ""
    status: str = "committed"
    digest: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Listing:
    """Every tier's rows at every branch, with what the text form heads and ends with."""

    run: str
    current: str
    local_root: str
    object_url: str | None
    rows: list[StepRow]
    states: list[TierState]

    def lines(self) -> list[str]:
        """The table ``flowcheck ls`` prints."""
        out = [f"run {self.run}   current branch {self.current}   local {self.local_root}   "
               f"object {self.object_url or '-'}"]
        width = max([len("branch")] + [len(r.branch) + 2 for r in self.rows])
        out.append(f"{'tier':7} {'branch':{width}} {'step':>9} {'size':>10}  {'created (UTC)':27} {'source':8} status")
        for r in self.rows:
            step = "-" if r.step is None else str(r.step)
            branch = r.branch + (" *" if r.current else "")
            out.append(f"{r.tier:7} {branch:{width}} {step:>9} {human_bytes(r.bytes):>10}  {r.created_at:27} "
                       f"{r.source:8} {r.status}")
        out += [f"({state.describe()})" for state in self.states if state.empty]
        if not self.rows:
            out.append("(no steps yet: run `flowcheck demo` or a checkpoint node)")
        return out


def tier_rows(tier: Tier, current: str) -> list[StepRow]:
    """One tier at one branch: a row per committed step, then one per incomplete write."""
    rows = []
    for step in tier.steps():
        here = StepRow(tier.name, tier.branch, tier.branch == current, step)
        try:
            m = tier.manifest(step)
        except FlowcheckError as e:
            rows.append(dataclasses.replace(here, status=f"unreadable: {e}"))
            continue
        rows.append(dataclasses.replace(here, bytes=m.nbytes, created_at=m.created_at, source=m.producer.source,
                                        digest=m.digest()))
    rows += [StepRow(tier.name, tier.branch, tier.branch == current, None, status=f"incomplete ({name})")
             for name in tier.incomplete()]
    return rows
