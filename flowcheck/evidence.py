"""What this process's next state of a run descends from: the state it loaded, or what it saved since.

A lineage edge needs evidence (docs/format.md, "Branches").  The default ("auto") parent of a ``Checkpointer`` push or a
``flowcheck.dcp.Writer`` save is what this process loaded (``Checkpointer.load``, a ``flowcheck.dcp.Reader``) or
last saved in the run; a process that did neither starts a new root.  The store's newest step is no evidence: a
second fresh run of a job would claim to descend from the first.  Kept per process, since a job resumes per process
(a Writer is made anew for every save); ``forget`` clears it (a test that plays several jobs in one process).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from flowcheck.manifest import ParentRef

LOADED, SAVED, PUSHED = "loaded", "saved", "pushed"
_KEEP = 16  # saves remembered per run: a retried save looks back one; a few more cost nothing


@dataclass(frozen=True)
class Known:
    """A state of the run this process loaded or saved.  ``ref`` is None for a push: the node commits it, so the
    trainer knows its step but not its digest (the node chains what it commits next to it)."""

    step: int
    ref: ParentRef | None
    how: str  # LOADED | SAVED | PUSHED


_lock = threading.Lock()
_known: dict[str, list[Known]] = {}


def loaded(run: str, ref: ParentRef) -> None:
    """This process brought its state back to ``ref``: what it saves next descends from it, not from earlier saves."""
    with _lock:
        _known[run] = [Known(ref.step, ref, LOADED)]


def saved(run: str, ref: ParentRef) -> None:
    _add(run, Known(ref.step, ref, SAVED))


def pushed(run: str, step: int) -> None:
    _add(run, Known(step, None, PUSHED))


def _add(run: str, known: Known) -> None:
    with _lock:
        _known[run] = (_known.get(run, []) + [known])[-_KEEP:]


def parent_for(run: str, step: int) -> Known | None:
    """What a new state of ``run`` at ``step`` descends from, as this process knows it; None: nothing (a fresh start).

    The newest save before ``step`` (saving a step again, a retry, descends from what that step descended from);
    the loaded state whatever its step (a state loaded at step 20 and saved as step 10 still descends from 20)."""
    with _lock:
        known = list(_known.get(run, []))
    for k in reversed(known):
        if k.how == LOADED or k.step < step:
            return k
    return None


def forget(run: str | None = None) -> None:
    """Drop what this process knows of ``run`` (None: of every run): its next save starts a new root."""
    with _lock:
        if run is None:
            _known.clear()
        else:
            _known.pop(run, None)


def check_parent(who: str, parent: object) -> None:
    """A ``parent=`` argument: ``"auto"``, None, a step number, a ``ParentRef`` or a Reader (it has ``resumed``)."""
    from flowcheck.errors import ConfigError

    step = isinstance(parent, int) and not isinstance(parent, bool) and parent >= 0
    if not (step or parent is None or parent == "auto" or isinstance(parent, ParentRef) or hasattr(parent, "resumed")):
        raise ConfigError(f"{who}: parent: expected 'auto', None, a step number, a ParentRef or a flowcheck.dcp.Reader, "
                          f"found {parent!r}")


def root_hint(who: str, run: str, step: int) -> str:
    """The one line a fresh start logs: what it does, and how to name the parent of a job that resumed otherwise."""
    return (f"{who}: step {step} of run {run!r} starts a new root lineage: this process loaded no state of the run "
            f"and saved none (a fresh start); if the job resumed by other means, name its parent (parent=N for "
            f"step N, or parent=reader for the flowcheck.dcp.Reader it loaded with)")
