"""Views of the lineage tree an audit builds: text, JSON, Graphviz DOT and PNG, with branches and forks drawn.

A node is one state (step, branch, source, tiers holding it); a state on a branch
other than main is labelled ``step@branch`` (``30@b10-30``), as everywhere in flowcheck.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

from flowcheck.audit import AuditReport, Node, place
from flowcheck.branches import MAIN
from flowcheck.errors import FlowcheckError
from flowcheck.tiers.base import Problem


class RendererNotFoundError(FlowcheckError, FileNotFoundError):
    """An external renderer (Graphviz's ``dot``) is not installed."""


STATUS_COLOURS = {"verified": "palegreen", "warning": "khaki1", "damaged": "salmon", "unverified": "grey85"}


def node_problems(report: AuditReport, node: Node) -> list[Problem]:
    """Findings about this state: in a tier holding it, or about its step number on its branch across tiers."""
    return [p for p in report.problems
            if p.step == node.step and (p.tier in node.places or p.tier == place("lineage", node.branch))]


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


def _children(report: AuditReport) -> dict[str | None, list[Node]]:
    """Parent digest -> its stored children, the parent's own branch first; None -> the drawn roots
    (states without a parent, or whose parent is not stored)."""
    out: dict[str | None, list[Node]] = {}
    for n in report.nodes.values():
        key = n.parent[1] if n.parent and n.parent[1] in report.nodes else None
        out.setdefault(key, []).append(n)
    for key, kids in out.items():
        branch = report.nodes[key].branch if key is not None else MAIN
        kids.sort(key=lambda n: (n.branch != branch, n.step, n.branch))
    return out


def to_json(report: AuditReport) -> dict[str, Any]:
    children = _children(report)
    return {
        "verified": report.verified,
        "nodes": [
            {"step": n.step, "branch": n.branch, "manifest_digest": n.digest,
             "parent": {"step": n.parent[0], "manifest_digest": n.parent[1]} if n.parent else None,
             "source": n.source, "created_at": n.created_at, "tiers": sorted(n.tiers), "ok": n.ok,
             "status": node_status(report, n), "children": sorted(c.step for c in children.get(n.digest, []))}
            for n in sorted(report.nodes.values(), key=lambda n: (n.step, n.branch))
        ],
        "forks": [{"parent_step": p, "children": c} for p, c in report.forks],
        "roots": [str(r) for r in report.roots],  # the run's first lineage, then any other (a branch of its own)
        "problems": [str(p) for p in report.problems],
    }


def _text_line(report: AuditReport, n: Node, fork: bool) -> str:
    status = "ok" if n.ok else "DAMAGED"
    gap = "" if n.parent is None or n.parent[1] in report.nodes else \
        f" (parent step {n.parent[0]}: {_missing_parent_label(report, n).replace(chr(10), ' ')})"
    return f"step {n.at} [{','.join(sorted(n.tiers))}] {n.source} {status} {n.digest[7:19]}{' (fork)' if fork else ''}{gap}"


def to_text(report: AuditReport) -> str:
    """One line per state; a lineage goes straight down, and at a fork each branch hangs off ``├─``/``└─``."""
    children = _children(report)
    lines: list[str] = []
    stack = [(n, "", "", False) for n in reversed(children.get(None, []))]  # (node, lead, indent of its line, fork)
    while stack:  # not recursive: a run's lineage is thousands of states deep
        node, lead, indent, fork = stack.pop()
        lines.append(f"{lead}{_text_line(report, node, fork)}")
        kids = children.get(node.digest, [])
        if len(kids) == 1:
            stack.append((kids[0], indent, indent, False))
            continue
        for i in reversed(range(len(kids))):
            last = i == len(kids) - 1
            stack.append((kids[i], indent + ("└─ " if last else "├─ "), indent + ("   " if last else "│  "), True))
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


def _dot_node(report: AuditReport, n: Node) -> str:
    status = node_status(report, n)
    label = f"step {n.at}\n{n.source}\n{','.join(sorted(n.tiers))}\n{n.digest[7:19]}"
    tooltip = "; ".join(str(p) for p in node_problems(report, n)) or status
    return f"{_dot_str(n.digest)} [label={_dot_str(label)}, fillcolor={STATUS_COLOURS[status]}, tooltip={_dot_str(tooltip)}];"


def _dot_nodes(report: AuditReport) -> list[str]:
    """Main's states at the top level; each other branch's states in a dashed box named after the branch."""
    by_branch: dict[str, list[Node]] = {}
    for n in sorted(report.nodes.values(), key=lambda n: n.step):
        by_branch.setdefault(n.branch, []).append(n)
    out = [f"  {_dot_node(report, n)}" for n in by_branch.pop(MAIN, [])]
    for branch, nodes in sorted(by_branch.items()):
        out.append(f"  subgraph {_dot_str('cluster_' + branch)} {{")
        out.append(f"    label={_dot_str('branch ' + branch)}; style=dashed; color=\"#1f4e9c\";")
        out.extend(f"    {_dot_node(report, n)}" for n in nodes)
        out.append("  }")
    return out


def to_dot(report: AuditReport) -> str:
    """Graphviz source: one box per state (step@branch, source, tiers, digest prefix), filled by audit status,
    edges parent -> child; each branch but main is a dashed box, and the edges out of a fork point are bold."""
    out = ["digraph lineage {", "  rankdir=LR;", '  node [shape=box, style=filled, fontname="monospace"];',
           '  labelloc=b; fontsize=10; fontname="monospace";',
           "  label=" + _dot_str("fill: green verified, yellow warning, red damaged, grey unverified (lineage --verify checks files)") + ";"]
    out.extend(_dot_nodes(report))
    forks = {f.digest for f in report.fork_points}
    missing: dict[str, str] = {}
    for n in sorted(report.nodes.values(), key=lambda n: (n.step, n.branch)):
        if not n.parent:
            continue
        parent_step, parent_digest = n.parent
        if parent_digest not in report.nodes and parent_digest not in missing:
            missing[parent_digest] = f"step {parent_step}\n{_missing_parent_label(report, n)}"
            out.append(f"  {_dot_str(parent_digest)} [label={_dot_str(missing[parent_digest])}, style=dashed, fillcolor=white];")
        attrs = ' [penwidth=2.5, color="#1f4e9c"]' if parent_digest in forks else (" [style=dashed]" if parent_digest in missing else "")
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


def dumps(report: AuditReport, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(to_json(report), indent=2)
    if fmt == "dot":
        return to_dot(report)
    return to_text(report)
