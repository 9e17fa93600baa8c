"""The demo's checks after the push half: resumed losses, audit, export, restore into Megatron (both formats).

Each check is done here through the library and returned as a ``Check`` with the
``flowcheck`` command that does the same from a shell (absolute paths, the
demo's ``--config``), so the CLI only prints; ``DemoSummary`` holds them all and
words the verdict.
"""
from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace

from flowcheck.demo.push import PushResult
from flowcheck.errors import FlowcheckError
from flowcheck.progress import human_bytes

RESTORE_FORMATS = ("megatron-dist", "megatron")


@dataclass(frozen=True)
class Check:
    """One thing the demo checked: the command a user would run for it, what it found, passed or not."""

    name: str
    ok: bool
    claim: str  # what was shown, for the PASSED verdict ("" for a step that checks nothing)
    problem: str = ""  # the first thing that failed, for the FAILED verdict
    command: str = ""  # the equivalent `flowcheck ...` command line (pasteable), "" when there is none
    report: tuple[str, ...] = ()  # what it printed / found, one line each


@dataclass(frozen=True)
class DemoSummary:
    checks: tuple[Check, ...] = ()

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def plus(self, *checks: Check) -> DemoSummary:
        return replace(self, checks=self.checks + checks)

    @property
    def verdict(self) -> str:
        if self.ok:
            return "demo: PASSED — " + "; ".join(c.claim for c in self.checks if c.claim)
        return "demo: FAILED — " + "; ".join(f"{c.name}: {c.problem or 'failed'}" for c in self.checks if not c.ok)


def command(*args: str) -> str:
    """A ``flowcheck`` command line as a shell reads it back (shlex-quoted)."""
    return shlex.join(["flowcheck", *args])


def verify(push: PushResult, on_check: Callable[[Check], None] = lambda c: None) -> DemoSummary:
    """Every check of the push half, in order; ``on_check`` gets each as soon as it is done."""
    from flowcheck.store import open_store

    store = open_store(push.config_path)
    expected = _trainer_state(push.final_state)
    checks: list[Check] = []

    def done(check: Check) -> None:
        on_check(check)
        checks.append(check)

    done(resume_check(push))
    done(_guarded("audit", lambda: audit_check(push, store)))
    done(_guarded("export", lambda: export_check(push, store, expected)))
    restores = [_guarded(f"restore {fmt}", lambda fmt=fmt: restore_check(push, store, expected, fmt))
                for fmt in RESTORE_FORMATS]
    for check in with_megatron_core(push, restores, expected):
        done(check)
    done(object_check(push))
    return DemoSummary(tuple(checks))


def object_check(push: PushResult) -> Check:
    """Whether the object tier took part: with a policy in hours (configs/hourly.yaml) no promotion runs in a demo
    of seconds, and a PASSED that does not say so would claim what was not shown."""
    promotions = push.status.get("policy", {}).get("promotions", 0)
    if promotions:
        return Check("object tier", True, "")
    obj = push.config.policy.object
    why = ("tiers.object is disabled" if not push.config.tiers.object.enabled else
           f"no promotion ran: policy.object every {obj.every_seconds:g} s" if obj.every_seconds else
           "no promotion ran: policy.object has no timer")
    line = (f"object tier NOT exercised ({why}); every check above read the local tier; "
            f"--object-seconds 2 exercises it")
    return Check("object tier", True, line, report=(line,))


def _guarded(name: str, run: Callable[[], Check]) -> Check:
    """A check that cannot even run has failed; the others still run."""
    try:
        return run()
    except FlowcheckError as e:
        return Check(name, False, "", str(e), report=(f"{name} failed: {e}",))


def _trainer_state(path: str) -> dict:
    """The trainer's live state at its last step, as torch tensors by canonical name ({} when it wrote none)."""
    if not path:
        return {}
    from safetensors.torch import load_file

    return load_file(path)


def resume_check(push: PushResult) -> Check:
    if push.resumed_from is None:
        t2 = push.trainers[-1]
        return Check("resume", False, "", f"trainer 2 restored no step (exit status {t2.returncode}; see {t2.log})")
    span = f"steps {push.resumed_from + 1}..{push.last}"
    line = f"losses of the resumed trainer, {span}, identical to the uninterrupted run bit for bit: {push.identical}"
    if push.identical:
        return Check("resume", True, f"killed trainer resumed from step {push.resumed_from}, losses == uninterrupted "
                     f"run bit for bit ({span})", report=(line,))
    differ = [s for s in range(push.resumed_from + 1, push.last + 1) if push.losses.get(s) != push.reference[s]]
    return Check("resume", False, "", f"the resumed losses differ from the uninterrupted run at {len(differ)} steps "
                 f"(first: step {differ[0]})", report=(line,))


def audit_check(push: PushResult, store) -> Check:
    from flowcheck.audit import audit

    report = audit(store)
    lines = (f"audit {'OK' if report.ok else 'FAILED'}: {report.checked_steps} step copies verified",
             *(str(p) for p in report.problems))
    problem = "" if report.ok else (str(report.problems[0]) if report.problems else "audit failed")
    return Check("audit", report.ok, f"audit OK ({report.checked_steps} step copies)", problem,
                 command("audit", "--config", push.config_path), lines)


def export_check(push: PushResult, store, expected: dict) -> Check:
    from flowcheck.restore import export_safetensors
    from flowcheck.torch import to_numpy

    last = push.last
    tier = store.find(last, "object") if store.object and last in store.object.steps() else store.find(last, "local")
    out = os.path.join(os.path.dirname(push.config_path), "export", f"step-{last}.safetensors")
    cmd = command("export", "--step", str(last), "--from", tier.name, "--out", out, "--config", push.config_path)
    size, _ = export_safetensors(tier, tier.manifest(last), out)
    from safetensors.torch import load_file

    loaded = load_file(out)
    differ = [n for n, t in expected.items()
              if n not in loaded or loaded[n].shape != t.shape or to_numpy(loaded[n]).tobytes() != to_numpy(t).tobytes()]
    ok = bool(expected) and not differ
    line = (f"exported {human_bytes(size)} from the {tier.name} tier; safetensors.torch.load_file == the trainer's "
            f"live state bit for bit: {ok} ({len(expected) - len(differ)} of {len(expected)} tensors)")
    problem = ("the trainer left no final state to compare with" if not expected
               else f"{len(differ)} tensors differ from the trainer's state (first: {differ[0]})" if differ else "")
    return Check("export", ok, f"export of step {last} == trainer's state ({len(expected)} tensors)", problem, cmd,
                 (line,))


def restore_dir(push: PushResult, fmt: str) -> str:
    from flowcheck.demo.megatron import PP, TP

    return os.path.join(os.path.dirname(push.config_path), "restore", f"tp{TP}-pp{PP}-{fmt}")


def restore_check(push: PushResult, store, expected: dict, fmt: str) -> Check:
    from flowcheck.demo.megatron import PP, TP, restore_and_check

    out = restore_dir(push, fmt)
    cmd = command("restore", "--step", "latest", "--tp", str(TP), "--pp", str(PP), "--format", fmt, "--out", out,
                  "--force", "--config", push.config_path)
    if not expected:
        return Check(f"restore {fmt}", False, "", "the trainer left no final state to compare with", cmd)
    r = restore_and_check(store, fmt, out, expected, push.last)
    lines = []
    if r.step is not None:
        lines.append(f"restored step {r.step} into {out}: {fmt}, TP={TP} PP={PP}, {r.files} files, "
                     f"{human_bytes(r.nbytes)} in {r.seconds:.1f} s")
    lines.append(f"loaded back in one process with {r.loader}, TP shards concatenated, vocabulary padding and "
                 f"stage-local layer numbers undone: {r.compared} tensors (weights, Adam moments"
                 f"{', fp32 masters' if fmt == 'megatron-dist' else ''}, step counters) == the trainer's state bit for "
                 f"bit: {r.ok}")
    lines.extend(f"  {p}" for p in r.problems[:10])
    return Check(f"restore {fmt}", r.ok, f"restore TP{TP}/PP{PP} {fmt} == trainer's state ({r.compared} tensors)",
                 r.problems[0] if r.problems else ("nothing compared" if not r.ok else ""), cmd, tuple(lines))


def with_megatron_core(push: PushResult, restores: list[Check], expected: dict) -> list[Check]:
    """The restore checks, each with one more line: megatron-core's own load of the checkpoint (its GPTModel's
    logits against the trainer's model), or that megatron-core is not installed."""
    from flowcheck.demo import mcore

    if not mcore.available():
        note = ("megatron-core is not installed: checked by the read-back above only "
                "(`pip install megatron-core` adds a load into GPTModels at TP=2/PP=2)")
        return [replace(c, report=c.report + (note,)) for c in restores]
    formats = [f for f, c in zip(RESTORE_FORMATS, restores) if c.ok]
    if not formats:
        return restores
    work = os.path.join(os.path.dirname(push.config_path), "restore", "megatron-core")
    try:
        loads = mcore.load_all({f: restore_dir(push, f) for f in formats}, expected, work)
    except (OSError, RuntimeError, ValueError) as e:  # megatron-core's processes could not even be started
        failed = f"megatron-core could not load it: {type(e).__name__}: {e}"
        loads = {f: mcore.McoreLoad(f, False, failed) for f in formats}
    out = []
    for fmt, check in zip(RESTORE_FORMATS, restores):
        load = loads.get(fmt)
        if load is None:
            out.append(check)
            continue
        claim = check.claim + ", loaded by megatron-core: same logits"
        out.append(replace(check, ok=check.ok and load.ok, claim=claim, report=check.report + (load.line,),
                           problem=check.problem or ("" if load.ok else load.line)))
    return out
