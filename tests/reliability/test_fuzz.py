"""Bad input fuzzing: structured mutations of real inputs reach every reader, and only FlowcheckErrors escape.

Targets: pcap/pcapng capture index + RoCE parse + reassembly (native), manifest parse + tier reads,
safetensors header reader, zarr array metadata (zarr.json) on the local tier's read path, job and
config YAML, CLI argument vectors.  Each example is counted per target (inputs run, rejected with a
FlowcheckError, accepted, crashes); the table prints at the end of the module (``pytest -s``) and is
written as JSON to ``$FLOWCHECK_FUZZ_REPORT`` when set.

The default run is derandomized and bounded (``FLOWCHECK_FUZZ_EXAMPLES``, default 120 per target) so
it stays a CI test; raise the variable for a longer campaign.  A watchdog kills the process if one
test hangs (native code does not come back to Python for a deadline to fire).
"""
from __future__ import annotations

import copy
import faulthandler
import json
import os
import shutil
import struct
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowcheck import _mirror
from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.pcap import PcapWriter, read_capture
from flowcheck.config import load as load_config
from flowcheck.errors import FlowcheckError
from flowcheck.manifest import canonical_json, parse as parse_manifest
from flowcheck.digest import sha256
from flowcheck.tiers import safetensors_io as stio

ROOT = Path(__file__).resolve().parents[2]
PCAPS = ROOT / ".." / "shared" / "data" / "pcaps"
EXAMPLES = int(os.environ.get("FLOWCHECK_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    derandomize=True,  # the same inputs on every run: CI failures reproduce
    database=None,
    max_examples=EXAMPLES,
    deadline=5000,  # ms per example: generous for 2 shared cores, still catches a pathological path
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture, HealthCheck.large_base_example],
)
STATS: dict[str, Counter] = defaultdict(Counter)
WORK = Path(tempfile.mkdtemp(prefix="flowcheck-fuzz-"))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    lines = [f"{'target':<12} {'inputs':>7} {'rejected':>9} {'accepted':>9} {'crashes':>8}"]
    for name, c in sorted(STATS.items()):
        lines.append(f"{name:<12} {c['inputs']:>7} {c['rejected']:>9} {c['accepted']:>9} {c['crashes']:>8}")
    print("\nfuzz summary (inputs run / rejected with a FlowcheckError / accepted / crashes):\n" + "\n".join(lines))
    out = os.environ.get("FLOWCHECK_FUZZ_REPORT")
    if out:
        Path(out).write_text(json.dumps({k: dict(v) for k, v in STATS.items()}, indent=2))
    shutil.rmtree(WORK, ignore_errors=True)


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(600, exit=True)  # a hang fails CI loudly instead of stalling it
    yield
    faulthandler.cancel_dump_traceback_later()


def run_target(target: str, fn) -> object:
    """Run one fuzz input: a FlowcheckError is a clean rejection; anything else is a crash (re-raised)."""
    STATS[target]["inputs"] += 1
    try:
        out = fn()
    except FlowcheckError:
        STATS[target]["rejected"] += 1
        return None
    except BaseException:
        STATS[target]["crashes"] += 1
        raise
    STATS[target]["accepted"] += 1
    return out


# ---- pcap / pcapng -------------------------------------------------------------------------------
def _pcapng_blocks(data: bytes) -> list[int]:
    """Start offsets of the blocks of a little-endian pcapng file."""
    pos, out = 0, []
    while pos + 12 <= len(data):
        out.append(pos)
        (n,) = struct.unpack_from("<I", data, pos + 4)
        if n < 12:
            break
        pos += n
    return out


def _seed_captures() -> list[bytes]:
    seeds = []
    for name in ("rdma32", "iter_80000", "allreduce+p2p"):
        path = PCAPS / f"{name}.pcapng"
        if not path.exists():
            continue
        data = path.read_bytes()
        starts = [s for s in _pcapng_blocks(data) if s <= 24 << 10]
        seeds.append(data[: starts[-1]])  # a prefix cut at a block boundary: small and still valid
    if seeds:
        frames = read_capture(str(PCAPS / "rdma32.pcapng"))
        for nano in (True, False):
            path = WORK / f"seed-{nano}.pcap"
            with PcapWriter(str(path), nanosecond=nano) as w:
                for i in range(min(len(frames), 24)):
                    w.write(frames.frame(i), int(frames.ts_ns[i]))
            raw = path.read_bytes()
            seeds.append(raw)
            seeds.append(_swap_pcap(raw))
    return seeds


def _swap_pcap(raw: bytes) -> bytes:
    """The same classic pcap written big-endian (the other byte order a reader must accept)."""
    head = struct.unpack_from("<IHHiIII", raw)
    out = [struct.pack(">IHHiIII", *head)]
    pos = 24
    while pos + 16 <= len(raw):
        rec = struct.unpack_from("<IIII", raw, pos)
        out.append(struct.pack(">IIII", *rec) + raw[pos + 16: pos + 16 + rec[2]])
        pos += 16 + rec[2]
    return b"".join(out)


SEED_CAPTURES = _seed_captures()
U32 = st.sampled_from([0, 1, 3, 4, 11, 12, 13, 28, 0x7FFFFFFF, 0x80000000, 0xFFFFFFF0, 0xFFFFFFFF]) | st.integers(0, 2**32 - 1)
MAGICS = [0x0A0D0D0A, 0x1A2B3C4D, 0x4D3C2B1A, 0xA1B2C3D4, 0xD4C3B2A1, 0xA1B23C4D, 0x4D3CB2A1, 0]

capture_edit = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("u32"), st.floats(0, 1), U32, st.sampled_from([0, 4, 8, 12, 16, 20, 24, 28]), st.booleans()),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("magic"), st.sampled_from(MAGICS), st.sampled_from([0, 8])),
    st.tuples(st.just("splice"), st.floats(0, 1), st.floats(0, 1), st.integers(1, 512)),
    st.tuples(st.just("frame"), st.floats(0, 1), st.integers(0, 95), st.integers(0, 255)),
)


def _mutate_capture(data: bytes, edits) -> bytes:
    buf = bytearray(data)
    for edit in edits:
        if not buf:
            break
        kind = edit[0]
        if kind == "flip":
            i = int(edit[1] * (len(buf) - 1))
            buf[i] ^= edit[2]
        elif kind == "u32":  # a header or length field of a block/record, in either byte order
            starts = _pcapng_blocks(bytes(buf)) if buf[:4] == b"\n\r\r\n" else list(range(0, len(buf), 16))
            at = starts[int(edit[1] * (len(starts) - 1))] + edit[3]
            if at + 4 <= len(buf):
                buf[at:at + 4] = struct.pack("<I" if edit[4] else ">I", edit[2])
        elif kind == "truncate":
            del buf[int(edit[1] * len(buf)):]
        elif kind == "magic":
            if len(buf) >= edit[2] + 4:
                buf[edit[2]:edit[2] + 4] = struct.pack("<I", edit[1])
        elif kind == "splice":
            a = int(edit[1] * len(buf))
            b = int(edit[2] * len(buf))
            buf[b:b] = buf[a:a + edit[3]]
        elif kind == "frame":  # a byte of a frame's headers (L2..BTH, extension headers): reaches the parser
            try:
                frames = roce_frames_of(bytes(buf))
            except FlowcheckError:
                continue
            if len(frames):
                i = int(edit[1] * (len(frames) - 1))
                at = int(frames.offsets[i]) + min(edit[2], max(int(frames.lengths[i]) - 1, 0))
                if at < len(buf):
                    buf[at] = edit[3]
    return bytes(buf)


def roce_frames_of(data: bytes):
    path = WORK / "probe.cap"
    path.write_bytes(data)
    return read_capture(str(path))


def _decode_capture(data: bytes, check_icrc: bool) -> None:
    path = WORK / "fuzz.cap"
    path.write_bytes(data)
    frames = read_capture(str(path))
    size = len(frames.buf)
    assert np.all(frames.offsets >= 0) and np.all(frames.lengths >= 0)
    assert np.all(frames.offsets + frames.lengths <= size), "a frame indexed outside the file"
    packets = roce.parse(frames, check_icrc=check_icrc)
    ok = packets.table["status"] == 0
    end = packets.table["payload_off"][ok] + packets.table["payload_len"][ok]
    assert np.all(end <= size), "a payload placed outside the file"
    want = roce.reassemble(frames, packets)
    table, offsets, lengths = roce._frame_columns(frames)  # noqa: SLF001 - the fused call on 3 runs, however small
    _, got = _mirror.parse_reassemble(frames.buf, offsets, lengths, table, check_icrc, 0, 3, 2)
    assert table.tobytes() == packets.table.tobytes(), "the fused parse wrote another table"
    assert np.array_equal(got["stream_of"], want.stream_of) and np.array_equal(got["message_of"], want.message_of), \
        "the fused parse demultiplexed otherwise"


@pytest.mark.skipif(not SEED_CAPTURES, reason="shared captures not found at ../shared/data/pcaps")
@FUZZ
@given(seed=st.integers(0, 10**6), edits=st.lists(capture_edit, min_size=1, max_size=5), check_icrc=st.booleans())
def test_fuzz_capture_files_only_raise_capture_errors(seed, edits, check_icrc):
    data = _mutate_capture(SEED_CAPTURES[seed % len(SEED_CAPTURES)], edits)
    run_target("pcap", lambda: _decode_capture(data, check_icrc))


def _decode_with_job(name: str, data: bytes) -> None:
    """The whole decode of a mutated shared capture with its job (reaches the merge of final sends): one worker and
    two (threaded first pass and merge) give the same report and vectors."""
    from flowcheck.capture.mirror.decode import Decoded, decode, report
    from flowcheck.capture.mirror.job import load_job

    path = WORK / "fuzz-job.cap"
    path.write_bytes(data)
    frames = read_capture(str(path))
    job = load_job(str(ROOT / "tests" / "data" / "jobs" / f"{name}.yaml"))
    outs = []
    for workers in (1, 2):
        info = Decoded()
        ars = list(decode(job, frames, info, workers=workers))
        outs.append((json.dumps(report(ars, info), sort_keys=True, default=str),
                     [(a.data.tobytes(), a.copies.tobytes()) for a in ars]))
    assert outs[0] == outs[1], "decode output depends on the number of workers"


JOB_CAPTURES = sorted(p.stem for p in PCAPS.glob("*.pcapng") if (ROOT / "tests" / "data" / "jobs" / f"{p.stem}.yaml").exists())


@pytest.mark.skipif(not JOB_CAPTURES, reason="shared captures not found at ../shared/data/pcaps")
@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))  # a whole decode per example, twice
@given(which=st.integers(0, 10**6), edits=st.lists(  # frame header bytes: the file stays readable, the decoder is reached
    st.tuples(st.just("frame"), st.floats(0, 1), st.integers(0, 95), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_decode_with_job_only_raises_capture_errors_and_ignores_workers(which, edits):
    name = JOB_CAPTURES[which % len(JOB_CAPTURES)]
    data = _mutate_capture((PCAPS / f"{name}.pcapng").read_bytes(), edits)
    run_target("decode-job", lambda: _decode_with_job(name, data))


@FUZZ
@given(head=st.sampled_from(MAGICS), body=st.binary(max_size=600))
def test_fuzz_capture_random_bytes_after_a_magic(head, body):
    data = struct.pack("<I", head) + body
    run_target("pcap-raw", lambda: _decode_capture(data, True))


# ---- manifests -------------------------------------------------------------------------------------
def _make_store(root: Path):
    from tests.helpers import make_snapshot
    from tests.test_store import make_store

    store = make_store(root, local_keep=5, object_keep=5)
    store.push(make_snapshot(step=10))
    store.snapshot()
    store.promote(10)
    return store


STORE_DIR = WORK / "store"
STORE = _make_store(STORE_DIR)
LOCAL_MANIFEST = STORE_DIR / "local" / "r1" / "step-000000010" / "manifest.json"
OBJECT_MANIFEST = STORE_DIR / "object" / "r1" / "step-000000010" / "manifest.json"
SEED_MANIFESTS = [LOCAL_MANIFEST.read_bytes(), OBJECT_MANIFEST.read_bytes()]

WEIRD = st.sampled_from([
    None, True, False, 0, -1, 1.5, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30), "", "x", "../../x", "/etc/passwd",
    "a\x00b", "a\\b", "./x", "é", "\ud7ff", "0" * 5000, [], [1, 2], [-1, 5], [2**62, 2**62], {}, {"a": 1},
    [[[[[[[]]]]]]], "xxh3-128:" + "0" * 32, "sha256:" + "g" * 64,
])


def _paths(obj, prefix=()):
    """Every (container, key) pair in a JSON tree: the places a mutation may hit."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _mutate_json(obj, edits):
    obj = copy.deepcopy(obj)
    for pick, op, value in edits:
        paths = list(_paths(obj))
        if not paths:
            break
        path = paths[int(pick * (len(paths) - 1))]
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if op == "delete":
            del parent[key]
        elif op == "set":
            parent[key] = copy.deepcopy(value)
        elif op == "rename" and isinstance(parent, dict):
            parent[str(value) if not isinstance(value, str) else value] = parent.pop(key)
        elif op == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        elif op == "wrap":
            parent[key] = [parent[key]]
    return obj


json_edit = st.tuples(st.floats(0, 1), st.sampled_from(["delete", "set", "set", "set", "rename", "dup", "wrap"]), WEIRD)


def _seal(obj) -> bytes:
    """A mutated manifest with its integrity recomputed: gets past the digest to the field checks."""
    body = {k: v for k, v in obj.items() if k != "integrity"} if isinstance(obj, dict) else obj
    if isinstance(body, dict):
        try:  # a consistent layout digest too, so tensor edits reach the readers
            body["layout_digest"] = parse_manifest(json.dumps(body).encode(), "seal", verify_integrity=False).layout().digest()
        except FlowcheckError:
            pass
        try:
            body["integrity"] = sha256(canonical_json(body))
        except (ValueError, TypeError):
            pass
    try:
        return canonical_json(body) + b"\n"
    except (ValueError, TypeError):
        return json.dumps(body).encode()


def _exercise_manifest(raw: bytes, which: int) -> None:
    m = parse_manifest(raw, "fuzz manifest.json")
    m.digest(), m.layout(), m.to_bytes(), m.signature_valid(b"k" * 32)
    tier = STORE.local if which == 0 else STORE.object
    path = LOCAL_MANIFEST if which == 0 else OBJECT_MANIFEST
    original = SEED_MANIFESTS[which]
    path.write_bytes(raw)
    try:
        tier._manifest_cache.clear()
        if hasattr(tier, "_headers"):
            tier._headers.clear()
        tier.verify(10)
        snap = tier.load(10)
        for name in list(m.tensors)[:4]:
            tier.read(10, name)
        snap.scalars  # noqa: B018
    finally:
        path.write_bytes(original)
        tier._manifest_cache.clear()


@FUZZ
@given(which=st.integers(0, 1), edits=st.lists(json_edit, min_size=1, max_size=4), seal=st.booleans())
def test_fuzz_manifest_fields_only_raise_flowcheck_errors(which, edits, seal):
    obj = _mutate_json(json.loads(SEED_MANIFESTS[which]), edits)
    raw = _seal(obj) if seal else json.dumps(obj).encode()
    run_target("manifest", lambda: _exercise_manifest(raw, which))


@FUZZ
@given(which=st.integers(0, 1), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), min_size=1, max_size=4),
       cut=st.none() | st.floats(0, 1))
def test_fuzz_manifest_bytes_only_raise_flowcheck_errors(which, flips, cut):
    raw = bytearray(SEED_MANIFESTS[which])
    for at, x in flips:
        raw[int(at * (len(raw) - 1))] ^= x
    if cut is not None:
        del raw[int(cut * len(raw)):]
    run_target("manifest-raw", lambda: _exercise_manifest(bytes(raw), which))


# ---- safetensors headers ---------------------------------------------------------------------------
def _bounded_reader(data: bytes):
    def read(a: int, b: int) -> bytes:
        assert 0 <= a <= b <= len(data), f"read [{a}, {b}) outside a {len(data)}-byte file"
        return data[a:b]
    return read


SAFETENSORS_SEED = (STORE_DIR / "object" / "r1" / STORE.object.manifest(10).files[0].path).read_bytes()
ST_WEIRD = st.sampled_from([
    [0, 2**64], [2**63, 2**63 + 4], [8, 4], [0, 0], [-4, 4], [0, 10**20], [1.0, 2.0], "F32", "BF16", "I8",
    "Q4", None, [2**40, 2**40], [0], [3, -1], [10**12] * 3, {}, [], "x",
])
st_edit = st.tuples(st.floats(0, 1), st.sampled_from(["delete", "set", "set", "set", "dup", "rename"]), WEIRD | ST_WEIRD)


def _safetensors_file(header: dict, data: bytes, length: int | None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


@FUZZ
@given(edits=st.lists(st_edit, min_size=0, max_size=4),
       length=st.none() | st.sampled_from([0, 1, 2**63, 2**64 - 1, 100 << 20, (100 << 20) + 1]) | st.integers(0, 4096),
       cut=st.none() | st.floats(0, 1), overlap=st.booleans())
def test_fuzz_safetensors_header_only_raises_format_errors(edits, length, cut, overlap):
    (n,) = struct.unpack_from("<Q", SAFETENSORS_SEED)
    header = json.loads(SAFETENSORS_SEED[8:8 + n])
    data = SAFETENSORS_SEED[8 + n:]
    if overlap:  # the second tensor starts inside the first
        keys = [k for k in header if k != "__metadata__"]
        if len(keys) >= 2:
            b0, e0 = header[keys[0]]["data_offsets"]
            size = header[keys[1]]["data_offsets"][1] - header[keys[1]]["data_offsets"][0]
            header[keys[1]]["data_offsets"] = [b0 + 1, b0 + 1 + size]
    header = _mutate_json(header, edits)
    blob = _safetensors_file(header, data, length)
    if cut is not None:
        blob = blob[: int(cut * len(blob))]

    def go():
        h = stio.parse_header(_bounded_reader(blob), len(blob), "fuzz.safetensors")
        spans = sorted((t.begin, t.end) for t in h.tensors.values() if t.end > t.begin)
        assert all(b >= e for (_, e), (b, _) in zip(spans, spans[1:])), "overlapping tensors accepted"
        assert all(h.data_start + t.end <= len(blob) for t in h.tensors.values()), "tensor beyond the file accepted"

    run_target("safetensors", go)


# ---- zarr metadata (zarr.json) on the local tier's read path ---------------------------------------
ZARR_ARRAYS = sorted(p for p in (STORE_DIR / "local" / "r1" / "step-000000010").glob("*/*/zarr.json"))
ZARR_SEEDS = {p: p.read_bytes() for p in ZARR_ARRAYS}
ZARR_WEIRD = st.sampled_from([
    [0], [2**40], [2**62, 2**62], [-1], [1, 0], "float64", "int4", "<f4", {"name": "bytes"}, [{"name": "gzip"}],
    {"name": "regular", "configuration": {"chunk_shape": [0]}}, "end", "start", 0, 2**70,
])
zarr_edit = st.tuples(st.floats(0, 1), st.sampled_from(["delete", "set", "set", "set", "dup", "wrap"]), WEIRD | ZARR_WEIRD)


def _read_local_with(path: Path, raw: bytes) -> None:
    original = ZARR_SEEDS[path]
    path.write_bytes(raw)
    try:
        tensor = path.parent.parent.name
        m = STORE.local.manifest(10)
        STORE.local.read(10, tensor)
        for entry in m.tensors[tensor].shards:
            STORE.local.read_shard(m, tensor, entry)
    finally:
        path.write_bytes(original)


@pytest.mark.skipif(not ZARR_ARRAYS, reason="no zarr arrays in the seed step")
@FUZZ
@given(which=st.integers(0, 10**6), edits=st.lists(zarr_edit, min_size=1, max_size=4), raw_flip=st.none() | st.floats(0, 1))
def test_fuzz_zarr_metadata_only_raises_flowcheck_errors(which, edits, raw_flip):
    path = ZARR_ARRAYS[which % len(ZARR_ARRAYS)]
    obj = _mutate_json(json.loads(ZARR_SEEDS[path]), edits)
    raw = bytearray(json.dumps(obj).encode())
    if raw_flip is not None:
        raw[int(raw_flip * (len(raw) - 1))] ^= 0x20
    run_target("zarr.json", lambda: _read_local_with(path, bytes(raw)))


# ---- job and config YAML ---------------------------------------------------------------------------
JOB_SEEDS = [p.read_text() for p in sorted((ROOT / "tests" / "data" / "jobs").glob("*.yaml"))] + [
    (ROOT / "configs" / "mirror-job.yaml").read_text()]
CONFIG_SEEDS = [(ROOT / "configs" / n).read_text() for n in ("hourly.yaml", "node.yaml", "cluster-node.yaml")]
YAML_TEXT = st.sampled_from([
    "!!python/object/apply:os.system ['true']", "&a [*a]", "{", "- - -", "? [a]: b", "a: !!binary AAAA", "\t",
    "x: 1e999", "x: .nan", "x: 0x10", "x: 2001-01-01", "&x a: *x", "\x00", "---\n---", "",
])
yaml_edit = st.one_of(
    st.tuples(st.just("json"), st.lists(st.tuples(st.floats(0, 1), st.sampled_from(["delete", "set", "set", "rename", "dup", "wrap"]),
                                                   WEIRD | ST_WEIRD), min_size=1, max_size=3)),
    st.tuples(st.just("text"), st.floats(0, 1), YAML_TEXT),
)


def _mutate_yaml(text: str, edit) -> str:
    if edit[0] == "json":
        return yaml.safe_dump(_mutate_json(yaml.safe_load(text), edit[1]), allow_unicode=True)
    at = int(edit[1] * len(text))
    return text[:at] + edit[2] + text[at:]


@FUZZ
@given(which=st.integers(0, 10**6), edit=yaml_edit)
def test_fuzz_job_yaml_only_raises_job_errors(which, edit):
    path = WORK / "job.yaml"
    path.write_text(_mutate_yaml(JOB_SEEDS[which % len(JOB_SEEDS)], edit))
    run_target("job.yaml", lambda: load_job(str(path)))


@FUZZ
@given(which=st.integers(0, 10**6), edit=yaml_edit)
def test_fuzz_config_yaml_only_raises_config_errors(which, edit):
    path = WORK / "config.yaml"
    path.write_text(_mutate_yaml(CONFIG_SEEDS[which % len(CONFIG_SEEDS)], edit))
    run_target("config.yaml", lambda: load_config(str(path)))


# ---- CLI arguments ---------------------------------------------------------------------------------
CLI_CONFIG = WORK / "cli.yaml"
CLI_CONFIG.write_text(yaml.safe_dump({
    "run": "r1",
    "tiers": {"local": {"root": str(STORE_DIR / "local")}, "object": {"url": f"file://{STORE_DIR / 'object'}", "max_file_mib": 1}},
}))
COMMANDS = ["ls", "show", "diff", "promote", "export", "restore", "audit", "lineage", "gc", "import", "snapshot", "plan"]
OPTIONS = ["--step", "--tier", "--to", "--run", "--format", "--from", "--tp", "--pp", "--vpp", "--dtype", "--against",
           "--state", "--arch", "--workers", "--layer-spec"]
FLAGS = ["--json", "--verify", "--no-optim", "--dry-run", "--no-data", "--force", "--trust-pickle"]
# paths stay relative: the runner works in a scratch folder, and --out always comes last (into it)
VALUES = ["10", "latest", "-1", "0", "99999999999999999999", "abc", "../x", "x/../..", "local", "object",
          "memory", "json", "dot", "torch", "safetensors", "bf16", "", "1e3", "r1", "../r1", "r1/../..", "\u00e9"]


@FUZZ
@given(cmd=st.sampled_from(COMMANDS),
       pairs=st.lists(st.tuples(st.sampled_from(OPTIONS), st.sampled_from(VALUES)) | st.tuples(st.sampled_from(FLAGS)), max_size=5),
       step=st.sampled_from([[], ["--step", "10"], ["--step", "latest"]]), positional=st.lists(st.sampled_from(VALUES), max_size=1))
def test_fuzz_cli_arguments_exit_cleanly(cmd, pairs, step, positional):
    from click.testing import CliRunner

    from flowcheck.cli import main

    scratch = WORK / "cli-out" / "a" / "b"
    scratch.mkdir(parents=True, exist_ok=True)
    args = [a for pair in pairs for a in pair] + step + positional
    argv = ["--no-progress", cmd, "--config", str(CLI_CONFIG), *args, "--out", str(scratch / "out")]

    def go():
        cwd = os.getcwd()
        os.chdir(scratch)
        try:
            result = CliRunner().invoke(main, argv, catch_exceptions=True)
        finally:
            os.chdir(cwd)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        if result.exit_code not in (0, 1, 2):
            raise AssertionError(f"exit {result.exit_code}: {result.output}")
        shutil.rmtree(WORK / "cli-out", ignore_errors=True)
        if result.exit_code:  # a usage error (click) or a FlowcheckError printed as one line
            raise FlowcheckError(result.output)

    run_target("cli", go)
    assert STORE.local.steps() == [10] and STORE.object.steps() == [10], "a fuzzed CLI call removed a stored step"
