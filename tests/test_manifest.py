"""Manifest v1: the on-disk contract (golden file), its digest, parsing and signing."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from flowcheck.digest import sha256
from flowcheck.errors import FlowcheckError, ManifestError
from flowcheck.manifest import (
    PACKED_VERSION,
    FileEntry,
    Manifest,
    ParentRef,
    Piece,
    Producer,
    ShardEntry,
    TensorEntry,
    canonical_json,
    parse,
    parse_ref,
)
from flowcheck.state import ParallelLayout, Scalars, StateLayout, TensorSpec

Failed = pytest.fail.Exception  # what a 'DID NOT RAISE' raises
GOLDEN = Path(__file__).parent / "golden" / "manifest_v1.json"
# The manifest digest of the golden manifest: if this changes, every stored hash chain breaks.
GOLDEN_DIGEST = "sha256:61295e66f7063d772bbbdb223a083f95f6ba30f9b1f069e4537f88bcddf9c7ce"
W = "decoder.layers.0.mlp.linear_fc1.weight"
NORM = "decoder.final_layernorm.weight"


def _hex(c: str, n: int) -> str:
    return c * n


def golden_manifest() -> Manifest:
    specs = (TensorSpec(W, "float32", (8, 6), "swiglu_fc1"), TensorSpec(NORM, "bfloat16", (16,)))
    layout = StateLayout(specs, ParallelLayout(tp=2, pp=1, dp=4), buckets=((NORM, W),))
    f0, f1 = "step-000000010/shard-00000-of-00002.safetensors", "step-000000010/shard-00001-of-00002.safetensors"
    return Manifest(
        run="run-a",
        step=10,
        created_at="2025-01-02T03:04:05.678901Z",
        producer=Producer("node-7", "0.1.0", "mirror"),
        parent=ParentRef(5, "sha256:" + _hex("a", 64)),
        layout_digest=layout.digest(),
        source_layout=layout.source,
        tensors={
            W: TensorEntry("float32", (8, 6), "swiglu_fc1", (
                ShardEntry((0, 0), (4, 6), "xxh3-128:" + _hex("1", 32), (Piece(f0, f"{W}#0"),)),
                ShardEntry((4, 0), (4, 6), "xxh3-128:" + _hex("2", 32),
                           (Piece(f0, f"{W}#1#rows0-2", (0, 2)), Piece(f1, f"{W}#1#rows2-4", (2, 4)))),
            )),
            NORM: TensorEntry("bfloat16", (16,), "replicated", (
                ShardEntry((0,), (16,), "xxh3-128:" + _hex("3", 32), (Piece(f1, f"{NORM}#0"),)),
            )),
        },
        files=(FileEntry(f0, 400, "xxh3-128:" + _hex("4", 32)), FileEntry(f1, 300, "xxh3-128:" + _hex("5", 32))),
        scalars={"optimizer_step": 10, "rng": {"torch": "AAEC"}, "lr_scheduler": {"last_lr": [0.0003]}},
        buckets=layout.buckets,
    )


def raw_json() -> dict:
    return json.loads(golden_manifest().to_bytes())


GOLDEN_V3 = Path(__file__).parent / "golden" / "manifest_v3.json"


def golden_packed_manifest() -> Manifest:
    """The golden state as the local tier's packed layout (format_version 3) stores it: the same tensors and
    digests, its shards at element offsets of two flat zarr arrays."""
    m = golden_manifest()
    d, packs = "step-000000010", "step-000000010/packs"
    w, norm = m.tensors[W], m.tensors[NORM]
    return replace(
        m,
        format_version=PACKED_VERSION,
        tensors={
            W: replace(w, shards=(replace(w.shards[0], location=(Piece(f"{packs}/0", start=0),)),
                                  replace(w.shards[1], location=(Piece(f"{packs}/0", start=24),)))),
            NORM: replace(norm, shards=(replace(norm.shards[0], location=(Piece(f"{packs}/1", start=0),)),)),
        },
        files=(FileEntry(f"{d}/zarr.json", 900, "xxh3-128:" + _hex("6", 32)),
               FileEntry(f"{packs}/0/c/0", 65560, "xxh3-128:" + _hex("7", 32)),
               FileEntry(f"{packs}/1/c/0", 65560, "xxh3-128:" + _hex("8", 32))),
    )


def reseal(obj: dict) -> bytes:
    """Re-serialise an edited manifest with a matching integrity field (a careful forger)."""
    body = {k: v for k, v in obj.items() if k != "integrity"}
    return canonical_json({**body, "integrity": sha256(canonical_json(body))}) + b"\n"


# ---- the contract ------------------------------------------------------------
def test_manifest_bytes_match_the_golden_file():
    assert golden_manifest().to_bytes() == GOLDEN.read_bytes()


def test_golden_file_has_the_design_fields():
    raw = json.loads(GOLDEN.read_bytes())
    assert set(raw) == {
        "format_version", "run", "step", "created_at", "producer", "parent", "layout_digest",
        "source_layout", "tensors", "files", "scalars", "buckets", "integrity",
    }
    assert raw["format_version"] == 1
    assert set(raw["producer"]) == {"node", "version", "source"}
    assert set(raw["parent"]) == {"step", "manifest_digest"}
    assert set(raw["source_layout"]) == {"tp", "pp", "dp", "vpp"}
    assert set(raw["tensors"][W]) == {"dtype", "global_shape", "role", "shards"}
    assert set(raw["tensors"][W]["shards"][0]) == {"offsets", "shape", "location", "digest"}
    assert set(raw["files"][0]) == {"path", "bytes", "digest"}


def test_golden_file_parses_to_the_same_manifest():
    assert parse(GOLDEN.read_bytes(), str(GOLDEN)) == golden_manifest()


def test_manifest_digest_is_pinned():
    assert golden_manifest().digest() == GOLDEN_DIGEST


def test_packed_manifest_bytes_match_the_golden_v3_file():
    assert golden_packed_manifest().to_bytes() == GOLDEN_V3.read_bytes()
    assert parse(GOLDEN_V3.read_bytes(), str(GOLDEN_V3)) == golden_packed_manifest()
    raw = json.loads(GOLDEN_V3.read_bytes())
    assert raw["format_version"] == 3 and raw["tensors"][W]["shards"][1]["location"] == [
        {"path": "step-000000010/packs/0", "start": 24}]


def test_a_packed_manifest_has_the_digest_of_the_same_state_in_v1():
    """v3 changes only where the bytes lie: promotion from a packed local step keeps the hash chain."""
    assert golden_packed_manifest().digest() == GOLDEN_DIGEST == golden_manifest().digest()


def test_start_is_refused_outside_v3_and_with_a_key_or_rows():
    raw = raw_json()
    _shard(raw)["location"] = [{"path": "step-000000010/packs/0", "start": 0}]
    with pytest.raises(ManifestError, match="start"):
        parse(reseal(raw), "m.json")
    packed = json.loads(golden_packed_manifest().to_bytes())
    for bad in ({"path": "p", "start": -1}, {"path": "p", "start": True}, {"path": "p", "start": 0, "key": "k"},
                {"path": "p", "start": 0, "rows": [0, 1]}):
        packed["tensors"][NORM]["shards"][0]["location"] = [bad]
        with pytest.raises(ManifestError, match="start"):
            parse(reseal(packed), "m.json")


def test_a_v3_manifest_lists_no_nodes():
    packed = json.loads(golden_packed_manifest().to_bytes())
    packed["nodes"] = [{"node": "n1", "manifest_digest": "sha256:" + _hex("c", 64)}]
    with pytest.raises(ManifestError, match="no 'nodes' in a format_version 3"):
        parse(reseal(packed), "m.json")


# ---- the manifest digest -------------------------------------------------------
def test_digest_ignores_where_the_bytes_lie():
    m = golden_manifest()
    moved = replace(
        m,
        tensors={n: replace(t, shards=tuple(replace(s, location=(Piece("elsewhere/x"),)) for s in t.shards))
                 for n, t in m.tensors.items()},
        files=(FileEntry("elsewhere/x", 1, "xxh3-128:" + _hex("f", 32)),),
    )
    assert moved.digest() == m.digest()
    assert moved.signed(b"k").digest() == m.digest()


def _with_shard_digest(m: Manifest) -> Manifest:
    t = m.tensors[NORM]
    shard = replace(t.shards[0], digest="xxh3-128:" + _hex("9", 32))
    return replace(m, tensors={**m.tensors, NORM: replace(t, shards=(shard,))})


@pytest.mark.parametrize(
    "change",
    [
        _with_shard_digest,
        lambda m: replace(m, scalars={**m.scalars, "optimizer_step": 11}),
        lambda m: replace(m, parent=ParentRef(6, m.parent.manifest_digest)),
        lambda m: replace(m, parent=ParentRef(5, "sha256:" + _hex("b", 64))),
        lambda m: replace(m, parent=None),
    ],
    ids=["shard-digest", "scalars", "parent-step", "parent-digest", "no-parent"],
)
def test_digest_changes_with_what_identifies_the_state(change):
    assert change(golden_manifest()).digest() != golden_manifest().digest()


# ---- parsing ------------------------------------------------------------------------
def test_parse_round_trips():
    for m in (golden_manifest(), replace(golden_manifest(), parent=None), golden_manifest().signed(b"key")):
        back = parse(m.to_bytes(), "m")
        assert back == m
        assert back.to_bytes() == m.to_bytes()
        assert back.digest() == m.digest()


def test_parse_rejects_an_unknown_format_version():
    raw = raw_json()
    raw["format_version"] = 99
    with pytest.raises(ManifestError, match="format_version"):
        parse(reseal(raw), "m.json")


def _shard(raw: dict) -> dict:
    return raw["tensors"][W]["shards"][0]


@pytest.mark.parametrize(
    "field, value",
    [
        ("shard", "xxh3-128:" + "Z" * 32),
        ("shard", "xxh3-128:" + "A" * 32),  # hex is lower-case
        ("shard", "sha256:" + "1" * 64),  # data digests are xxh3-128
        ("shard", "1" * 32),
        ("shard", 12345),
        ("file", "md5:" + "1" * 32),
        ("parent", "xxh3-128:" + "1" * 32),
        ("layout", "sha256:" + "g" * 64),
    ],
)
def test_parse_rejects_malformed_digests(field, value):
    raw = raw_json()
    target, key, name = {
        "shard": (_shard(raw), "digest", "digest"),
        "file": (raw["files"][0], "digest", "files[0].digest"),
        "parent": (raw["parent"], "manifest_digest", "parent.manifest_digest"),
        "layout": (raw, "layout_digest", "layout_digest"),
    }[field]
    target[key] = value
    with pytest.raises(ManifestError, match=re.escape(name)):
        parse(reseal(raw), "m.json")


@pytest.mark.parametrize("value", ["xxh3-128:", "xxh3-128:abc", "xxh3-128:" + "1" * 33])
def test_parse_rejects_digests_of_the_wrong_length(value):
    raw = raw_json()
    _shard(raw)["digest"] = value
    with pytest.raises(ManifestError, match="digest"):
        parse(reseal(raw), "m.json")


@pytest.mark.parametrize("name", ["a/b", "..", "a..b", "../escape", "/abs", "__metadata__", ".hidden", "a\x00b", ""])
def test_parse_rejects_unsafe_tensor_names(name):
    raw = raw_json()
    raw["tensors"][name] = raw["tensors"].pop(NORM)
    with pytest.raises(ManifestError, match="tensors"):
        parse(reseal(raw), "m.json")


UNSAFE_PATHS = ["../x", "step-000000010/../../x", "/etc/passwd", "a//b", "./a", "a\\b", "a\x00b", ""]


@pytest.mark.parametrize("path", UNSAFE_PATHS)
@pytest.mark.parametrize("where", ["location", "files"])
def test_parse_rejects_paths_that_escape_the_root(path, where):
    raw = raw_json()
    if where == "location":
        _shard(raw)["location"][0]["path"] = path
        field = r"location\[0\]\.path"
    else:
        raw["files"][0]["path"] = path
        field = r"files\[0\]\.path"
    with pytest.raises(FlowcheckError, match=field):
        parse(reseal(raw), "m.json")


@pytest.mark.parametrize("where", ["location", "files"])
def test_unsafe_paths_are_reported_as_manifest_errors(where):
    raw = raw_json()
    (_shard(raw)["location"][0] if where == "location" else raw["files"][0])["path"] = "../x"
    with pytest.raises(ManifestError):
        parse(reseal(raw), "m.json")


def small_manifest_bytes() -> bytes:
    m = golden_manifest()
    layout = StateLayout((TensorSpec(NORM, "bfloat16", (16,)),), m.source_layout)
    return replace(m, tensors={NORM: m.tensors[NORM]}, files=m.files[1:], buckets=(), layout_digest=layout.digest()).to_bytes()


def test_every_single_bit_flip_is_rejected():
    good = small_manifest_bytes()
    parse(good, "m.json")
    accepted = []
    for i in range(len(good)):
        for bit in range(8):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            try:
                parse(bytes(bad), "m.json")
                accepted.append((i, bit))
            except ManifestError:
                pass
    assert accepted == []


def test_a_bit_flip_in_a_float_exponent_is_rejected():
    m = replace(golden_manifest(), scalars={"lr_scheduler": {"last_lr": [3e-05]}})
    good = m.to_bytes()
    bad = good.replace(b"3e-05", b"3E-05")
    assert bad != good and len(bad) == len(good)
    with pytest.raises(ManifestError):
        parse(bad, "m.json")


REQUIRED = [
    ("format_version",), ("run",), ("step",), ("created_at",), ("producer",), ("producer", "node"),
    ("producer", "version"), ("producer", "source"), ("layout_digest",), ("source_layout",), ("tensors",),
    ("tensors", W, "dtype"), ("tensors", W, "global_shape"), ("tensors", W, "role"), ("tensors", W, "shards"),
    ("tensors", W, "shards", 0, "offsets"), ("tensors", W, "shards", 0, "shape"),
    ("tensors", W, "shards", 0, "digest"), ("tensors", W, "shards", 0, "location"),
    ("files",), ("files", 0, "path"), ("files", 0, "bytes"), ("files", 0, "digest"), ("scalars",),
]


def _drop(raw: dict, path: tuple) -> None:
    node = raw
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]


def field_name(path: tuple) -> str:
    """How errors spell a field: tensors.<name>.shards[0].offsets, files[0].path."""
    return "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + p for i, p in enumerate(path))


@pytest.mark.parametrize("path", REQUIRED, ids=field_name)
def test_a_missing_field_is_named(path):
    raw = raw_json()
    _drop(raw, path)
    with pytest.raises(ManifestError, match=re.escape(f"field '{field_name(path)}'")):
        parse(reseal(raw), "m.json")


@pytest.mark.parametrize("path", [("parent",), ("source_layout", "pp"), ("source_layout", "tp")], ids=".".join)
def test_a_missing_lineage_or_layout_field_is_named(path):
    raw = raw_json()
    _drop(raw, path)
    with pytest.raises(ManifestError, match=path[-1]):
        parse(reseal(raw), "m.json")


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r.update(step="10"),
        lambda r: r.update(step=-1),
        lambda r: r.update(step=True),
        lambda r: r.update(run="../other"),
        lambda r: r["producer"].update(source="telepathy"),
        lambda r: r["tensors"][W].update(role="diagonal"),
        lambda r: r["tensors"][W].update(dtype="float128"),
        lambda r: _shard(r).update(offsets=[-1, 0]),
        lambda r: _shard(r).update(offsets=[6, 0]),  # box outside the global shape
        lambda r: _shard(r)["location"][0].update(rows=[3, 1]),
        lambda r: r.update(signature="abc"),
        lambda r: r["source_layout"].update(tp=0),
        lambda r: r.update(scalars=[]),
    ],
)
def test_parse_rejects_malformed_values_with_a_manifest_error(edit):
    raw = raw_json()
    edit(raw)
    with pytest.raises(ManifestError):
        parse(reseal(raw), "m.json")


@pytest.mark.parametrize("raw", [b"", b"[]", b"null", b"\xff\xfe", b"{" * 10, b'{"format_version": 1}'])
def test_parse_rejects_what_is_not_a_manifest(raw):
    with pytest.raises(ManifestError, match="m.json"):
        parse(raw, "m.json")


@pytest.mark.parametrize("buckets", [5, [5], None])
def test_malformed_buckets_raise_a_manifest_error(buckets):
    raw = raw_json()
    raw["buckets"] = buckets
    with pytest.raises(ManifestError, match="buckets"):
        parse(reseal(raw), "m.json")


# ---- scalars: what readers use them as (a forger keeps the integrity hash valid) ---------------
@pytest.mark.parametrize("key,value,field,expected", [
    ("optimizer_step", "x", "scalars.optimizer_step", "an integer or null"),
    ("optimizer_step", True, "scalars.optimizer_step", "an integer or null"),
    ("optimizer_step", 1.5, "scalars.optimizer_step", "an integer or null"),
    ("rng", ["a"], "scalars.rng", "an object of name -> base64 string"),
    ("rng", {"torch": 5}, "scalars.rng.torch", "a base64 string"),
    ("lr_scheduler", "s", "scalars.lr_scheduler", "an object or null"),
    ("optimizer", [1], "scalars.optimizer", "an object or null"),
    ("optimizer", {"param_groups": [1]}, "scalars.optimizer.param_groups", "a list of objects"),
    ("extra", [1], "scalars.extra", "an object"),
])
def test_scalars_of_the_wrong_type_are_a_manifest_error_naming_the_field(key, value, field, expected):
    raw = raw_json()
    raw["scalars"][key] = value
    with pytest.raises(ManifestError, match=re.escape(f"m.json: field '{field}': expected {expected}, found")):
        parse(reseal(raw), "m.json")
    with pytest.raises(FlowcheckError, match=re.escape(f"field '{field.removeprefix('scalars.')}'")):
        Scalars.from_json(raw["scalars"])


def test_scalars_may_leave_fields_out_and_carry_unknown_ones():
    raw = raw_json()
    raw["scalars"] = {"optimizer_step": None, "lr_scheduler": None, "optimizer": None, "from_a_newer_writer": [1]}
    assert parse(reseal(raw), "m.json").scalars == raw["scalars"]
    assert Scalars.from_json(raw["scalars"]) == Scalars()


# ---- stored bytes: a safetensors piece's data must fit in the file it names ----------------
def test_a_file_smaller_than_the_data_its_pieces_place_in_it_is_refused():
    raw = raw_json()
    raw["files"][0]["bytes"] = 143  # the pieces in file 0 hold 96 + 48 bytes
    with pytest.raises(ManifestError, match=r"field 'files\[0\].bytes': expected at least 144: .* forged"):
        parse(reseal(raw), "m.json")
    raw["files"][0]["bytes"] = 144
    parse(reseal(raw), "m.json")


def test_a_forged_global_shape_over_small_files_is_refused_before_anything_reads_it():
    m = golden_manifest()
    t = m.tensors[NORM]
    huge = replace(t, global_shape=(2**40,), shards=(replace(t.shards[0], shape=(2**40,)),))
    specs = tuple(TensorSpec(n, x.dtype, x.global_shape, x.role) for n, x in {**m.tensors, NORM: huge}.items())
    forged = replace(m, tensors={**m.tensors, NORM: huge},
                     layout_digest=StateLayout(specs, m.source_layout, m.buckets).digest())
    with pytest.raises(ManifestError, match=r"files\[1\].bytes': expected at least 2,199,023,255,600"):
        parse(forged.to_bytes(), "m.json")


def test_a_safetensors_piece_must_name_a_listed_file_and_rows_inside_its_shard():
    raw = raw_json()
    _shard(raw)["location"][0]["path"] = "step-000000010/unlisted.safetensors"
    with pytest.raises(ManifestError, match=r"location\[0\].path': expected a file listed in 'files'"):
        parse(reseal(raw), "m.json")
    raw = raw_json()
    raw["tensors"][W]["shards"][1]["location"][1]["rows"] = [2, 5]  # the shard has 4 rows
    with pytest.raises(ManifestError, match=r"location\[1\].rows': expected rows within the shard's 4"):
        parse(reseal(raw), "m.json")


def test_zarr_pieces_are_not_bounded_by_file_sizes():
    """A local-tier (zarr) array may be compressed, or sparse (all-fill chunks are not stored)."""
    raw = raw_json()
    for t in raw["tensors"].values():
        for s in t["shards"]:
            s["location"] = [{"path": f"step-000000010/{s['digest'][-4:]}"}]
    raw["files"] = [{"path": "step-000000010/zarr.json", "bytes": 10, "digest": "xxh3-128:" + "4" * 32}]
    parse(reseal(raw), "m.json")


def test_a_negative_file_size_is_refused():
    raw = raw_json()
    raw["files"][1]["bytes"] = -1
    with pytest.raises(ManifestError, match=r"files\[1\].bytes': expected a non-negative integer, found -1"):
        parse(reseal(raw), "m.json")


@pytest.mark.parametrize("raw,words", [
    ({"step": "abc", "manifest_digest": "sha256:" + "a" * 64}, "field 'step': expected a non-negative integer"),
    ({"step": 3, "manifest_digest": "md5:00"}, "field 'manifest_digest': expected a 'sha256:<64 hex digits>'"),
    ({"manifest_digest": "sha256:" + "a" * 64}, "field 'step': expected a non-negative integer, found '<missing>'"),
    ([3], "field '<root>': expected an object {step, manifest_digest}"),
])
def test_a_reference_read_from_a_file_is_checked_field_by_field(raw, words):
    with pytest.raises(ManifestError, match=re.escape(f"rec.json: {words}")):
        parse_ref(raw, "rec.json")
    assert parse_ref({"step": 3, "manifest_digest": "sha256:" + "a" * 64}, "rec.json") == ParentRef(3, "sha256:" + "a" * 64)


# ---- signing -------------------------------------------------------------------------
def test_a_signed_manifest_verifies_with_its_key_only():
    signed = golden_manifest().signed(b"secret")
    assert signed.signature_valid(b"secret")
    assert parse(signed.to_bytes(), "m").signature_valid(b"secret")
    assert not signed.signature_valid(b"other")
    assert not golden_manifest().signature_valid(b"secret")  # unsigned


@pytest.mark.parametrize(
    "alter",
    [
        lambda m: replace(m, scalars={**m.scalars, "optimizer_step": 11}),
        # files are outside the digest but inside the signature (dropping one whose pieces remain fails to parse)
        lambda m: replace(m, files=(m.files[0], replace(m.files[1], bytes=m.files[1].bytes + 1))),
        lambda m: replace(m, created_at="2025-01-02T03:04:05.678902Z"),
        lambda m: replace(m, signature={**m.signature, "alg": "hmac-md5"}),
    ],
    ids=["scalars", "files", "created_at", "alg"],
)
def test_an_altered_signed_manifest_fails_its_signature(alter):
    signed = golden_manifest().signed(b"secret")
    assert not alter(signed).signature_valid(b"secret")
    resealed = parse(reseal(json.loads(alter(signed).to_bytes())), "m")
    assert not resealed.signature_valid(b"secret")


def test_signing_does_not_mutate_the_manifest():
    m = golden_manifest()
    before = m.to_bytes()
    m.signed(b"k")
    assert m.to_bytes() == before and m.signature is None
