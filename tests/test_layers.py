"""The folder tree is the import tree: layers bottom up, nothing imports upward, no import circle.

    value model (errors, digest, dtypes, state, manifest, branches, config, logs, progress, version)
    -> tiers/ -> store, pruning, audit, policy, ... -> capture/, torch/, dcp/, node/, restore/, ... -> cli/, demo/

Every import counts, also those inside functions and under TYPE_CHECKING: a lazy import is still a dependency.
The walk reads the source with ``ast`` over the installed package names (``flowcheck``, ``flowcheck.tiers`` from
tiers/, ``flowcheck.restore`` from restore/).
"""
from __future__ import annotations

import ast
import importlib
import os

import pytest

VALUE_MODEL = {"errors", "digest", "dtypes", "state", "manifest", "branches", "config", "logs", "progress", "version"}
STORE = {"store", "pruning", "audit", "policy", "tier_check", "identity", "lineage_view", "evidence", "plan",
         "listing"}
SERVICES = {"capture", "torch", "dcp", "node", "restore", "simulate"}
FRONT = {"cli", "demo", "__main__"}
EXTENSIONS = {"_native", "_mirror"}  # compiled: no imports of their own


def layer(module: str) -> int:
    """0 value model, 1 tiers, 2 store, 3 services, 4 front ends (the package's own facade included)."""
    if module == "flowcheck":
        return 4
    top = module.split(".")[1]
    for rank, names in enumerate((VALUE_MODEL, {"tiers"}, STORE, SERVICES, FRONT)):
        if top in names:
            return rank
    raise AssertionError(f"{module}: in no layer; add it to one in tests/test_layers.py")


def modules() -> dict[str, str]:
    """Module name -> source file, for every module of the three installed packages."""
    out = {}
    for package in ("flowcheck", "flowcheck.tiers", "flowcheck.restore"):
        (root,) = importlib.import_module(package).__path__
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.exists(os.path.join(folder, d, "__init__.py"))]
            rel = os.path.relpath(folder, root)
            parts = [] if rel == "." else rel.split(os.sep)
            for f in files:
                if f.endswith(".py"):
                    out[".".join([package, *parts, *([] if f == "__init__.py" else [f[:-3]])])] = os.path.join(folder, f)
    return out


def imports(name: str, path: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(here + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            found |= subs & known
            if any(s not in known and s.rsplit(".", 1)[1] not in EXTENSIONS for s in subs):
                found.add(base)
    out = set()
    for m in found:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != name:
            out.add(m)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_module_imports_a_layer_above_its_own(graph):
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
              for a in sorted(graph) for b in sorted(graph[a]) if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_there_is_no_import_circle(graph):
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_the_walk_sees_what_it_checks(graph):
    """A walk that finds nothing proves nothing: the known edges are there."""
    assert "flowcheck.tiers.base" in graph["flowcheck.tiers.local"]
    assert "flowcheck.store" in graph["flowcheck.cli.steps"] or any(
        "flowcheck.store" in graph[m] for m in graph if m.startswith("flowcheck.cli"))
    assert len(graph) > 120
