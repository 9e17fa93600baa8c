"""The manifest (format versions 1-4): the JSON contract that says what a stored step is and where its bytes lie.

Three digests, each with one job:

* ``Manifest.digest()`` (sha256, the *manifest digest*) covers what identifies
  the state — run, step, producer, parent, layout, every shard's data digest,
  scalars — but not where the bytes lie (``location``, ``files``).  A step keeps
  its digest when promoted from the local tier to the object tier, so the
  ``parent`` links form one hash chain across tiers.
* ``signature`` (optional HMAC-SHA256, key from the environment) covers the
  whole manifest, locations and files included.
* ``integrity`` (sha256) covers everything else in the file, so a flipped bit
  anywhere in a stored manifest is caught even without a signing key.
"""
from __future__ import annotations

import hmac
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from flowcheck import dtypes
from flowcheck.digest import sha256
from flowcheck.errors import ManifestError, UnsafeNameError
from flowcheck.state import ROLES, ParallelLayout, StateLayout, TensorSpec, check_branch, check_name, scalars_problem

FORMAT_VERSION = 1
# v2 = v1 + ``nodes``: the step manifest of a step written by several nodes (tiers/cluster.py).
# Only such manifests are v2, so a flowcheck that predates them refuses them instead of
# computing a digest that leaves ``nodes`` out.
MULTI_NODE_VERSION = 2
# v3 = v1 + packed pieces (``start``): the local tier stores many shards in one flat zarr array
# (tiers/zarr_pack.py).  Only where the bytes lie changes, and locations are outside the manifest
# digest, so a v3 manifest has the digest of the same state as v1 (``Manifest.digest``): a step
# keeps its identity when promoted.  A flowcheck that predates v3 refuses it instead of reading
# a pack as one shard.
PACKED_VERSION = 3
# v4 = v3 + references (``refs``, a piece's ``ref``): shards the step did not write again because the parent held
# the same bytes point into the earlier step that holds them (docs/format.md, "Incremental steps").  Only a manifest with at
# least one reference is v4; locations and refs identify nothing, so its digest is the v1 digest of the same
# state.  A flowcheck that predates v4 refuses it instead of looking for the bytes in the step's own folder.
INCREMENTAL_VERSION = 4
KNOWN_VERSIONS = (FORMAT_VERSION, MULTI_NODE_VERSION, PACKED_VERSION, INCREMENTAL_VERSION)
_LOCATION_ONLY = (PACKED_VERSION, INCREMENTAL_VERSION)  # differ from v1 only where the bytes lie
SOURCES = ("mirror", "push", "import", "restore", "snapshot")
MAX_TENSOR_BYTES = 1 << 63  # numpy and the byte offsets of every format are int64


def canonical_json(obj: Any) -> bytes:
    """The byte form every digest and signature is computed over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def check_relpath(path: str, what: str = "path") -> str:
    """A stored path must stay under its root: relative, no '..', no NUL or backslash."""
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not isinstance(path, str)
        or not path
        or path.startswith("/")
        or "\x00" in path
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise UnsafeNameError(f"{what} {path!r} would escape the store root: expected a relative path without '..'")
    return path


@dataclass(frozen=True)
class Piece:
    """Where (part of) a shard's bytes lie: a file or zarr array, a key in it, an optional row range."""

    path: str  # relative to the run's root in the tier; may point into an earlier step
    key: str | None = None  # tensor key inside a safetensors file
    rows: tuple[int, int] | None = None  # rows [start, stop) of the shard held by this piece
    start: int | None = None  # v3: the shard's first element in the flat (1-D) zarr array at ``path``
    ref: int | None = None  # v4: index into the manifest's ``refs``: the bytes lie in that earlier step's folder

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path}
        if self.ref is not None:
            out["ref"] = self.ref
        if self.key is not None:
            out["key"] = self.key
        if self.rows is not None:
            out["rows"] = list(self.rows)
        if self.start is not None:
            out["start"] = self.start
        return out


@dataclass(frozen=True)
class ShardEntry:
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    digest: str
    location: tuple[Piece, ...] = ()


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    global_shape: tuple[int, ...]
    role: str
    shards: tuple[ShardEntry, ...]


@dataclass(frozen=True)
class FileEntry:
    path: str
    bytes: int
    digest: str


@dataclass(frozen=True)
class StepRef:
    """v4: an earlier committed step holding bytes this step reuses.

    ``branch`` is the branch folder holding it, ``step``/``manifest_digest`` its identity (the digest tells it
    from a later state at the same number), ``files`` the files of that step the pieces use, with their size and
    digest as that step committed them, so audit checks them without trusting the other manifest.  A piece
    ``{"path": "step-…/packs/0", "start": s, "ref": i}`` (local tier) or ``{"path": "step-…/attempt-…/shard-…
    .safetensors", "key": k, "ref": i}`` (object tier) names its path as ``refs[i]``'s own manifest does
    (relative to that step's branch folder, inside its step folder)."""

    branch: str
    step: int
    manifest_digest: str
    files: tuple[FileEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"branch": self.branch, "step": self.step, "manifest_digest": self.manifest_digest,
                "files": [{"path": f.path, "bytes": f.bytes, "digest": f.digest} for f in self.files]}


@dataclass(frozen=True)
class NodeRef:
    """One node's part of a multi-node step: the node and the manifest digest of its part manifest."""

    node: str
    manifest_digest: str


@dataclass(frozen=True)
class Producer:
    node: str
    version: str
    source: str


@dataclass(frozen=True)
class ParentRef:
    step: int
    manifest_digest: str


def check_parent(parent: ParentRef, where: str) -> ParentRef:
    """A parent reference about to be committed: what the manifest parser would accept, checked first."""
    parse_ref({"step": parent.step, "manifest_digest": parent.manifest_digest}, where, "parent.")
    return parent


def parse_ref(raw: Any, where: str, prefix: str = "") -> ParentRef:
    """A ``{step, manifest_digest}`` object (a parent, a restore record); a ManifestError naming ``where`` and the
    field otherwise."""
    r = _Reader(where)
    if not isinstance(raw, Mapping):
        raise r.fail(prefix.rstrip(".") or "<root>", "an object {step, manifest_digest}", raw)
    step = r.get(raw, "step", int, prefix + "step", "a non-negative integer")
    if step < 0:
        raise r.fail(prefix + "step", "a non-negative integer", step)
    return ParentRef(step, r.digest(raw, "manifest_digest", prefix + "manifest_digest", "sha256"))


def validated_bytes(m: Manifest, where: str) -> bytes:
    """The file form of a manifest about to be committed, parsed back by the readers' own parser first:
    what a writer commits, every reader accepts."""
    raw = m.to_bytes()
    parse(raw, where)
    return raw


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Manifest:
    run: str
    step: int
    created_at: str
    producer: Producer
    parent: ParentRef | None
    layout_digest: str
    source_layout: ParallelLayout
    tensors: Mapping[str, TensorEntry]
    files: tuple[FileEntry, ...] = ()
    scalars: Mapping[str, Any] = field(default_factory=dict)
    buckets: tuple[tuple[str, ...], ...] = ()
    signature: Mapping[str, str] | None = None
    format_version: int = FORMAT_VERSION
    nodes: tuple[NodeRef, ...] = ()  # v2: the node part manifests this step merges (identity, in the digest)
    refs: tuple[StepRef, ...] = ()  # v4: earlier steps holding shards this step did not write again

    # ---- serialisation -------------------------------------------------
    def to_json(self, *, integrity: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "run": self.run,
            "step": self.step,
            "created_at": self.created_at,
            "producer": {"node": self.producer.node, "version": self.producer.version, "source": self.producer.source},
            "parent": None
            if self.parent is None
            else {"step": self.parent.step, "manifest_digest": self.parent.manifest_digest},
            "layout_digest": self.layout_digest,
            "source_layout": {
                "tp": self.source_layout.tp,
                "pp": self.source_layout.pp,
                "dp": self.source_layout.dp,
                "vpp": self.source_layout.vpp,
            },
            "tensors": {
                name: {
                    "dtype": t.dtype,
                    "global_shape": list(t.global_shape),
                    "role": t.role,
                    "shards": [
                        {
                            "offsets": list(s.offsets),
                            "shape": list(s.shape),
                            "digest": s.digest,
                            "location": [p.to_json() for p in s.location],
                        }
                        for s in t.shards
                    ],
                }
                for name, t in self.tensors.items()
            },
            "files": [{"path": f.path, "bytes": f.bytes, "digest": f.digest} for f in self.files],
            "scalars": dict(self.scalars),
        }
        if self.buckets:
            out["buckets"] = [list(b) for b in self.buckets]
        if self.nodes:
            out["nodes"] = [{"node": n.node, "manifest_digest": n.manifest_digest} for n in self.nodes]
        if self.refs:
            out["refs"] = [r.to_json() for r in self.refs]
        if self.signature is not None:
            out["signature"] = dict(self.signature)
        if integrity:
            out["integrity"] = sha256(canonical_json(out))
        return out

    def to_bytes(self) -> bytes:
        """The file form: canonical JSON plus a trailing newline."""
        return canonical_json(self.to_json()) + b"\n"

    def digest(self) -> str:
        """The manifest digest: identity of the state, independent of the tier holding it."""
        body = self.to_json(integrity=False)
        if self.format_version in _LOCATION_ONLY:
            body["format_version"] = FORMAT_VERSION  # v3/v4 differ from v1 only in locations, which identify nothing
        body.pop("signature", None)
        body.pop("files", None)
        body.pop("refs", None)
        for t in body["tensors"].values():
            for s in t["shards"]:
                s.pop("location")
        return sha256(canonical_json(body))

    def parent_ref(self) -> ParentRef:
        """A reference to this manifest, for the next step's ``parent``."""
        return ParentRef(self.step, self.digest())

    # ---- signing -------------------------------------------------------
    def _signing_bytes(self) -> bytes:
        body = self.to_json(integrity=False)
        body.pop("signature", None)
        return canonical_json(body)

    def signed(self, key: bytes) -> Manifest:
        mac = hmac.new(key, self._signing_bytes(), "sha256").hexdigest()
        return replace(self, signature={"alg": "hmac-sha256", "value": mac})

    def signature_valid(self, key: bytes) -> bool:
        if not self.signature or self.signature.get("alg") != "hmac-sha256":
            return False
        mac = hmac.new(key, self._signing_bytes(), "sha256").hexdigest()
        return hmac.compare_digest(mac, str(self.signature.get("value", "")))

    # ---- views ---------------------------------------------------------
    def layout(self) -> StateLayout:
        specs = tuple(
            TensorSpec(name, t.dtype, t.global_shape, t.role) for name, t in sorted(self.tensors.items())
        )
        return StateLayout(specs, self.source_layout, self.buckets)

    @property
    def nbytes(self) -> int:
        """Bytes of the files this step wrote (not those of earlier steps it references)."""
        return sum(f.bytes for f in self.files)

    @property
    def referenced_nbytes(self) -> int:
        """Bytes of earlier steps' files this step's shards point into (v4)."""
        return sum(f.bytes for r in self.refs for f in r.files)

    @property
    def data_nbytes(self) -> int:
        """Bytes of tensor data in the shards (``nbytes`` less the formats' headers and metadata)."""
        return sum(math.prod(s.shape) * dtypes.dtype(t.dtype).itemsize for t in self.tensors.values() for s in t.shards)


def signing_key(env_var: str = "FLOWCHECK_HMAC_KEY") -> bytes | None:
    """The HMAC key from the environment, or None when signing is off."""
    raw = os.environ.get(env_var)
    return raw.encode() if raw else None


# ---- parsing -------------------------------------------------------------
_HEX = frozenset("0123456789abcdef")  # a set test, not a generator per character: a DCP step has ~1000 digests
_HEX_DIGITS = {"xxh3-128": 32, "sha256": 64}


class _Reader:
    """Typed field access that names the file and field in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field_: str, expected: str, found: Any) -> ManifestError:
        shown = repr(found)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return ManifestError(f"{self.where}: field '{field_}': expected {expected}, found {shown}")

    def get(self, raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str, expected: str) -> Any:
        if not isinstance(raw, Mapping) or key not in raw:
            raise self.fail(path, expected, "<missing>")
        value = raw[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(path, expected, value)
        return value

    def ints(self, raw: Mapping[str, Any], key: str, path: str) -> tuple[int, ...]:
        value = self.get(raw, key, list, path, "a list of non-negative integers")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise self.fail(path, "a list of non-negative integers", value)
        return tuple(value)

    def digest(self, raw: Mapping[str, Any], key: str, path: str, prefix: str) -> str:
        width = _HEX_DIGITS[prefix]
        expected = f"a '{prefix}:<{width} hex digits>' digest"
        value = self.get(raw, key, str, path, expected)
        hexpart = value[len(prefix) + 1:]
        if not value.startswith(prefix + ":") or len(hexpart) != width or not _HEX.issuperset(hexpart):
            raise self.fail(path, expected, value)
        return value

    def relpath(self, raw: Mapping[str, Any], key: str, path: str) -> str:
        value = self.get(raw, key, str, path, "a relative path")
        try:
            return check_relpath(value, f"{self.where}: {path}")
        except UnsafeNameError as e:
            raise ManifestError(str(e)) from e


def _piece(r: _Reader, raw: Any, path: str, version: int) -> Piece:
    if not isinstance(raw, Mapping):
        raise r.fail(path, "an object {path, key?, rows?, start?, ref?}", raw)
    p = r.relpath(raw, "path", path + ".path")
    key = raw.get("key")
    if key is not None and not isinstance(key, str):
        raise r.fail(path + ".key", "a string", key)
    rows = raw.get("rows")
    if rows is not None:
        if not (isinstance(rows, list) and len(rows) == 2 and all(isinstance(v, int) for v in rows) and 0 <= rows[0] <= rows[1]):
            raise r.fail(path + ".rows", "[start, stop] with 0 <= start <= stop", rows)
        rows = (rows[0], rows[1])
    start = raw.get("start")
    if start is not None:
        if version not in _LOCATION_ONLY:
            raise r.fail(path + ".start", f"no 'start' outside a format_version {list(_LOCATION_ONLY)} manifest", start)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 or key is not None or rows is not None:
            raise r.fail(path + ".start", "a non-negative integer, in a piece without key and rows", start)
    ref = raw.get("ref")
    if ref is not None:
        if version != INCREMENTAL_VERSION:
            raise r.fail(path + ".ref", f"no 'ref' outside a format_version {INCREMENTAL_VERSION} manifest", ref)
        if not isinstance(ref, int) or isinstance(ref, bool) or ref < 0 or (start is None and key is None):
            raise r.fail(path + ".ref", "a non-negative integer, in a packed piece (with 'start') or a safetensors "
                         "one (with 'key')", ref)
    return Piece(p, key, rows, start, ref)


def _tensor(r: _Reader, name: str, raw: Any, version: int) -> TensorEntry:
    try:
        check_name(name)
    except UnsafeNameError as e:
        raise ManifestError(f"{r.where}: field 'tensors': {e}") from e
    base = f"tensors.{name}"
    dt = r.get(raw, "dtype", str, base + ".dtype", "a dtype name")
    try:
        itemsize = dtypes.dtype(dt).itemsize
    except Exception as e:
        raise r.fail(base + ".dtype", "a known dtype", dt) from e
    shape = r.ints(raw, "global_shape", base + ".global_shape")
    if math.prod(shape) * itemsize >= MAX_TENSOR_BYTES:
        raise r.fail(base + ".global_shape", "a tensor of less than 2**63 bytes", list(shape))
    role = r.get(raw, "role", str, base + ".role", f"one of {ROLES}")
    if role not in ROLES:
        raise r.fail(base + ".role", f"one of {ROLES}", role)
    shards = []
    for i, s in enumerate(r.get(raw, "shards", list, base + ".shards", "a list of shards")):
        sp = f"{base}.shards[{i}]"
        offsets, sshape = r.ints(s, "offsets", sp + ".offsets"), r.ints(s, "shape", sp + ".shape")
        if len(offsets) != len(shape) or len(sshape) != len(shape) or any(
            o + n > g for o, n, g in zip(offsets, sshape, shape)
        ):
            raise r.fail(sp, f"a box inside global shape {list(shape)}", {"offsets": offsets, "shape": sshape})
        loc = r.get(s, "location", list, sp + ".location", "a list of pieces")
        pieces = tuple(_piece(r, p, f"{sp}.location[{j}]", version) for j, p in enumerate(loc))
        for j, p in enumerate(pieces):
            if p.rows is not None and (not sshape or p.rows[1] > sshape[0]):
                rows = sshape[0] if sshape else 0
                raise r.fail(f"{sp}.location[{j}].rows", f"rows within the shard's {rows}", list(p.rows))
        shards.append(ShardEntry(offsets, sshape, r.digest(s, "digest", sp + ".digest", "xxh3-128"), pieces))
    return TensorEntry(dt, shape, role, tuple(shards))


def _check_file_bytes(r: _Reader, tensors: Mapping[str, TensorEntry], files: list[FileEntry],
                      refs: tuple[StepRef, ...] = ()) -> None:
    """A piece with a ``key`` is a tensor inside a safetensors file, which holds its bytes densely: that file must
    be listed (in ``files``, or in its ``refs[i].files`` for a v4 referenced piece), with at least the bytes of
    every piece in it.  Checked here, so that a forged shape (2**40 elements over a few KiB of files) never sizes a
    buffer.  zarr pieces (no key) may be compressed or sparse (all-fill chunks are not stored): their size is
    bounded only when they are read."""
    listed = {(None, f.path): (f"files[{i}]", f.bytes) for i, f in enumerate(files)}
    listed.update(((k, f.path), (f"refs[{k}].files[{i}]", f.bytes))
                  for k, ref in enumerate(refs) for i, f in enumerate(ref.files))
    held: dict[tuple[int | None, str], int] = {}
    for name, t in tensors.items():
        itemsize = dtypes.dtype(t.dtype).itemsize
        for i, s in enumerate(t.shards):
            for j, p in enumerate(s.location):
                if p.key is None:
                    continue
                if (p.ref, p.path) not in listed:
                    where = "'files'" if p.ref is None else f"'refs[{p.ref}].files'"
                    raise r.fail(f"tensors.{name}.shards[{i}].location[{j}].path",
                                 f"a file listed in {where} (a safetensors piece)", p.path)
                shape = s.shape if p.rows is None or not s.shape else (p.rows[1] - p.rows[0], *s.shape[1:])
                held[(p.ref, p.path)] = held.get((p.ref, p.path), 0) + math.prod(shape) * itemsize
    for key, need in held.items():
        field_, size = listed[key]
        if need > size:
            raise r.fail(f"{field_}.bytes", f"at least {need:,}: the bytes of tensor data its pieces place in "
                         f"{key[1]} (a manifest that claims more data than its files hold is forged)", size)


def _version_list(r: _Reader, raw: Mapping[str, Any], key: str, version: int, only: int, expected: str) -> list:
    """The non-empty list ``key``, which only a format_version ``only`` manifest has (and must have); [] for others."""
    if version != only:
        if key in raw:
            raise r.fail(key, f"no {key!r} in a format_version {version} manifest", raw[key])
        return []
    items = r.get(raw, key, list, key, expected)
    if not items:
        raise r.fail(key, expected, items)
    return items


def _nodes(r: _Reader, raw: Mapping[str, Any], version: int) -> tuple[NodeRef, ...]:
    """v2 lists its node parts (at least one, each node once); v1 and v3 have none."""
    items = _version_list(r, raw, "nodes", version, MULTI_NODE_VERSION, "a non-empty list of {node, manifest_digest}")
    out = []
    for i, item in enumerate(items):
        name = r.get(item, "node", str, f"nodes[{i}].node", "a node name")
        try:
            check_name(name, "node name")
        except UnsafeNameError as e:
            raise ManifestError(f"{r.where}: field 'nodes[{i}].node': {e}") from e
        out.append(NodeRef(name, r.digest(item, "manifest_digest", f"nodes[{i}].manifest_digest", "sha256")))
    names = [n.node for n in out]
    if len(set(names)) != len(names):
        raise r.fail("nodes", "each node once", names)
    return tuple(out)


def _refs(r: _Reader, raw: Mapping[str, Any], version: int, tensors: Mapping[str, TensorEntry]) -> tuple[StepRef, ...]:
    """v4 lists the earlier steps its pieces point into (at least one, each used); a piece's ``ref`` indexes
    them and its path lies inside that step's folder.  Earlier versions have none."""
    items = _version_list(r, raw, "refs", version, INCREMENTAL_VERSION,
                          "a non-empty list of {branch, step, manifest_digest, files}")
    if not items:  # not a v4 manifest: nothing to check the pieces against
        return ()
    out = []
    for i, item in enumerate(items):
        branch = r.get(item, "branch", str, f"refs[{i}].branch", "a branch name")
        try:
            check_branch(branch)
        except Exception as e:  # noqa: BLE001 - any refusal is a bad field
            raise r.fail(f"refs[{i}].branch", "a branch name", branch) from e
        step = r.get(item, "step", int, f"refs[{i}].step", "a non-negative integer")
        if step < 0:
            raise r.fail(f"refs[{i}].step", "a non-negative integer", step)
        digest = r.digest(item, "manifest_digest", f"refs[{i}].manifest_digest", "sha256")
        files = _file_entries(r, r.get(item, "files", list, f"refs[{i}].files", "a list"), f"refs[{i}].files")
        out.append(StepRef(branch, step, digest, tuple(files)))
    used = set()
    for name, t in tensors.items():
        for i, s in enumerate(t.shards):
            for j, p in enumerate(s.location):
                if p.ref is None:
                    continue
                where = f"tensors.{name}.shards[{i}].location[{j}]"
                if p.ref >= len(out):
                    raise r.fail(where + ".ref", f"an index into 'refs' (0..{len(out) - 1})", p.ref)
                prefix = "step-{:09d}/".format(out[p.ref].step)
                if not p.path.startswith(prefix):
                    raise r.fail(where + ".path", f"a path inside {prefix} (the referenced step's folder)", p.path)
                used.add(p.ref)
    if used != set(range(len(out))):
        raise r.fail("refs", "only steps some piece references", sorted(set(range(len(out))) - used))
    return tuple(out)


def _file_entries(r: _Reader, items: list, field_: str) -> list[FileEntry]:
    files: list[FileEntry] = []
    for i, f in enumerate(items):
        p = r.relpath(f, "path", f"{field_}[{i}].path")
        size = r.get(f, "bytes", int, f"{field_}[{i}].bytes", "a non-negative integer")
        if size < 0:
            raise r.fail(f"{field_}[{i}].bytes", "a non-negative integer", size)
        files.append(FileEntry(p, size, r.digest(f, "digest", f"{field_}[{i}].digest", "xxh3-128")))
    return files


def _scalars(r: _Reader, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The scalars object, every field the readers use of the type they use it as (flowcheck/state.py)."""
    scalars = r.get(raw, "scalars", dict, "scalars", "an object")
    bad = scalars_problem(scalars)
    if bad is not None:
        field_, expected, found = bad
        raise r.fail(f"scalars.{field_}", expected, found)
    return scalars


def parse(raw_bytes: bytes, where: str, *, verify_integrity: bool = True) -> Manifest:
    """Parse and validate a manifest file's bytes; ``where`` names it in errors."""
    r = _Reader(where)
    try:
        raw = json.loads(raw_bytes)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON ({e}); the file is damaged or not a flowcheck manifest") from e
    if not isinstance(raw, dict):
        raise r.fail("<root>", "a JSON object", type(raw).__name__)
    version = r.get(raw, "format_version", int, "format_version", "an integer")
    if version not in KNOWN_VERSIONS:
        raise ManifestError(
            f"{where}: field 'format_version': expected one of {list(KNOWN_VERSIONS)}, found {version}; "
            "this manifest was written by a newer flowcheck — upgrade flowcheck to read it"
        )
    tensors = {name: _tensor(r, name, t, version)
               for name, t in r.get(raw, "tensors", dict, "tensors", "an object").items()}
    files = _file_entries(r, r.get(raw, "files", list, "files", "a list"), "files")
    refs = _refs(r, raw, version, tensors)
    _check_file_bytes(r, tensors, files, refs)
    signature = raw.get("signature")
    if signature is not None and not isinstance(signature, dict):
        raise r.fail("signature", "an object {alg, value}", signature)
    run, step = _identity(r, raw)
    m = Manifest(
        run=run,
        step=step,
        created_at=r.get(raw, "created_at", str, "created_at", "an ISO-8601 UTC time"),
        producer=_producer(r, raw),
        parent=_parent(r, raw),
        layout_digest=r.digest(raw, "layout_digest", "layout_digest", "sha256"),
        source_layout=_source_layout(r, raw),
        tensors=tensors,
        files=tuple(files),
        scalars=_scalars(r, raw),
        buckets=_buckets(r, raw),
        signature=signature,
        format_version=version,
        nodes=_nodes(r, raw, version),
        refs=refs,
    )
    if verify_integrity:
        _check_integrity(r, raw, raw_bytes, m)
    return m


def _identity(r: _Reader, raw: Mapping[str, Any]) -> tuple[str, int]:
    step = r.get(raw, "step", int, "step", "a non-negative integer")
    if step < 0:
        raise r.fail("step", "a non-negative integer", step)
    run = r.get(raw, "run", str, "run", "a run name")
    try:
        check_name(run, "run name")
    except UnsafeNameError as e:
        raise ManifestError(f"{r.where}: field 'run': {e}") from e
    return run, step


def _producer(r: _Reader, raw: Mapping[str, Any]) -> Producer:
    prod = r.get(raw, "producer", dict, "producer", "an object")
    source = r.get(prod, "source", str, "producer.source", f"one of {SOURCES}")
    if source not in SOURCES:
        raise r.fail("producer.source", f"one of {SOURCES}", source)
    return Producer(r.get(prod, "node", str, "producer.node", "a string"),
                    r.get(prod, "version", str, "producer.version", "a string"), source)


def _parent(r: _Reader, raw: Mapping[str, Any]) -> ParentRef | None:
    if "parent" not in raw:
        raise r.fail("parent", "an object {step, manifest_digest} or null", "<missing>")
    parent_raw = raw["parent"]
    if parent_raw is None:
        return None
    return ParentRef(r.get(parent_raw, "step", int, "parent.step", "an integer"),
                     r.digest(parent_raw, "manifest_digest", "parent.manifest_digest", "sha256"))


def _source_layout(r: _Reader, raw: Mapping[str, Any]) -> ParallelLayout:
    sl = r.get(raw, "source_layout", dict, "source_layout", "an object {tp, pp, dp, vpp}")
    dims = {k: r.get(sl, k, int, f"source_layout.{k}", "a positive integer") for k in ("tp", "pp", "dp", "vpp")}
    if any(v < 1 for v in dims.values()):
        raise r.fail("source_layout", "positive integers tp, pp, dp, vpp", sl)
    return ParallelLayout(**dims)


def _buckets(r: _Reader, raw: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    buckets_raw = raw.get("buckets", [])
    if not isinstance(buckets_raw, list) or not all(
        isinstance(b, list) and all(isinstance(n, str) for n in b) for b in buckets_raw
    ):
        raise r.fail("buckets", "a list of lists of tensor names", buckets_raw)
    return tuple(tuple(b) for b in buckets_raw)


def _check_integrity(r: _Reader, raw: Mapping[str, Any], raw_bytes: bytes, m: Manifest) -> None:
    """The file is exactly what its writer produced: its integrity digest, canonical form and layout digest."""
    body = {k: v for k, v in raw.items() if k != "integrity"}
    stored = raw.get("integrity")
    if stored != sha256(canonical_json(body)):
        raise ManifestError(
            f"{r.where}: field 'integrity': expected the sha256 of the manifest body, found {stored!r}; "
            "the manifest was modified after it was written"
        )
    if raw_bytes.rstrip(b"\n") != canonical_json(raw):
        raise ManifestError(
            f"{r.where}: the file is not in canonical form (sorted keys, no spaces, shortest numbers): "
            "it was modified after it was written"
        )
    if m.layout().digest() != m.layout_digest:
        raise r.fail("layout_digest", m.layout().digest(), m.layout_digest)
