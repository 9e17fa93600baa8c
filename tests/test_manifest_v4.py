"""Manifest v4 (incremental steps): a shard's piece may reference an earlier step that holds its bytes."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from flowcheck.errors import ManifestError
from flowcheck.manifest import INCREMENTAL_VERSION, FileEntry, Piece, StepRef, parse
from tests.test_manifest import GOLDEN_DIGEST, NORM, W, _hex, golden_packed_manifest, reseal

GOLDEN_V4 = Path(__file__).parent / "golden" / "manifest_v4.json"
HOLDER = StepRef("main", 5, "sha256:" + _hex("a", 64), (
    FileEntry("step-000000005/packs/0/c/0", 65560, "xxh3-128:" + _hex("9", 32)),
    FileEntry("step-000000005/packs/0/zarr.json", 500, "xxh3-128:" + _hex("b", 32)),
))


def golden_incremental_manifest():
    """The golden state with its float32 shards unchanged since step 5 (the parent), which holds them; only the
    bf16 shard was written by step 10 itself."""
    m = golden_packed_manifest()
    w = m.tensors[W]
    ref = "step-000000005/packs/0"
    return replace(
        m,
        format_version=INCREMENTAL_VERSION,
        tensors={**m.tensors, W: replace(w, shards=(
            replace(w.shards[0], location=(Piece(ref, start=0, ref=0),)),
            replace(w.shards[1], location=(Piece(ref, start=24, ref=0),)),
        ))},
        files=tuple(f for f in m.files if "/packs/0/" not in f.path),
        refs=(HOLDER,),
    )


def test_incremental_manifest_bytes_match_the_golden_v4_file():
    assert golden_incremental_manifest().to_bytes() == GOLDEN_V4.read_bytes()
    assert parse(GOLDEN_V4.read_bytes(), str(GOLDEN_V4)) == golden_incremental_manifest()
    raw = json.loads(GOLDEN_V4.read_bytes())
    assert raw["format_version"] == 4
    assert raw["tensors"][W]["shards"][1]["location"] == [{"path": "step-000000005/packs/0", "start": 24, "ref": 0}]
    assert raw["refs"][0]["branch"] == "main" and raw["refs"][0]["step"] == 5


def test_an_incremental_manifest_has_the_digest_of_the_same_state_in_v1():
    assert golden_incremental_manifest().digest() == GOLDEN_DIGEST


def test_files_list_only_what_the_step_wrote():
    m = golden_incremental_manifest()
    assert all(f.path.startswith("step-000000010/") for f in m.files)
    assert m.referenced_nbytes == 65560 + 500


def raw_v4() -> dict:
    return json.loads(golden_incremental_manifest().to_bytes())


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.pop("refs"), "refs"),  # a ref index with no refs
    (lambda r: r.update(refs=[]), "refs"),
    (lambda r: r["refs"][0].update(branch="../x"), "refs[0].branch"),
    (lambda r: r["refs"][0].update(step=6), "path"),  # the piece's path is not inside step 6's folder
    (lambda r: r["refs"][0]["files"][0].update(path="../../etc/passwd"), "refs[0].files[0].path"),
    (lambda r: r["tensors"][W]["shards"][0]["location"][0].update(ref=3), ".ref"),
    (lambda r: r["tensors"][W]["shards"][0]["location"][0].pop("start"), ".ref"),
    (lambda r: r["tensors"][W]["shards"][0]["location"][0].update(path="step-000000005/../../x"), "path"),
    (lambda r: r["refs"].append(dict(r["refs"][0], step=4)), "refs"),  # a ref nothing uses
])
def test_bad_references_are_refused_naming_the_field(edit, field):
    raw = raw_v4()
    edit(raw)
    with pytest.raises(ManifestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse(reseal(raw), "m.json")


def test_references_only_in_v4():
    raw = raw_v4()
    raw["format_version"] = 3
    with pytest.raises(ManifestError, match="ref"):
        parse(reseal(raw), "m.json")
    packed = json.loads(golden_packed_manifest().to_bytes())
    packed["refs"] = raw["refs"]
    with pytest.raises(ManifestError, match="refs"):
        parse(reseal(packed), "m.json")


def test_v4_bf16_piece_still_its_own():
    m = golden_incremental_manifest()
    assert m.tensors[NORM].shards[0].location[0].ref is None
