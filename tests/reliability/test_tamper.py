"""Tamper evidence: every single-bit flip in a committed step is caught by audit; signed manifests
refuse unsigned and forged copies; stored names cannot escape the store root; nothing is unpickled.

Figures print with ``pytest -s``: bit flips detected / injected, per tier.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import pickle
import random
from collections import Counter
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flowcheck.audit import audit
from flowcheck.cli import main
from flowcheck.config import Config, LocalConfig, ObjectConfig, SigningConfig, TiersConfig
from flowcheck.errors import FlowcheckError, ManifestError
from flowcheck.manifest import canonical_json, parse
from flowcheck.store import Store
from tests.helpers import make_snapshot, read_raw, write_raw

ROOT = Path(__file__).resolve().parents[2]
FLIPS = int(os.environ.get("FLOWCHECK_TAMPER_FLIPS", "600"))
KEY = "fuzz-hmac-key-0123456789abcdef"


def _store(tmp_path, *, required: bool = False) -> Store:
    cfg = Config(
        run="r1",
        tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / "local")),
                          object=ObjectConfig(url=f"file://{tmp_path / 'object'}", max_file_mib=1)),
        signing=SigningConfig(required=required),
    )
    return Store(cfg)


def _committed(tmp_path, **kw) -> Store:
    store = _store(tmp_path, **kw)
    store.push(make_snapshot(step=10))
    store.snapshot()
    store.promote(10)
    return store


def _step_files(store: Store) -> list[tuple[str, str, Path]]:
    """(tier, path relative to the run root, absolute path) of every file of step 10 in both tiers."""
    out = []
    for tier in (store.local, store.object):
        run_root = Path(tier.root.removeprefix("file://"))
        for path in sorted((run_root / "step-000000010").rglob("*")):
            if path.is_file():
                out.append((tier.name, str(path.relative_to(run_root)), path))
    return out


def test_every_single_bit_flip_in_a_committed_step_is_caught_by_audit(tmp_path):
    store = _committed(tmp_path)
    files = _step_files(store)
    # local: manifest, group and pack metadata, pack shard files (packed layout); object: manifest, safetensors
    assert {t for t, _, _ in files} == {"local", "object"} and len(files) >= 10
    rng = random.Random(20240607)
    injected, detected, missed = Counter(), Counter(), []
    # every file gets flips, the first bytes (headers, JSON keys) get their share, the rest is spread by size
    plan = [(f, rng.randrange(min(f[2].stat().st_size, 64)) * 8 + rng.randrange(8)) for f in files for _ in range(4)]
    while len(plan) < FLIPS:
        tier = rng.choice(["local", "object"])  # both tiers get their share, whatever their file count
        f = rng.choice([f for f in files if f[0] == tier])
        plan.append((f, rng.randrange(f[2].stat().st_size * 8)))
    for (tier, rel, path), bit in plan:
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(flipped))
        try:
            store.object._headers.clear()
            report = audit(store)
            named = " ".join(str(p) for p in report.problems if p.severity == "error")
            injected[tier] += 1
            if not report.ok and (rel in named or os.path.basename(rel) == "manifest.json" and "manifest.json" in named):
                detected[tier] += 1
            else:
                missed.append((tier, rel, bit, named))
        finally:
            path.write_bytes(original)
    store.object._headers.clear()
    assert audit(store).ok
    print(f"\nbit flips detected / injected: local {detected['local']}/{injected['local']}, "
          f"object {detected['object']}/{injected['object']}, files {len(files)}")
    assert sum(injected.values()) >= 500
    assert not missed, missed[:5]


# ---- signed manifests --------------------------------------------------------------------------
def _rewrite_manifest(tier, fn) -> None:
    rel = "step-000000010/manifest.json"
    m = parse(read_raw(tier, rel), "test")
    write_raw(tier, rel, fn(m).to_bytes())
    tier._manifest_cache.clear()


UNSIGNED = ("unsigned", lambda m: dataclasses.replace(m, signature=None))
FORGED = ("forged", lambda m: dataclasses.replace(m, scalars={**m.scalars, "optimizer_step": 999}))
WRONG_KEY = ("wrong key", lambda m: dataclasses.replace(m, signature=None).signed(b"not-the-key-0123456789"))


@pytest.mark.parametrize("kind,edit", [UNSIGNED, FORGED, WRONG_KEY], ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("tier_name", ["local", "object"])
def test_with_signing_required_an_unsigned_or_forged_manifest_is_refused_and_audited(tmp_path, monkeypatch, kind, edit, tier_name):
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", KEY)
    store = _committed(tmp_path, required=True)
    tier = getattr(store, tier_name)
    assert tier.manifest(10).signature_valid(KEY.encode())
    _rewrite_manifest(tier, edit)
    with pytest.raises(ManifestError, match="signature"):
        tier.manifest(10)
    with pytest.raises(ManifestError, match="signature"):
        store.read(10, next(iter(tier.manifest(10, check_signature=False).tensors)), prefer=tier_name)
    report = audit(store)
    assert not report.ok and any("signature" in p.what and p.tier == tier_name for p in report.problems), report.problems
    cfg = tmp_path / "fc.yaml"
    cfg.write_text(yaml.safe_dump({"run": "r1", "signing": {"required": True}, "tiers": {
        "local": {"root": str(tmp_path / "local")}, "object": {"url": f"file://{tmp_path / 'object'}", "max_file_mib": 1}}}))
    res = CliRunner().invoke(main, ["--no-progress", "audit", "--config", str(cfg)])
    assert res.exit_code == 1 and "signature" in res.output, res.output
    res = CliRunner().invoke(main, ["--no-progress", "restore", "--config", str(cfg), "--step", "10", "--from", tier_name,
                                    "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "signature" in res.output, res.output


@pytest.mark.parametrize("kind,edit", [FORGED, WRONG_KEY], ids=lambda v: v if isinstance(v, str) else "")
def test_with_a_key_set_a_forged_manifest_is_refused_even_when_signing_is_optional(tmp_path, monkeypatch, kind, edit):
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", KEY)
    store = _committed(tmp_path)
    _rewrite_manifest(store.local, edit)
    with pytest.raises(ManifestError, match="signature"):
        store.local.manifest(10)
    assert not audit(store).ok


def test_with_a_key_set_an_unsigned_manifest_is_flagged_by_audit(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", KEY)
    store = _committed(tmp_path)
    _rewrite_manifest(store.local, UNSIGNED[1])
    report = audit(store)
    flagged = [p for p in report.problems if "unsigned" in p.what and p.tier == "local"]
    assert flagged, report.problems  # a warning: signing.required is off, so the step still reads


# ---- names and paths never escape the store root ----------------------------------------------------
ESCAPES = ["../../x", "/etc/passwd", "a/../../x", "..", "a\x00b", "a\\..\\x", "./x", ""]


@pytest.mark.parametrize("bad", ESCAPES)
@pytest.mark.parametrize("where", ["files", "location", "tensor", "run", "node"])
def test_manifest_names_that_escape_the_root_are_refused(tmp_path, bad, where):
    store = _committed(tmp_path)
    raw = parse(read_raw(store.local, "step-000000010/manifest.json"), "t").to_json(integrity=False)
    name = next(iter(raw["tensors"]))
    if where == "files":
        raw["files"][0]["path"] = bad
    elif where == "location":
        raw["tensors"][name]["shards"][0]["location"][0]["path"] = bad
    elif where == "tensor":
        raw["tensors"][bad] = raw["tensors"].pop(name)
    elif where == "run":
        raw["run"] = bad
    else:
        raw["format_version"], raw["nodes"] = 2, [{"node": bad, "manifest_digest": "sha256:" + "0" * 64}]
    from flowcheck.digest import sha256

    raw["integrity"] = sha256(canonical_json(raw))
    with pytest.raises(ManifestError):
        parse(canonical_json(raw) + b"\n", "t")


@pytest.mark.parametrize("run", ["../x", "/abs", "a/b", "..", "a\x00"])
def test_config_run_names_that_escape_the_root_are_refused(tmp_path, run):
    from flowcheck.config import load

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": run}))
    with pytest.raises(FlowcheckError):
        load(str(path))


def test_a_symlink_out_of_the_root_in_place_of_a_stored_file_is_caught(tmp_path):
    store = _committed(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 4096)
    for tier, rel, path in _step_files(store):
        if path.name == "manifest.json":
            continue
        original = path.read_bytes()
        path.unlink()
        path.symlink_to(outside)
        try:
            store.object._headers.clear()
            report = audit(store)
            assert not report.ok and rel in " ".join(map(str, report.problems)), (tier, rel)
        finally:
            path.unlink()
            path.write_bytes(original)


# ---- nothing from storage is unpickled ----------------------------------------------------------
UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cPickle", "load"), ("dill", "load"),
              ("dill", "loads"), ("joblib", "load"), ("torch", "load"), ("np", "load"), ("numpy", "load"),
              ("dcp", "load"), ("dcp", "load_state_dict"), ("checkpoint", "load")}
# the one place a user may opt in: `flowcheck import --trust-pickle` of a foreign Megatron checkpoint
ALLOWED = {("restore/unpickle.py", "load_pt")}
# torch's DCP reader (FileSystemReader, behind dcp.load) pickle.loads its .metadata; an Unpickler subclass must
# restrict find_class: only the allow-listed DCP metadata Unpickler may name either
UNPICKLER_NAMES = {"FileSystemReader", "Unpickler"}
UNPICKLER_MODULES = {"restore/unpickle.py"}


def _calls(tree: ast.Module):
    """(enclosing function, module name, attribute, call) of every ``name.attr(...)`` call."""
    top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    scopes = [("<module>", n) for n in top] + [
        (n.name, n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for name, scope in scopes:
        for node in ast.walk(scope):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                yield name, node.func.value.id, node.func.attr, node


def test_no_code_path_unpickles_stored_data():
    offenders = []
    for folder in ("flowcheck", "tiers", "restore"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for func, mod, attr, call in _calls(ast.parse(path.read_text())):
                if (mod, attr) not in UNPICKLERS or (rel, func) in ALLOWED:
                    continue
                kw = {k.arg: k.value for k in call.keywords}
                if attr == "load" and mod == "torch" and isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True:
                    continue
                if attr == "load" and mod in ("np", "numpy") and not (
                        isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is True):
                    continue
                offenders.append(f"{rel}:{call.lineno} {func}: {mod}.{attr}")
    assert not offenders, offenders


def test_only_the_allow_listed_unpickler_reads_dcp_metadata():
    offenders = []
    for folder in ("flowcheck", "tiers", "restore"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in UNPICKLER_MODULES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name.rsplit(".", 1)[-1] for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else [
                    getattr(node, "id", None) or getattr(node, "attr", None)]
                offenders += [f"{rel}:{node.lineno} {n}" for n in names if n in UNPICKLER_NAMES]
    assert not offenders, offenders


class _Bomb:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FLOWCHECK_BOMB_MARKER']}",))


def test_a_pickle_bomb_where_a_state_file_is_expected_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "exploded"
    monkeypatch.setenv("FLOWCHECK_BOMB_MARKER", str(marker))
    bomb = tmp_path / "state.pt"
    bomb.write_bytes(pickle.dumps({"decoder.weight": _Bomb()}))
    cfg = tmp_path / "fc.yaml"
    cfg.write_text(yaml.safe_dump({"run": "r1", "tiers": {"local": {"root": str(tmp_path / "local")},
                                                          "object": {"url": f"file://{tmp_path / 'object'}"}}}))
    res = CliRunner().invoke(main, ["--no-progress", "snapshot", "--config", str(cfg), "--state", str(bomb), "--step", "1"])
    assert res.exit_code == 2 and "weights_only" in res.output, res.output
    res = CliRunner().invoke(main, ["--no-progress", "import", "--config", str(cfg), "--step", "1", str(bomb)])
    assert res.exit_code == 2, res.output
    assert not marker.exists(), "a pickled payload ran"
    # and a pickle in place of a stored data file is damage, never loaded
    store = _committed(tmp_path / "s")
    write_raw(store.object, store.object.manifest(10).files[0].path, pickle.dumps(_Bomb()))
    store.object._headers.clear()
    assert not audit(store).ok
    with pytest.raises(FlowcheckError):
        store.read(10, next(iter(store.object.manifest(10).tensors)), prefer="object")
    assert not marker.exists()
