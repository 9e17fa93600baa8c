"""Which launch of a training job a node takes pushes from.

Every rank of one launch of a job sends the same ``launch`` (an id and when it started) with each push
(flowcheck/torch/launch.py agrees on it).  A requeued job whose old copy still runs — a zombie — pushes the same run
under an older launch: the node takes the launch it saw last as current, and refuses the pushes of every launch it
superseded, so two copies of a job can never write parts of one step.  A launch the node never saw that started
before the current one is an old copy connecting late (to a node that restarted meanwhile): refused too.
Pushes that carry no launch (a multi-rank job whose ranks could not agree on one) are taken as before, with each
sender place of a step still claimed by one connection (flowcheck/node/receiver.py).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from flowcheck.capture.push.wire import WireError
from flowcheck.errors import FlowcheckError

_REMEMBERED = 64  # superseded launches kept to refuse by name (an older one unseen since is refused by its start)


@dataclass(frozen=True)
class Launch:
    """One launch of a job: ``id`` shared by all its ranks, ``started`` (unix seconds) when they agreed on it."""

    id: str
    started: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "started": self.started}

    @classmethod
    def from_json(cls, raw: Any) -> Launch | None:
        """The launch a push header names (None: it names none); WireError if malformed."""
        if raw is None:
            return None
        ok = isinstance(raw, dict) and isinstance(raw.get("id"), str) and 0 < len(raw["id"]) <= 200 \
            and isinstance(raw.get("started"), (int, float)) and not isinstance(raw.get("started"), bool)
        if not ok:
            raise WireError(f"push header: launch: expected {{id: a string, started: unix seconds}}, found {raw!r}")
        return cls(raw["id"], float(raw["started"]))

    def describe(self) -> str:
        return f"launch {self.id} (started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.started))} UTC)"


class Superseded(FlowcheckError):
    """A push from a launch of the job that a newer launch replaced: its trainer is an old copy of the job."""


class Launches:
    """The node's current launch of its run, and those it superseded."""

    def __init__(self) -> None:
        self.current: Launch | None = None
        self.current_from = ""  # the peer whose push made it current
        self._superseded: OrderedDict[str, Launch] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, launch: Launch | None, peer: str) -> Launch | None:
        """Take a push from ``launch`` (sent by ``peer``): the launch it supersedes, if it is a new one; Superseded
        if it is an old one."""
        if launch is None:
            return None
        with self._lock:
            current = self.current
            if current is not None and launch.id == current.id:
                return None
            if launch.id in self._superseded or (current is not None and launch.started < current.started):
                raise Superseded(f"push refused: {launch.describe()} was superseded by {self._describe_current()}: "
                                 "this trainer is an older copy of the job (a requeued job's previous run still "
                                 "pushing?); stop it — the node takes pushes only from the newest launch")
            if current is not None:
                self._superseded[current.id] = current
                while len(self._superseded) > _REMEMBERED:
                    self._superseded.popitem(last=False)
            self.current, self.current_from = launch, peer
            return current

    def _describe_current(self) -> str:
        return f"{self.current.describe()}, pushing from {self.current_from}"

    def to_json(self) -> dict[str, Any] | None:
        """What /status shows of the current launch."""
        current = self.current
        if current is None:
            return None
        return {**current.to_json(), "from": self.current_from, "superseded": len(self._superseded)}
