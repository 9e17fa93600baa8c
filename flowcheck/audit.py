"""Audit and lineage: verify every stored step and walk the hash chain across tiers.

Every manifest in every persistent tier is loaded (integrity, signature),
every file's size and digest and every shard's data digest checked, and every
``parent`` link resolved against the manifests of all tiers and the pruning
records GC leaves.  Findings are Problems; any error makes the audit fail.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowcheck.errors import FlowcheckError, ManifestError, StepNotFoundError
from flowcheck.manifest import Manifest
from flowcheck.progress import Progress, counter
from flowcheck.store import Store
from flowcheck.tiers.base import Problem, verify_bytes


@dataclass
class Node:
    """One distinct step state (by manifest digest) and the tiers holding it."""

    step: int
    digest: str
    parent: tuple[int, str] | None
    source: str
    created_at: str
    tiers: list[str] = field(default_factory=list)
    ok: bool = True


@dataclass
class AuditReport:
    problems: list[Problem] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)  # manifest digest -> node
    forks: list[tuple[int, list[int]]] = field(default_factory=list)  # parent step -> child steps
    checked_steps: int = 0
    verified: bool = False  # files were checked (audit), not only manifests and links (lineage)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)


def collect(store: Store, report: AuditReport, *, verify: bool, data: bool,
            on_bytes: Callable[[int], None] | None = None) -> dict[tuple[str, int], Manifest]:
    manifests: dict[tuple[str, int], Manifest] = {}
    for tier in store.tiers(include_memory=False):
        for name in tier.incomplete():
            report.problems.append(Problem(tier.name, None, "incomplete write (not visible; GC removes it)", name, "warning"))
        for step in tier.steps():
            report.checked_steps += 1
            try:
                m = tier.manifest(step)
            except (ManifestError, StepNotFoundError) as e:
                report.problems.append(Problem(tier.name, step, str(e), "manifest.json"))
                continue
            manifests[(tier.name, step)] = m
            if m.signature is None and tier.signing_key is not None:
                # accepted (signing.required is off) but worth a look: a stripped signature reads like this
                report.problems.append(Problem(tier.name, step, "unsigned manifest while a signing key is set; "
                                               "set signing.required: true to refuse unsigned steps", "manifest.json", "warning"))
            if verify:
                report.problems.extend(tier.verify(step, data=data, on_bytes=on_bytes))
            node = report.nodes.setdefault(m.digest(), Node(
                step, m.digest(), (m.parent.step, m.parent.manifest_digest) if m.parent else None,
                m.producer.source, m.created_at))
            node.tiers.append(tier.name)
    for p in report.problems:
        for node in report.nodes.values():
            if p.severity == "error" and p.step == node.step and p.tier in node.tiers:
                node.ok = False
    return manifests


def part_aliases(manifests: dict[tuple[str, int], Manifest]) -> dict[str, str]:
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
        whole.ok = whole.ok and part.ok


def check_chain(store: Store, manifests: dict[tuple[str, int], Manifest], report: AuditReport) -> None:
    aliases = part_aliases(manifests)
    digests_at: dict[int, set[str]] = {}
    for (_tier, step), m in manifests.items():
        digests_at.setdefault(step, set()).add(aliases.get(m.digest(), m.digest()))
    known_at = {step: set(d) for step, d in digests_at.items()}  # parent links may name a part (a node's own chain)
    for (_tier, step), m in manifests.items():
        known_at[step].update(ref.manifest_digest for ref in m.nodes)
    pruned: dict[int, set[str | None]] = {}
    for tier in store.tiers(include_memory=False):
        for step, digest in tier.pruned().items():
            pruned.setdefault(step, set()).add(digest)
    for step, digests in sorted(digests_at.items()):
        if len(digests) > 1:
            holders = sorted(t for (t, s) in manifests if s == step)
            report.problems.append(Problem("lineage", step, f"tiers {holders} hold different states under one step number"))
    for (tier, step), m in sorted(manifests.items(), key=lambda kv: kv[0][1]):
        if m.parent is None:
            continue
        ps, pd = m.parent.step, m.parent.manifest_digest
        if pd in known_at.get(ps, set()):
            continue
        if pd in pruned.get(ps, set()) or None in pruned.get(ps, set()):
            continue  # parent deleted on purpose by retention
        what = (f"parent step {ps} exists with another digest: broken hash chain" if ps in digests_at
                else f"parent step {ps} is missing and was not pruned by GC: lineage gap")
        report.problems.append(Problem(tier, step, what))
    merge_parts(report, aliases)
    children: dict[str, list[int]] = {}
    for node in report.nodes.values():
        if node.parent:
            children.setdefault(node.parent[1], []).append(node.step)
    for parent_digest, steps in children.items():
        if len(steps) > 1:
            parent_step = report.nodes[parent_digest].step if parent_digest in report.nodes else -1
            report.forks.append((parent_step, sorted(steps)))


def audit(store: Store, *, verify: bool = True, data: bool = True, progress: Progress | None = None) -> AuditReport:
    """Verify every step in every persistent tier and the lineage across them; ``progress`` counts bytes re-read."""
    report = AuditReport(verified=verify)
    on_bytes = counter(progress, _verify_total(store, data)) if verify and progress is not None else None
    manifests = collect(store, report, verify=verify, data=data, on_bytes=on_bytes)
    check_chain(store, manifests, report)
    return report


def _verify_total(store: Store, data: bool, tiers: list | None = None, step: int | None = None) -> int:
    """The bytes ``Tier.verify`` will re-read (of one step, or all), from each tier's own manifest (its files
    differ per tier); a manifest that does not load counts nothing: nothing of its step is re-read."""
    total = 0
    for tier in store.tiers(include_memory=False) if tiers is None else tiers:
        for s in tier.steps() if step is None else [step]:
            try:
                total += verify_bytes(tier.manifest(s), data)
            except FlowcheckError:
                pass
    return total


# ---- lineage views ---------------------------------------------------------------
def lineage(store: Store, *, verify: bool = False, progress: Progress | None = None) -> AuditReport:
    return audit(store, verify=verify, data=False, progress=progress)


class RendererNotFoundError(FlowcheckError, FileNotFoundError):
    """An external renderer (Graphviz's ``dot``) is not installed."""


STATUS_COLOURS = {"verified": "palegreen", "warning": "khaki1", "damaged": "salmon", "unverified": "grey85"}


def node_problems(report: AuditReport, node: Node) -> list[Problem]:
    """Findings about this state: in a tier holding it, or about its step number across tiers."""
    return [p for p in report.problems if p.step == node.step and (p.tier in node.tiers or p.tier == "lineage")]


def node_status(report: AuditReport, node: Node) -> str:
    """verified | warning | damaged | unverified — the colour a view gives this state.

    A state whose own bytes fail is damaged; one whose bytes pass but whose link (parent gap,
    broken chain, two states under one step number) or tier raised a finding is a warning;
    a lineage-only report (manifests and links, no file digests) leaves healthy states unverified.
    """
    if not node.ok:
        return "damaged"
    if node_problems(report, node):
        return "warning"
    return "verified" if report.verified else "unverified"


def _children(report: AuditReport) -> dict[str, list[Node]]:
    out: dict[str, list[Node]] = {}
    for n in report.nodes.values():
        if n.parent:
            out.setdefault(n.parent[1], []).append(n)
    return out


def to_json(report: AuditReport) -> dict[str, Any]:
    children = _children(report)
    return {
        "verified": report.verified,
        "nodes": [
            {"step": n.step, "manifest_digest": n.digest, "parent": {"step": n.parent[0], "manifest_digest": n.parent[1]} if n.parent else None,
             "source": n.source, "created_at": n.created_at, "tiers": sorted(n.tiers), "ok": n.ok,
             "status": node_status(report, n), "children": sorted(c.step for c in children.get(n.digest, []))}
            for n in sorted(report.nodes.values(), key=lambda n: n.step)
        ],
        "forks": [{"parent_step": p, "children": c} for p, c in report.forks],
        "problems": [str(p) for p in report.problems],
    }


def to_text(report: AuditReport) -> str:
    by_parent: dict[str | None, list[Node]] = {}
    for n in report.nodes.values():
        key = n.parent[1] if n.parent and n.parent[1] in report.nodes else None
        by_parent.setdefault(key, []).append(n)
    lines: list[str] = []

    def walk(key: str | None, depth: int) -> None:
        for n in sorted(by_parent.get(key, []), key=lambda n: n.step):
            fork = " (fork)" if len(by_parent.get(key, [])) > 1 and key is not None else ""
            status = "ok" if n.ok else "DAMAGED"
            lines.append(f"{'  ' * depth}step {n.step} [{','.join(sorted(n.tiers))}] {n.source} {status} {n.digest[7:19]}{fork}")
            walk(n.digest, depth + 1)

    walk(None, 0)
    return "\n".join(lines) if lines else "(no committed steps)"


def _dot_str(text: str) -> str:
    """A quoted DOT string; newlines become DOT's line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _missing_parent_label(report: AuditReport, node: Node) -> str:
    """Why a parent is not drawn: the chain check names gaps and broken links; otherwise GC pruned it."""
    whats = " ".join(p.what for p in node_problems(report, node))
    if "broken hash chain" in whats:
        return "exists with another digest\n(broken hash chain)"
    if "lineage gap" in whats:
        return "missing\n(lineage gap)"
    return "pruned by GC"


def to_dot(report: AuditReport) -> str:
    """Graphviz source: one box per state (step, source, tiers, digest prefix), filled by audit status,
    edges parent -> child; the edges out of a fork point are bold, so each branch reads as one."""
    out = ["digraph lineage {", "  rankdir=LR;", '  node [shape=box, style=filled, fontname="monospace"];',
           '  labelloc=b; fontsize=10; fontname="monospace";',
           "  label=" + _dot_str("fill: green verified, yellow warning, red damaged, grey unverified (lineage --verify checks files)") + ";"]
    children = _children(report)
    for n in sorted(report.nodes.values(), key=lambda n: n.step):
        status = node_status(report, n)
        label = f"step {n.step}\n{n.source}\n{','.join(sorted(n.tiers))}\n{n.digest[7:19]}"
        tooltip = "; ".join(str(p) for p in node_problems(report, n)) or status
        out.append(f"  {_dot_str(n.digest)} [label={_dot_str(label)}, fillcolor={STATUS_COLOURS[status]}, tooltip={_dot_str(tooltip)}];")
    missing: dict[str, str] = {}
    for n in sorted(report.nodes.values(), key=lambda n: n.step):
        if not n.parent:
            continue
        parent_step, parent_digest = n.parent
        if parent_digest not in report.nodes and parent_digest not in missing:
            missing[parent_digest] = f"step {parent_step}\n{_missing_parent_label(report, n)}"
            out.append(f"  {_dot_str(parent_digest)} [label={_dot_str(missing[parent_digest])}, style=dashed, fillcolor=white];")
        fork = len(children.get(parent_digest, [])) > 1
        attrs = ' [penwidth=2.5, color="#1f4e9c"]' if fork else (" [style=dashed]" if parent_digest in missing else "")
        out.append(f"  {_dot_str(parent_digest)} -> {_dot_str(n.digest)}{attrs};")
    out.append("}")
    return "\n".join(out)


def render_png(dot_source: str, out: str) -> None:
    """Render DOT to a PNG file with Graphviz's ``dot`` (written next to ``out``, then renamed)."""
    exe = shutil.which("dot")
    if exe is None:
        raise RendererNotFoundError(
            "--format png: expected Graphviz's `dot` on PATH, found none; install the Debian package "
            "`graphviz` (apt-get install graphviz), or write --format dot and render it elsewhere")
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        proc = subprocess.run([exe, "-Tpng", "-o", tmp], check=False, input=dot_source.encode(), capture_output=True, timeout=300)
        if proc.returncode != 0:
            raise FlowcheckError(f"--format png: `dot -Tpng` exited {proc.returncode}: {proc.stderr.decode(errors='replace').strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---- one step's provenance (flowcheck show) ----------------------------------------
@dataclass(frozen=True)
class Link:
    """One step of a parent chain: the tiers holding that exact state, or why the chain stops there."""

    step: int
    digest: str
    tiers: tuple[str, ...]
    end: str = ""  # "" (continues) | "root" | "pruned by GC" | a break: "MISSING ..." / "BROKEN ..." / "UNREADABLE ..."


def _holders(store: Store, step: int, digest: str) -> tuple[tuple[str, ...], Manifest | None, list[str]]:
    """Tiers holding ``step`` with exactly ``digest``, one of their manifests, and what the others hold instead."""
    holders, found, other = [], None, []
    for tier in store.tiers(include_memory=False):
        if step not in tier.steps():
            continue
        try:
            m = tier.manifest(step)
        except FlowcheckError as e:
            other.append(f"{tier.name}: unreadable manifest ({e})")
            continue
        if m.digest() == digest:
            holders.append(tier.name)
            found = found or m
        else:
            other.append(f"{tier.name}: digest {m.digest()[7:19]}")
    return tuple(holders), found, other


def parent_chain(store: Store, manifest: Manifest) -> list[Link]:
    """Follow ``parent`` links from ``manifest`` back to the first step, or to where the chain breaks."""
    pruned: dict[int, set[str | None]] = {}
    for tier in store.tiers(include_memory=False):
        for step, digest in tier.pruned().items():
            pruned.setdefault(step, set()).add(digest)
    links: list[Link] = []
    m: Manifest | None = manifest
    step, digest = manifest.step, manifest.digest()
    tiers = _holders(store, step, digest)[0]
    while m is not None:
        if m.parent is None:
            links.append(Link(step, digest, tiers, "root"))
            break
        links.append(Link(step, digest, tiers))
        step, digest = m.parent.step, m.parent.manifest_digest
        if any(link.digest == digest for link in links):
            links.append(Link(step, digest, (), "BROKEN: the chain loops"))
            break
        tiers, m, other = _holders(store, step, digest)
        if m is None:
            if digest in pruned.get(step, set()) or None in pruned.get(step, set()):
                end = "pruned by GC"
            elif other:
                end = f"BROKEN hash chain: parent digest {digest[7:19]}, tiers hold {'; '.join(other)}"
            else:
                end = "MISSING: not in any tier and not pruned by GC (lineage gap)"
            links.append(Link(step, digest, (), end))
    return links


def format_chain(links: list[Link], *, keep: int = 12) -> str:
    """``step 40 [local,object] <- 30 [local] <- 10 [object] (root)``; long chains keep both ends."""
    def one(link: Link) -> str:
        where = f" [{','.join(link.tiers)}]" if link.tiers else ""
        return f"{link.step}{where}{f' ({link.end})' if link.end else ''}"

    parts = [one(link) for link in links]
    if len(parts) > 2 * keep:
        parts = parts[:keep] + [f"... {len(parts) - 2 * keep} more ..."] + parts[-keep:]
    return "step " + " <- ".join(parts)


def step_checks(store: Store, manifest: Manifest, *, data: bool, progress: Progress | None = None) -> tuple[str, list[str]]:
    """Verify one step in every tier holding it: (overall status, one line per tier).

    Always: the manifest re-read (integrity), its signature, and that every tier holds the same
    state (manifest digest).  With ``data``: every file's size and digest and every shard's data digest.
    """
    digest, lines, bad = manifest.digest(), [], False
    holders = [t for t in store.tiers(include_memory=False) if manifest.step in t.steps()]
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
    return status, lines


def dumps(report: AuditReport, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(to_json(report), indent=2)
    if fmt == "dot":
        return to_dot(report)
    return to_text(report)
