"""Audit and lineage: verify every stored step and walk the hash chain across tiers.

Every manifest in every persistent tier is loaded (integrity, signature),
every file's size and digest and every shard's data digest checked, and every
``parent`` link resolved against the manifests of all tiers and the pruning
records GC leaves.  Findings are Problems; any error makes the audit fail.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flowcheck.errors import ManifestError, StepNotFoundError
from flowcheck.manifest import Manifest
from flowcheck.store import Store
from flowcheck.tiers.base import Problem


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

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)


def collect(store: Store, report: AuditReport, *, verify: bool, data: bool) -> dict[tuple[str, int], Manifest]:
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
            if verify:
                report.problems.extend(tier.verify(step, data=data))
            node = report.nodes.setdefault(m.digest(), Node(
                step, m.digest(), (m.parent.step, m.parent.manifest_digest) if m.parent else None,
                m.producer.source, m.created_at))
            node.tiers.append(tier.name)
    for p in report.problems:
        for node in report.nodes.values():
            if p.severity == "error" and p.step == node.step and p.tier in node.tiers:
                node.ok = False
    return manifests


def check_chain(store: Store, manifests: dict[tuple[str, int], Manifest], report: AuditReport) -> None:
    digests_at: dict[int, set[str]] = {}
    for (_tier, step), m in manifests.items():
        digests_at.setdefault(step, set()).add(m.digest())
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
        if pd in digests_at.get(ps, set()):
            continue
        if pd in pruned.get(ps, set()) or None in pruned.get(ps, set()):
            continue  # parent deleted on purpose by retention
        what = (f"parent step {ps} exists with another digest: broken hash chain" if ps in digests_at
                else f"parent step {ps} is missing and was not pruned by GC: lineage gap")
        report.problems.append(Problem(tier, step, what))
    children: dict[str, list[int]] = {}
    for node in report.nodes.values():
        if node.parent:
            children.setdefault(node.parent[1], []).append(node.step)
    for parent_digest, steps in children.items():
        if len(steps) > 1:
            parent_step = report.nodes[parent_digest].step if parent_digest in report.nodes else -1
            report.forks.append((parent_step, sorted(steps)))


def audit(store: Store, *, verify: bool = True, data: bool = True) -> AuditReport:
    """Verify every step in every persistent tier and the lineage across them."""
    report = AuditReport()
    manifests = collect(store, report, verify=verify, data=data)
    check_chain(store, manifests, report)
    return report


# ---- lineage views ---------------------------------------------------------------
def lineage(store: Store, *, verify: bool = False) -> AuditReport:
    return audit(store, verify=verify, data=False)


def to_json(report: AuditReport) -> dict[str, Any]:
    return {
        "nodes": [
            {"step": n.step, "manifest_digest": n.digest, "parent": {"step": n.parent[0], "manifest_digest": n.parent[1]} if n.parent else None,
             "source": n.source, "created_at": n.created_at, "tiers": sorted(n.tiers), "ok": n.ok}
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


def to_dot(report: AuditReport) -> str:
    out = ["digraph lineage {", "  rankdir=LR;", '  node [shape=box, style=filled, fontname="monospace"];']
    for n in sorted(report.nodes.values(), key=lambda n: n.step):
        colour = "palegreen" if n.ok else "salmon"
        label = f"step {n.step}\\n{','.join(sorted(n.tiers))}\\n{n.digest[7:19]}"
        out.append(f'  "{n.digest}" [label="{label}", fillcolor={colour}];')
    for n in report.nodes.values():
        if n.parent and n.parent[1] in report.nodes:
            out.append(f'  "{n.parent[1]}" -> "{n.digest}";')
    out.append("}")
    return "\n".join(out)


def dumps(report: AuditReport, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(to_json(report), indent=2)
    if fmt == "dot":
        return to_dot(report)
    return to_text(report)
