"""Crash consistency: kill -9 a snapshot, a promotion, a GC or an export at hundreds of I/O events.

Each kill point runs the operation in a real child process (forked from a warm zygote, see
crash_child.py) that SIGKILLs itself before its k-th file create / write (torn) / fsync / syncfs /
rename / unlink / S3 PUT-POST-DELETE.  After every kill the parent checks, with fresh tier objects:

- ``audit`` finds no error (an abandoned ``.tmp`` or manifest-less prefix is only a warning);
- every committed step of every tier reads back bit-exactly as the state written under that step;
- no step the operation had not committed is visible, and nothing committed before it is gone
  (GC: only the steps its retention plan deletes), so the newest committed step is still there;
- an export's output is absent or complete, never a partial file under the final name;

then recovers like an operator would — ``gc`` cleans the leftovers (no ``.tmp``, no manifest-less
prefix, no staging file, no open multipart upload remains), the operation re-runs and succeeds —
and audits again, now without a single finding.

Kill points are stratified over the operation's events (counted by a first, uninterrupted run) and
drawn from a seed (where a run has fewer events than points, every event is killed at least once;
the repeats differ in torn fraction and history).  The default run kills 320 points, most of them
local and file:// (S3 through moto is the slow part), in about 3-4 minutes on 2 busy cores;
FLOWCHECK_CRASH_POINTS=N sets the points per case, FLOWCHECK_CRASH_SEED the seed.  The tally
(kill points survived / total per operation and tier, and the kinds of events killed at) is printed
and written to ``<pytest basetemp>/crash_tally.json``.
"""
from __future__ import annotations

import collections
import json
import os
import random
import select
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from flowcheck.audit import audit
from flowcheck.digest import data_digest
from flowcheck.restore.export import export_file
from flowcheck.store import Store
from flowcheck.tiers import retention
from tests.reliability import crash_child as cc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = int(os.environ.get("FLOWCHECK_CRASH_SEED", "20250601"))


@dataclass(frozen=True)
class Case:
    op: str  # snapshot | promote | gc | export
    tier: str  # local | object-file | object-s3
    points: int  # kill points in the default run
    big_mib: float = 1.5  # the big tensor: two 1 MiB zarr chunks; on S3 6 MiB -> a multipart upload of 2 parts
    max_file_mib: int = 1

    @property
    def id(self) -> str:
        return f"{self.op}-{self.tier}"


CASES = [
    Case("snapshot", "local", 200),  # the packed write path (native pack writer, per-file fsyncs): >= 200 points
    Case("promote", "object-file", 50),
    pytest.param(Case("promote", "object-s3", 12, big_mib=6, max_file_mib=8), marks=pytest.mark.s3, id="promote-object-s3"),
    Case("gc", "local", 25),
    Case("gc", "object-file", 15),
    pytest.param(Case("gc", "object-s3", 6), marks=pytest.mark.s3, id="gc-object-s3"),
    Case("export", "local", 12),
]


@dataclass
class Tally:
    cases: dict[str, dict] = field(default_factory=dict)

    def record(self, case: Case, events: int, ks: list[int], killed_at: list[str], survived: int) -> None:
        self.cases[case.id] = {
            "op": case.op, "tier": case.tier, "events_per_run": events, "kill_points": len(ks),
            "distinct_events_killed": len(set(ks)), "killed": len(killed_at), "survived": survived,
            "killed_at": dict(collections.Counter(k.split(" ")[0] if not k.startswith("s3") else " ".join(k.split(" ")[:2])
                                                  for k in killed_at)),
        }

    def summary(self) -> str:
        lines = [f"{c['op']:>8} {c['tier']:<12} survived {c['survived']}/{c['kill_points']} kill points "
                 f"({c['distinct_events_killed']} of {c['events_per_run']} events of a run; killed at {c['killed_at']})"
                 for c in self.cases.values()]
        total = sum(c["kill_points"] for c in self.cases.values())
        ok = sum(c["survived"] for c in self.cases.values())
        return "\n".join(["crash consistency:", *lines, f"   total: survived {ok}/{total} kill points"])


@pytest.fixture(scope="module")
def tally(request, tmp_path_factory):
    t = Tally()
    yield t
    if t.cases:
        path = tmp_path_factory.getbasetemp() / "crash_tally.json"
        path.write_text(json.dumps(t.cases, indent=2))
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():  # shown even without -s: these are the figures to quote
            print("\n" + t.summary() + f"\n(written to {path})", flush=True)


class Zygote:
    """The warm parent of every crashing child (tests/reliability/crash_child.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.crash_child"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], cc.CHILD_TIMEOUT_S + 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"crash zygote did not answer (exit code {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def kill_points(events: int, n: int, rng: random.Random) -> list[int]:
    """n event numbers in 1..events: each event once while n allows, the rest one drawn from each of
    equal strata of the run (so every region of it is hit)."""
    every = list(range(1, events + 1)) if n >= events else []
    m = n - len(every)
    return every + [1 + int((i + rng.random()) * events / m) for i in range(m)]


class Scenario:
    """One case's store, the states it holds, and the checks run after every kill."""

    def __init__(self, case: Case, root: str, object_url: str, env: dict[str, str]) -> None:
        self.case, self.root, self.env = case, root, env
        self.config = dict(root=root, object_url=object_url, max_file_mib=case.max_file_mib, keep_local=2, keep_object=2)
        self.step = 100
        self._digests: dict[int, dict] = {}

    def store(self) -> Store:
        return Store(cc.config(**self.config))  # fresh tier objects: no cache can hide what is on disk

    def persistent(self, store: Store) -> list:
        return [store.local] + ([store.object] if self.case.tier.startswith("object") else [])

    def visible(self) -> dict[str, list[int]]:
        return {t.name: t.steps() for t in self.persistent(self.store())}

    def expected(self, step: int) -> dict:
        return cc.arrays(step, self.case.big_mib)

    # ---- per kill point: prepare, the request, recovery ---------------------------------
    def prepare(self) -> dict:
        """Commit what the operation needs (in this process, no faults); return its request."""
        self.step += 1
        store, case = self.store(), self.case
        req = dict(op=case.op, step=self.step, big_mib=case.big_mib, config=self.config, env=self.env,
                   tier=case.tier.split("-")[0], out=os.path.join(self.root, "export", "model.safetensors"))
        if case.op != "snapshot":
            store.write(cc.state(self.step, case.big_mib), "local")
        if case.op == "gc" and case.tier != "local":
            store.promote(self.step)
        if case.op == "export":
            shutil.rmtree(os.path.dirname(req["out"]), ignore_errors=True)
        return req

    def gc_plan(self, always: bool = False) -> dict[str, set[int]]:
        """What a GC may delete now: its retention plan's steps per tier."""
        if self.case.op != "gc" and not always:
            return {}
        store = self.store()
        out = {}
        for t in self.persistent(store):
            infos = [retention.StepInfo(s, retention.parse_time(t.manifest(s).created_at)) for s in t.steps()]
            out[t.name] = {k.step for k in retention.plan(infos, getattr(store.config.policy, t.name)).delete}
        return out

    def recover(self, req: dict) -> dict[str, set[int]]:
        """What an operator does after the crash: GC cleans leftovers, the operation runs again.
        Returns what that GC's retention plan may delete."""
        plan = self.gc_plan(always=True)
        store = self.store()
        store.gc()
        if self.case.op == "snapshot" and self.step not in store.local.steps():
            store.write(cc.state(self.step, self.case.big_mib), "local")
        elif self.case.op == "promote":
            store.promote(self.step)
        elif self.case.op == "export":
            export_file(store.local, store.local.manifest(self.step), req["out"])
        elif self.case.op == "gc":
            store.gc()
        return plan

    # ---- checks --------------------------------------------------------------------------
    def check(self, before: dict[str, list[int]], may_add: dict[str, set[int]], may_delete: dict[str, set[int]],
              req: dict, *, clean: bool) -> list[str]:
        """Everything that must hold after a crash (``clean``: and after recovery); returns the failures."""
        store = self.store()
        # after the crash: the full audit (every file and shard re-read); after recovery every file's
        # size and digest, manifests and lineage — and now not even a warning may remain
        report = audit(store, data=not clean)
        bad = [str(p) for p in report.problems if clean or p.severity == "error"]
        for t in self.persistent(store):
            now = t.steps()
            prev = before.get(t.name, [])
            if set(now) - set(prev) - may_add.get(t.name, set()):
                bad.append(f"{t.name}: steps {sorted(set(now) - set(prev))} appeared; only {may_add.get(t.name)} may")
            gone = set(prev) - set(now) - may_delete.get(t.name, set())
            if gone:
                bad.append(f"{t.name}: committed steps {sorted(gone)} were lost")
            if prev and prev[-1] not in now:
                bad.append(f"{t.name}: the newest committed step {prev[-1]} is gone")
            for s in now:  # the step the operation wrote and the newest before it are read back in full
                bad += self.bit_exact(t, s, read=s == self.step or (bool(prev) and s == prev[-1]))
            if clean and self.step in may_add.get(t.name, ()) and self.step not in now:
                bad.append(f"{t.name}: step {self.step} is not committed after the re-run")
            if clean and t.incomplete():
                bad.append(f"{t.name}: leftovers after GC: {t.incomplete()}")
        if clean:
            bad += self.no_staging_or_uploads(store)
        if self.case.op == "export":
            bad += self.export_whole(req["out"], must_exist=clean)
        return bad

    def bit_exact(self, tier, step: int, *, read: bool) -> list[str]:
        """A committed step holds exactly the state written under its number: the manifest's shard digests
        are the written arrays' (audit has checked every stored byte against them); ``read``: the
        shards are also read back and compared byte for byte."""
        m = tier.manifest(step)
        if step not in self._digests:
            self._digests[step] = {(s.tensor, s.offsets, s.shape): data_digest(a) for s, a in self.expected(step).items()}
        want = self._digests[step]
        got = {(n, e.offsets, e.shape): e.digest for n, t in m.tensors.items() for e in t.shards}
        if got != want or m.scalars.get("optimizer_step") != step:
            return [f"{tier.name} step {step}: manifest does not describe the state written under step {step}"]
        if not read:
            return []
        entries = {(n, e.offsets, e.shape): (n, e) for n, t in m.tensors.items() for e in t.shards}
        return [f"{tier.name} step {step}: {s.tensor}{list(s.offsets)} reads back different bytes"
                for s, a in self.expected(step).items()
                if tier.read_shard(m, *entries[(s.tensor, s.offsets, s.shape)], verify=False).tobytes() != a.tobytes()]

    def no_staging_or_uploads(self, store: Store) -> list[str]:
        bad = []
        staging = os.path.join(self.root, "staging")
        if os.path.isdir(staging) and os.listdir(staging):
            bad.append(f"staging files left after GC: {os.listdir(staging)}")
        if self.case.tier == "object-s3":
            bucket, _, prefix = store.object.root.partition("/")
            ups = store.object.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            if ups.get("Uploads"):
                bad.append(f"multipart uploads left open after GC: {[u['Key'] for u in ups['Uploads']]}")
        return bad

    def export_whole(self, out: str, *, must_exist: bool) -> list[str]:
        if not os.path.exists(out):
            return [f"export: {out} is missing after a successful re-run"] if must_exist else []
        with open(out, "rb") as f:
            data = f.read()
        ref = self.reference_export(out)
        return [] if data == ref else [f"export: {out} exists but is not the complete export ({len(data)} of {len(ref)} bytes)"]

    def reference_export(self, out: str) -> bytes:
        store = self.store()
        path = out + ".reference"
        export_file(store.local, store.local.manifest(self.step), path)
        with open(path, "rb") as f:
            data = f.read()
        os.unlink(path)
        return data


def _s3_env(request) -> tuple[str, dict[str, str]]:
    url = request.getfixturevalue("s3_bucket")
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    return url, {k: os.environ[k] for k in keys}


def kill_once(zygote: Zygote, sc: Scenario, k: int, torn: float, result: str) -> tuple[dict, list[str]]:
    """Prepare one step, run the operation in a child killed before event k, check, recover, check again."""
    req = sc.prepare()
    before = sc.visible()
    may_add = {"snapshot": {"local": {sc.step}}, "promote": {"object": {sc.step}}}.get(sc.case.op, {})
    may_delete = sc.gc_plan()
    if os.path.exists(result):
        os.unlink(result)
    answer = zygote.run({**req, "kill_at": k, "torn": torn, "result": result})
    if answer["signal"] not in (0, 9) or answer["exit"] not in (0, None):
        error = "it wrote no result"
        if os.path.exists(result):
            with open(result) as f:
                error = json.load(f)["error"]
        return answer, [f"the child failed: {error}"]
    bad = sc.check(before, may_add, may_delete, req, clean=False)
    if not bad:
        plan = sc.recover(req)
        deletable = {t: may_delete.get(t, set()) | plan.get(t, set()) for t in before}
        bad = [f"after recovery: {b}" for b in sc.check(before, may_add, deletable, req, clean=True)]
    if bad:
        sc.recover(req)  # keep going: the tally says how many points survive
    return answer, bad


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id if isinstance(c, Case) else None)
def test_kill_9_at_any_event_loses_nothing_committed_and_shows_nothing_uncommitted(case, request, tmp_path, zygote, tally):
    points = int(os.environ.get("FLOWCHECK_CRASH_POINTS", case.points))
    rng = random.Random(f"{SEED}-{case.id}")
    object_url, env = _s3_env(request) if case.tier == "object-s3" else (f"file://{tmp_path / 'object'}", {})
    sc = Scenario(case, str(tmp_path), object_url, env)
    result = str(tmp_path / "child.json")

    # a first, uninterrupted run counts the operation's events (and leaves a committed history)
    for _ in range(3):  # keep_last=2: the third run of a GC deletes a step
        req = sc.prepare()
        answer = zygote.run({**req, "kill_at": 0, "result": result})
        with open(result) as f:
            counted = json.load(f)
        assert answer == {"signal": 0, "exit": 0}, counted["error"]
        sc.recover(req)
    events = counted["events"]
    assert events, "the operation did no I/O the harness could see"

    failures, killed_at, survived = [], [], 0
    ks = kill_points(len(events), points, rng)
    for k in ks:
        # makedirs races vary a run's event count by one or two: a child that finishes before event k
        # is checked like any other point (it is "killed right after returning"), then the next step
        # is killed one event earlier
        for attempt in range(4):
            answer, bad = kill_once(zygote, sc, k - attempt, rng.random(), result)
            if answer["signal"] == 9 or bad:
                break
        if answer["signal"] == 9:
            killed_at.append(events[min(k - attempt, len(events)) - 1])
            survived += not bad
        if bad or answer["signal"] != 9:
            failures.append(f"kill point {k - attempt} ({answer}): " + "; ".join(bad[:3]))
    tally.record(case, len(events), ks, killed_at, survived)
    assert not failures, f"{len(failures)} of {points} kill points failed:\n" + "\n".join(failures[:10])


def test_kill_9_while_committing_a_colliding_step_keeps_both_branches(tmp_path, zygote):
    """A rollback's different state at an existing step, killed at every I/O event of its commit: the
    committed state at that step stays bit-exact on main; the new one is absent or complete on its
    branch; recovery (GC, then the commit again) leaves both, and no leftovers."""
    cfg = dict(root=str(tmp_path), object_url=f"file://{tmp_path / 'object'}", keep_local=5, keep_object=5)
    store = Store(cc.config(**cfg))
    for step in (1, 2, 3):
        store.write(cc.state(step, 1.5), "local")
    want_old = {(s.tensor, s.offsets): a.tobytes() for s, a in cc.arrays(2, 1.5).items()}
    want_new = {(s.tensor, s.offsets): a.tobytes() for s, a in cc.collided(2, 1.5).data.items()}
    result = str(tmp_path / "child.json")
    req = dict(op="collide", step=2, big_mib=1.5, config=cfg, env={}, tier="local", out="")

    def branches() -> dict[str, object]:
        s = Store(cc.config(**cfg))
        return {bt.branch: bt for bt in s.branch_tiers("local") if 2 in bt.steps()}

    def check(bts, clean: bool) -> list[str]:
        bad = []
        main = bts.get("main")
        if main is None or {(n, e.offsets): main.read_shard(main.manifest(2), n, e).tobytes()
                            for n, t in main.manifest(2).tensors.items() for e in t.shards} != want_old:
            bad.append("main step 2 lost or changed")
        for name, bt in bts.items():
            if name != "main" and {(n, e.offsets): bt.read_shard(bt.manifest(2), n, e).tobytes()
                                   for n, t in bt.manifest(2).tensors.items() for e in t.shards} != want_new:
                bad.append(f"branch {name} step 2 is not the colliding state")
        if clean and len(bts) != 2:
            bad.append(f"after recovery expected main and one branch at step 2, found {sorted(bts)}")
        return bad

    answer = zygote.run({**req, "kill_at": 0, "result": result})
    with open(result) as f:
        events = json.load(f)["events"]
    assert answer == {"signal": 0, "exit": 0} and events
    failures = []
    for k in range(1, len(events) + 1):
        for bt in list(branches().values()):  # back to main alone: each point commits the branch afresh
            if bt.branch != "main":
                shutil.rmtree(os.path.dirname(bt.root + "/"), ignore_errors=True)
        answer = zygote.run({**req, "kill_at": k, "torn": 0.5, "result": result})
        bad = check(branches(), clean=False)
        recovered = Store(cc.config(**cfg))
        recovered.gc()
        recovered.write(cc.collided(2, 1.5), "local")
        bad += [f"after recovery: {b}" for b in check(branches(), clean=True)]
        leftovers = [p for bt in recovered.branch_tiers("local") for p in bt.incomplete()]
        if leftovers:
            bad.append(f"leftovers after GC: {leftovers}")
        if bad:
            failures.append(f"kill point {k} ({answer}): {'; '.join(bad)}")
    assert not failures, "\n".join(failures[:10])
