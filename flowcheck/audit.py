"""Audit: verify every stored state of every branch and walk the hash chain across tiers and branches.

Every manifest of every branch in every persistent tier is loaded (integrity,
signature), every file's size and digest and every shard's data digest
checked, and every ``parent`` link resolved against the manifests of all
branches and tiers and the pruning records GC leaves.  Findings are Problems;
any error makes the audit fail.  Forks (a rollback or restore starting a
branch) and further root lineages are information, not findings.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from flowcheck.branches import BRANCHES, MAIN, RECORD, History, Located
from flowcheck.errors import FlowcheckError, ManifestError, StepNotFoundError
from flowcheck.manifest import Manifest
from flowcheck.progress import Progress, counter
from flowcheck.store import Store
from flowcheck.tiers.base import MANIFEST, Problem, Tier, verify_bytes

Manifests = dict[tuple[str, Located], Manifest]  # (tier name, state) -> its manifest in that tier


def place(kind: str, branch: str) -> str:
    """Where a finding is filed: ``local`` on main, ``local@b250-260`` on another branch (also ``lineage``)."""
    return kind if branch == MAIN else f"{kind}@{branch}"


@dataclass
class Node:
    """One distinct state (by manifest digest), its branch and the tiers holding it."""

    step: int
    digest: str
    parent: tuple[int, str] | None
    source: str
    created_at: str
    tiers: list[str] = field(default_factory=list)
    ok: bool = True
    branch: str = MAIN
    places: list[str] = field(default_factory=list)  # place() of each tier holding it: findings filed there are its

    @property
    def at(self) -> Located:
        return Located(self.step, self.branch)


@dataclass(frozen=True)
class ForkPoint:
    """A state with several children: the lineage splits there (a restore or rollback started a branch)."""

    step: int
    branch: str | None  # None: the parent state is no longer stored (pruned by GC)
    digest: str
    children: tuple[Located, ...]


@dataclass
class AuditReport:
    problems: list[Problem] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)  # manifest digest -> node
    fork_points: list[ForkPoint] = field(default_factory=list)
    roots: list[Located] = field(default_factory=list)  # states without a parent: the first is the run's own
    checked_steps: int = 0
    verified: bool = False  # files were checked (audit), not only manifests and links (lineage)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    @property
    def forks(self) -> list[tuple[int, list[int]]]:
        """(parent step, child steps) per fork point."""
        return [(f.step, sorted(c.step for c in f.children)) for f in self.fork_points]


def branch_tiers(store: Store) -> list[Tier]:
    """Every branch of every persistent tier, main first within each tier."""
    return [bt for t in store.tiers(include_memory=False) for bt in store.branch_tiers(t.name)]


def pruned_states(store: Store) -> dict[int, set[str | None]]:
    """Step -> digests GC deleted on purpose, over every branch (None: a record whose manifest was unreadable)."""
    out: dict[int, set[str | None]] = {}
    for tier in branch_tiers(store):
        for step, digest in tier.pruned_records():
            out.setdefault(step, set()).add(digest)
    return out


def collect(store: Store, report: AuditReport, *, verify: bool, data: bool,
            on_bytes: Callable[[int], None] | None = None) -> Manifests:
    manifests: Manifests = {}
    for tier in branch_tiers(store):
        where = place(tier.name, tier.branch)
        for name in tier.incomplete():
            report.problems.append(Problem(where, None, "incomplete write (not visible; GC removes it)", name, "warning"))
        if tier.branch != MAIN:
            _check_record(tier, report)
        _check_latest(tier, report)
        for step in tier.steps():
            m = _checked(tier, step, report, verify=verify, data=data, on_bytes=on_bytes)
            if m is None:
                continue
            manifests[(tier.name, Located(step, tier.branch))] = m
            node = report.nodes.setdefault(m.digest(), Node(
                step, m.digest(), (m.parent.step, m.parent.manifest_digest) if m.parent else None,
                m.producer.source, m.created_at, branch=tier.branch))
            node.tiers.append(tier.name)
            node.places.append(where)
    for p in report.problems:
        for node in report.nodes.values():
            if p.severity == "error" and p.step == node.step and p.tier in node.places:
                node.ok = False
    return manifests


def _check_latest(tier: Tier, report: AuditReport) -> None:
    """The newest step a branch folder committed (its 'latest' record) must still be there, or pruned on record:
    a newest step deleted by hand would otherwise leave the audit clean and "latest" silently older.  With signing
    on, the record itself is evidence: one missing beside committed steps, or not sealed with the store's key (a
    hand-written step number), is an error — else deleting the newest step and rewriting the record would hide it."""
    newest, where = tier.latest_record(), place(tier.name, tier.branch)
    if newest is None and tier.has_latest_record():
        report.problems.append(Problem(
            where, None, "expected a 'latest' record sealed with this store's signing key, found one unreadable or "
            "unsigned: it was altered or written by hand (the newest committed steps may have been deleted)", "latest"))
        return
    if newest is None and tier.signing_key and tier.steps():
        report.problems.append(Problem(
            where, None, "expected a 'latest' record naming the newest step this tier committed, found none: it was "
            "removed by hand (the newest committed steps may have been deleted with it)", "latest"))
        return
    if newest is None or newest in tier.steps() or any(s == newest for s, _ in tier.pruned_records()):
        return
    report.problems.append(Problem(
        where, newest,
        f"expected step {newest} (the newest this tier committed, per its 'latest' record), found neither the step "
        "nor a pruning record: a committed step was deleted outside flowcheck or lost", "latest"))


def _check_record(tier: Tier, report: AuditReport) -> None:
    """A branch's fork record: damaged is an error; missing (its states committed anyway) a warning."""
    where = place(tier.name, tier.branch)
    try:
        record = tier.branch_record()
    except FlowcheckError as e:
        report.problems.append(Problem(where, None, str(e), RECORD))
        return
    if record is None and tier.steps():
        report.problems.append(Problem(where, None, "expected a fork record written before the branch's first state, "
                                       "found none; its states' parent links still name the fork point", RECORD, "warning"))


def _checked(tier: Tier, step: int, report: AuditReport, *, verify: bool, data: bool,
             on_bytes: Callable[[int], None] | None) -> Manifest | None:
    """One stored state's manifest (None when it does not load), its findings added to the report."""
    where = place(tier.name, tier.branch)
    report.checked_steps += 1
    try:
        m = tier.manifest(step)
    except (ManifestError, StepNotFoundError) as e:
        report.problems.append(Problem(where, step, str(e), MANIFEST))
        return None
    if m.signature is None and tier.signing_key is not None:
        # accepted (signing.required is off) but worth a look: a stripped signature reads like this
        report.problems.append(Problem(where, step, "unsigned manifest while a signing key is set; "
                                       "set signing.required: true to refuse unsigned steps", MANIFEST, "warning"))
    if verify:
        report.problems.extend(replace(p, tier=where) for p in tier.verify(step, data=data, on_bytes=on_bytes))
    return m


def part_aliases(manifests: Manifests) -> dict[str, str]:
    """Node part digest -> the digest of the multi-node step that lists it.

    A node's local tier holds only its own part of a multi-node step (promoted with its digest kept):
    that copy is the same state as its part, not a second state under the step number.
    """
    return {ref.manifest_digest: m.digest() for m in manifests.values() for ref in m.nodes}


def merge_parts(report: AuditReport, aliases: dict[str, str]) -> None:
    """Fold the lineage node of a node's part into the node of the step that lists it."""
    for digest in [d for d in report.nodes if d in aliases and aliases[d] in report.nodes]:
        part = report.nodes.pop(digest)
        whole = report.nodes[aliases[digest]]
        whole.tiers.extend(t for t in part.tiers if t not in whole.tiers)
        whole.places.extend(p for p in part.places if p not in whole.places)
        whole.ok = whole.ok and part.ok


def check_chain(store: Store, manifests: Manifests, report: AuditReport) -> None:
    aliases = part_aliases(manifests)
    states: dict[Located, set[str]] = {}
    for (_tier, at), m in manifests.items():
        states.setdefault(at, set()).add(aliases.get(m.digest(), m.digest()))
    # parent links may name a part (a node's own chain) as well as a whole state
    known = {(at.step, d) for at, digests in states.items() for d in digests}
    known |= {(at.step, ref.manifest_digest) for (_tier, at), m in manifests.items() for ref in m.nodes}
    for at, digests in sorted(states.items()):
        if len(digests) > 1:
            holders = sorted(t for (t, a) in manifests if a == at)
            report.problems.append(Problem(place("lineage", at.branch), at.step,
                                           f"tiers {holders} hold different states under one step number"))
    hist, pruned = store.history(), pruned_states(store)
    for (tier, at), m in sorted(manifests.items(), key=lambda kv: kv[0][1]):
        what = _link_finding(m, at, hist, known, pruned)
        if what is not None:
            report.problems.append(Problem(place(tier, at.branch), at.step, what))
    merge_parts(report, aliases)
    report.fork_points = _fork_points(report)
    report.roots = sorted((n.at for n in report.nodes.values() if n.parent is None),
                          key=lambda at: (at.branch != MAIN, at.step, at.branch))


def _link_finding(m: Manifest, at: Located, hist: History, known: set[tuple[int, str]],
                  pruned: dict[int, set[str | None]]) -> str | None:
    """What is wrong with a state's parent link; None when it has none, it is stored, or GC pruned it."""
    if m.parent is None:
        return None
    ps, pd = m.parent.step, m.parent.manifest_digest
    if (ps, pd) in known or pd in pruned.get(ps, set()) or None in pruned.get(ps, set()):
        return None
    held = hist.path(at.branch).get(ps)  # the state its branch's lineage holds at that step, if any
    if held is not None:
        return f"parent step {Located(ps, held)} exists with another digest: broken hash chain"
    return f"parent step {ps} is missing and was not pruned by GC: lineage gap"


def _fork_points(report: AuditReport) -> list[ForkPoint]:
    children: dict[str, list[Node]] = {}
    for node in report.nodes.values():
        if node.parent:
            children.setdefault(node.parent[1], []).append(node)
    out = []
    for digest, kids in children.items():
        if len(kids) < 2:
            continue
        parent = report.nodes.get(digest)
        branch = parent.branch if parent is not None else None
        kids.sort(key=lambda n: (n.branch != branch, n.step, n.branch))  # the parent's own branch first
        out.append(ForkPoint(kids[0].parent[0], branch, digest, tuple(n.at for n in kids)))
    return sorted(out, key=lambda f: (f.step, f.digest))


def info_lines(report: AuditReport) -> list[str]:
    """The lineage's shape, for people: where it forks, and any root lineage besides the run's first."""
    lines = []
    for f in report.fork_points:
        where = f"branch {f.branch}" if f.branch is not None else "no longer stored"
        lines.append(f"[info] lineage fork after step {f.step} ({where}): branches "
                     f"{', '.join(c.branch for c in f.children)} start at steps {', '.join(str(c.step) for c in f.children)}")
    for root in report.roots[1:]:
        lines.append(f"[info] lineage: step {root.step} on branch {root.branch} starts another root lineage "
                     f"(no parent; the run's first lineage starts at step {report.roots[0]})")
    return lines


def audit(store: Store, *, verify: bool = True, data: bool = True, progress: Progress | None = None) -> AuditReport:
    """Verify every state of every branch in every persistent tier and the lineage across them;
    ``progress`` counts bytes re-read."""
    report = AuditReport(verified=verify)
    on_bytes = counter(progress, _verify_total(store, data)) if verify and progress is not None else None
    manifests = collect(store, report, verify=verify, data=data, on_bytes=on_bytes)
    check_chain(store, manifests, report)
    _check_linked_branches(store, report)
    return report


def _check_linked_branches(store: Store, report: AuditReport) -> None:
    """A symlink among the local tier's branch folders is never a branch (nothing follows it): an error to remove."""
    local = getattr(store, "local", None)
    if local is None or not hasattr(local, "linked_branches"):
        return
    top = os.path.join(local.config.root, local.run, BRANCHES)
    for name in local.linked_branches():
        path = top if name == BRANCHES else os.path.join(top, name)
        report.problems.append(Problem("local", None, f"{path} is a symlink (to {os.readlink(path)}), not a branch "
                                       "folder: flowcheck lists, deletes and collects nothing through it; remove it",
                                       path))


def lineage(store: Store, *, verify: bool = False, progress: Progress | None = None) -> AuditReport:
    """The lineage tree: manifests and links (``verify``: files too); views are in flowcheck/lineage_view.py."""
    return audit(store, verify=verify, data=False, progress=progress)


def _verify_total(store: Store, data: bool, tiers: list[Tier] | None = None, step: int | None = None) -> int:
    """The bytes ``Tier.verify`` will re-read (of one step, or all), from each tier's own manifest (its files
    differ per tier); a manifest that does not load counts nothing: nothing of its step is re-read."""
    total = 0
    for tier in branch_tiers(store) if tiers is None else tiers:
        for s in tier.steps() if step is None else [step]:
            try:
                total += verify_bytes(tier.manifest(s), data)
            except FlowcheckError:
                pass
    return total


# ---- one state's provenance (flowcheck show) ----------------------------------------
@dataclass(frozen=True)
class Link:
    """One step of a parent chain: its branch and the tiers holding that exact state, or why the chain stops there."""

    step: int
    digest: str
    tiers: tuple[str, ...]
    end: str = ""  # "" (continues) | "root" | "pruned by GC" | a break: "MISSING ..." / "BROKEN ..." / "UNREADABLE ..."
    branch: str = MAIN

    @property
    def at(self) -> Located:
        return Located(self.step, self.branch)


def _held(hist: History, step: int, digest: str) -> tuple[str, tuple[str, ...]] | None:
    """The branch holding exactly this state and the tiers holding it there; None when no tier does."""
    hits = [s for s in hist.states if s.step == step and s.digest == digest]
    if not hits:
        return None
    return hits[0].branch, tuple(dict.fromkeys(s.tier for s in hits if s.branch == hits[0].branch))


def _why_missing(hist: History, pruned: dict[int, set[str | None]], step: int, digest: str, child_branch: str) -> str:
    """Why a parent state is held by no tier: pruned, another state in its place on the lineage, or lost."""
    if digest in pruned.get(step, set()) or None in pruned.get(step, set()):
        return "pruned by GC"
    held = hist.path(child_branch).get(step)
    if held is None:
        return "MISSING: not in any tier and not pruned by GC (lineage gap)"
    other = [f"{place(s.tier, s.branch)}: " + (f"digest {s.digest[7:19]}" if s.digest else "unreadable manifest")
             for s in hist.states if s.step == step and s.branch == held]
    return f"BROKEN hash chain: parent digest {digest[7:19]}, tiers hold {'; '.join(other)}"


def parent_chain(store: Store, manifest: Manifest) -> list[Link]:
    """Follow ``parent`` links from ``manifest`` back to the first state, across branches (a branch's first
    state names its fork point on the parent branch), or to where the chain breaks."""
    hist, pruned = store.history(), pruned_states(store)
    m, step, digest = manifest, manifest.step, manifest.digest()
    branch, tiers = _held(hist, step, digest) or (MAIN, ())
    links: list[Link] = []
    while m.parent is not None:
        links.append(Link(step, digest, tiers, "", branch))
        child_branch, step, digest = branch, m.parent.step, m.parent.manifest_digest
        if any(link.digest == digest for link in links):
            return links + [Link(step, digest, (), "BROKEN: the chain loops")]
        held = _held(hist, step, digest)
        if held is None:
            return links + [Link(step, digest, (), _why_missing(hist, pruned, step, digest, child_branch))]
        branch, tiers = held
        try:
            m = store.tier(tiers[0], branch).manifest(step)
        except FlowcheckError as e:
            return links + [Link(step, digest, tiers, f"UNREADABLE manifest: {e}", branch)]
    return links + [Link(step, digest, tiers, "root", branch)]


def format_chain(links: list[Link], *, keep: int = 12) -> str:
    """``step 40@b10-30 [local,object] <- 30@b10-30 [local] <- 10 [object] (root)``; long chains keep both ends."""
    def one(link: Link) -> str:
        where = f" [{','.join(link.tiers)}]" if link.tiers else ""
        return f"{link.at}{where}{f' ({link.end})' if link.end else ''}"

    parts = [one(link) for link in links]
    if len(parts) > 2 * keep:
        parts = parts[:keep] + [f"... {len(parts) - 2 * keep} more ..."] + parts[-keep:]
    return "step " + " <- ".join(parts)


@dataclass(frozen=True)
class StepCheck:
    """What `show` prints of one state's verification: ``ok`` is False on any damage or disagreement."""

    ok: bool
    status: str
    lines: list[str]


def step_checks(store: Store, manifest: Manifest, *, data: bool, branch: str = MAIN,
                progress: Progress | None = None) -> StepCheck:
    """Verify one state (``manifest``, on ``branch``) in every tier holding it: overall status, one line per tier.

    Always: the manifest re-read (integrity), its signature, and that every tier holds the same
    state (manifest digest).  With ``data``: every file's size and digest and every shard's data digest.
    """
    digest, lines, bad = manifest.digest(), [], False
    tiers = [store.tier(t.name, branch) for t in store.tiers(include_memory=False)]
    holders = [t for t in tiers if manifest.step in t.steps()]
    on_bytes = counter(progress, _verify_total(store, True, holders, manifest.step)) if data else None
    for tier in holders:
        problems: list[Problem] = []
        try:
            m = tier.manifest(manifest.step, fresh=True)
        except FlowcheckError as e:
            lines.append(f"{tier.name}: FAILED {e}")
            bad = True
            continue
        checks = ["manifest integrity ok"]
        checks.append("same digest" if m.digest() == digest else f"OTHER digest {m.digest()[7:19]}")
        if m.signature is None:
            checks.append("unsigned")
        elif tier.signing_key is None:
            checks.append("signed, no key set to check it ($FLOWCHECK_HMAC_KEY)")
        else:
            checks.append("signature valid")
        if data:
            problems = tier.verify(manifest.step, data=True, on_bytes=on_bytes)
            checks.append("files and shard data ok" if not problems else "; ".join(p.what for p in problems))
        bad = bad or m.digest() != digest or bool(problems)
        lines.append(f"{tier.name}: {'FAILED ' if problems else ''}{', '.join(checks)}")
    if bad:
        status = "FAILED (see the tiers below; `flowcheck audit` for the whole store)"
    elif data:
        status = "verified: manifests, files and shard data"
    else:
        status = "manifests verified; files and data not re-read (add --verify)"
    return StepCheck(not bad, status, lines)
