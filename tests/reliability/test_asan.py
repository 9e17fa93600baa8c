"""The native packet path under AddressSanitizer + UndefinedBehaviorSanitizer.

Builds ``native/mirror/*.cpp`` and ``native/flowcheck_native.cpp`` with ``-fsanitize=address,undefined``
into a temporary folder, then runs the capture fuzz corpus (the shared captures, structured mutations
of them, random bytes) through index_capture, parse, reassemble, the unpackers, the merges of final sends
(one and batched, on two threads) and whole decodes of the real captures with their jobs in a child Python
with ``LD_PRELOAD`` of gcc's libasan.  Any sanitizer report (out-of-bounds read, overflow, shift or
signed-overflow UB) fails the test with the report.  Each CRC32 path (table, PCLMULQDQ, VPCLMULQDQ folding, capped
by ``FLOWCHECK_CRC``) runs in a child of its own over exact-size buffers.  Skipped, saying why, without g++ or libasan.

Run alone: ``pytest tests/reliability/test_asan.py -s`` (``FLOWCHECK_ASAN_INPUTS`` sets the corpus size).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INPUTS = int(os.environ.get("FLOWCHECK_ASAN_INPUTS", "400"))
FLAGS = ["-O0", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
         "-std=c++17", "-shared", "-fPIC"]


def _libasan() -> str:
    gcc = shutil.which("gcc")
    if gcc is None or shutil.which("g++") is None:
        pytest.skip("g++/gcc not found: the sanitizer build needs them (apt-get install g++)")
    path = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.skip(f"gcc has no libasan ({path!r}): install libasan (Debian: libgcc-12-dev / libasan8)")
    # python itself does not link libstdc++: preloaded too, ASan can intercept the C++ throw of a ValueError
    cxx = subprocess.run(["g++", "-print-file-name=libstdc++.so"], capture_output=True, text=True, check=False).stdout.strip()
    return f"{path} {os.path.realpath(cxx)}" if os.path.isabs(cxx) else path


@pytest.fixture(scope="module")
def asan_build(tmp_path_factory):
    libasan = _libasan()
    import pybind11

    out = tmp_path_factory.mktemp("asan")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    includes = [f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}"]
    native = ROOT / "native"
    sources = {"_mirror": sorted(native.glob("mirror/*.cpp")), "_native": [native / "flowcheck_native.cpp"]}

    def run(cmd: list[str], what: str) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"sanitizer build of {what} failed:\n{proc.stderr[-4000:]}")

    # one object per source, compiled side by side (each parses the pybind11 headers), then one link per extension
    objects = {src: out / f"{name}-{src.stem}.o" for name, srcs in sources.items() for src in srcs}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda src: run(["g++", *FLAGS, *includes, "-c", str(src), "-o", str(objects[src])], src.name),
                      objects))
    for name, srcs in sources.items():
        run(["g++", *FLAGS, *(str(objects[s]) for s in srcs), "-o", str(out / f"{name}{suffix}")], name)
    return out, libasan


LOAD = textwrap.dedent('''
    import importlib.util, random, sys, glob, os
    build = sys.argv[1]
    for name in ("_mirror", "_native"):  # the sanitized builds stand in for the installed extensions
        path = glob.glob(os.path.join(build, name + ".*so"))[0]
        spec = importlib.util.spec_from_file_location("flowcheck." + name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["flowcheck." + name] = mod
        import flowcheck
        setattr(flowcheck, name, mod)
    import numpy as np
    from flowcheck import _mirror, _native
    assert "asan" in open("/proc/self/maps").read() and _mirror.__file__.startswith(build)
''')

CHILD = LOAD + textwrap.dedent('''
    n_inputs = int(sys.argv[2])
    from flowcheck.capture.mirror import roce
    from flowcheck.errors import FlowcheckError
    from tests.reliability import test_fuzz as tf
    from concurrent.futures import ThreadPoolExecutor

    def decode(data):
        try:
            path = tf.WORK / "asan.cap"
            path.write_bytes(data)
            frames = tf.read_capture(str(path))
            for icrc in (True, False):
                packets = roce.parse(frames, check_icrc=icrc)
            ra = roce.reassemble(frames, packets)
            ra2 = roce.reassemble(frames, packets, pmtu=256)
            ra3 = roce.reassemble(frames, packets, workers=3)  # whole streams on threads, tables concatenated
            assert ra3.segments.tobytes() == ra.segments.tobytes() and ra3.message_of.tobytes() == ra.message_of.tobytes()
            # parse and reassembly in one call, the demux on 3 parse threads (runs joined in capture order)
            table, offsets, lengths = roce._frame_columns(frames)
            _, fused = _mirror.parse_reassemble(frames.buf, offsets, lengths, table, False, 0, 3, 2)
            assert table.tobytes() == packets.table.tobytes() and fused["message_of"].tobytes() == ra.message_of.tobytes()
            out = np.zeros(1 << 16, np.uint8)
            wire = np.frombuffer(frames.buf, np.uint8)
            roce.segment_flags(wire, ra.segments)
            for m in range(min(len(ra.messages), 64)):
                segs = ra.segments_of(m)
                # the decoder's merge of a final send: odd shifts, flags, element counts and dtypes
                first = roce.segment_flags(wire, segs)
                for ll, dtype, n, shift, flag in (
                        (True, np.float32, 1024, 0, int(first[0]) if len(first) and first[0] >= 0 else None),
                        (True, np.uint16, 7, -16, None), (False, np.int32, 4096, 8, None),
                        (False, np.float32, 3, -(1 << 62), None), (True, np.float32, 1 << 14, (1 << 63) - 1, 1)):
                    data, copies = np.zeros(n, dtype), np.full(n, rng.choice((0, 1, 254, 255)), np.uint8)
                    try:
                        roce.merge_send(wire, [(segs, shift), (segs, 0)], flag, ll, data, copies)
                        counts["merges"] += 1
                    except (ValueError, FlowcheckError):
                        pass
                # the batched merge (merge_sends): overlapping and disjoint destinations in one call, two calls at
                # once on threads (as the assembler's workers run them), a bad job last (nothing merged)
                data, copies = np.zeros(2048, np.float32), np.zeros(2048, np.uint8)
                flag = int(first[0]) if len(first) and first[0] >= 0 else None
                jobs = [roce.merge_job(wire, [(segs, sh)], fl, ll, data[a:b], copies[a:b])
                        for a, b, sh, fl, ll in ((0, 1024, 0, flag, True), (512, 1536, 16, flag, True),
                                                 (1536, 2048, -8, None, False), (1536, 2047, 4, flag, False))]
                try:
                    with ThreadPoolExecutor(2) as pool:
                        list(pool.map(roce.merge_sends, [jobs[:2], jobs[2:]]))
                    counts["merges"] += 4
                    roce.merge_sends(jobs + [(wire, [(segs, 0)], 0, True, data, copies[:-1])])
                except (ValueError, FlowcheckError):
                    pass
                # the same merges as rows over the whole segments table (merge_rows), on two threads, then with a
                # row out of range last (nothing merged)
                a0 = int(ra.messages[m]["seg_start"])
                b0 = a0 + int(ra.messages[m]["n_segs"])
                fl = -1 if flag is None else flag
                rows = np.array([(a0, b0, 0, fl, 0, 1024), (a0, b0, 16, fl, 512, 1536), (a0, b0, -8, -1, 1536, 2048),
                                 (a0, b0, (1 << 63) - 1, fl, 1536, 2047)], np.int64)
                for ll in (True, False):
                    try:
                        with ThreadPoolExecutor(2) as pool:
                            list(pool.map(lambda r: roce.merge_rows(wire, ra.segments, r, ll, data, copies), [rows[:2], rows[2:]]))
                        counts["merges"] += 4
                        roce.merge_rows(wire, ra.segments, np.concatenate([rows, [(a0, len(ra.segments) + 1, 0, 0, 0, 1)]]),
                                        ll, data, copies)
                    except (ValueError, FlowcheckError):
                        pass
                for fn in (roce.ll_unpack, roce.ll128_unpack):
                    try:
                        fn(frames, segs, out)
                    except (ValueError, FlowcheckError):
                        pass
                try:
                    roce.simple_copy(frames, segs, out)
                except (ValueError, FlowcheckError):
                    pass
        except FlowcheckError:
            return "rejected"
        return "accepted"

    rng = random.Random(1234)
    counts = {"accepted": 0, "rejected": 0, "merges": 0}
    corpus = list(tf.SEED_CAPTURES)
    for p in sorted(glob.glob(str(tf.PCAPS / "*.pcapng"))):
        corpus.append(open(p, "rb").read())
    # hand-made edge cases: extreme pcapng time resolutions and offsets (128-bit/shift arithmetic)
    import struct
    from tests.mirror.test_pcap import block, epb, option, shb
    frame = bytes(range(64))
    for resol in (0, 9, 19, 127, 0x80, 0x80 | 63, 0x80 | 64, 0xFF):
        for offset in (0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1):
            opts = option(9, bytes([resol])) + option(14, struct.pack("<Q", offset)) + option(0, b"")
            idb = block(1, struct.pack("<HHI", 1, 0, 0) + opts)
            corpus.append(shb() + idb + epb(0, 2**64 - 1, frame) + epb(0, 0, frame))
    # whole decodes of the real captures with their jobs and of frame-edited copies, on 1 and 2 workers (the
    # threaded first pass and merge of final sends)
    counts["decodes"] = 0
    for name in tf.JOB_CAPTURES:
        raw = (tf.PCAPS / f"{name}.pcapng").read_bytes()
        for k in range(4):
            edits = [("frame", rng.random(), rng.randint(0, 95), rng.randint(0, 255)) for _ in range(k * 3)]
            try:
                tf._decode_with_job(name, tf._mutate_capture(raw, edits))
                counts["decodes"] += 1
            except FlowcheckError:
                pass
    runs = 0
    for data in corpus:
        counts[decode(data)] += 1; runs += 1
    kinds = ["flip", "u32", "truncate", "magic", "splice", "frame"]
    for i in range(n_inputs):
        seed = tf.SEED_CAPTURES[i % len(tf.SEED_CAPTURES)]
        edits = []
        for _ in range(rng.randint(1, 5)):
            k = rng.choice(kinds)
            r = rng.random
            if k == "flip": edits.append((k, r(), rng.randint(1, 255)))
            elif k == "u32": edits.append((k, r(), rng.choice([0, 1, 11, 12, 0xFFFFFFFF, 0x7FFFFFFF, rng.getrandbits(32)]), rng.choice([0, 4, 8, 12, 16, 20, 24, 28]), rng.random() < .5))
            elif k == "truncate": edits.append((k, r()))
            elif k == "magic": edits.append((k, rng.choice(tf.MAGICS), rng.choice([0, 8])))
            elif k == "splice": edits.append((k, r(), r(), rng.randint(1, 512)))
            else: edits.append((k, r(), rng.randint(0, 95), rng.randint(0, 255)))
        counts[decode(tf._mutate_capture(seed, edits))] += 1; runs += 1
        counts[decode(rng.choice(tf.MAGICS).to_bytes(4, "little") + rng.randbytes(rng.randint(0, 400)))] += 1; runs += 1
    # the live capture's PACKET_MMAP block copy: mutated TPACKET_V3 blocks (exact-size heap buffers), odd outputs
    from tests.mirror.test_packet_ring import make_block
    counts["ring_blocks"] = 0
    for i in range(max(200, n_inputs)):
        frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(0, 6))]
        block = make_block(frames, tags={0: 9}, outgoing={1}, size=rng.choice((4096, 8192)))
        for _ in range(rng.randint(0, 6)):
            at = rng.randrange(0, min(len(block), 64 + 400 * len(frames)))
            block[at] = rng.randint(0, 255)
        rows, size = rng.randint(0, 8), rng.choice((0, 15, 700, 5000))
        try:
            _mirror.ring_block(np.frombuffer(bytes(block), np.uint8).copy(), np.empty(size, np.uint8),
                               rng.randint(0, size), np.empty(rows, np.int64), np.empty(rows, np.int32),
                               np.empty(rows, np.int64), rng.randint(0, rows))
            counts["ring_blocks"] += 1
        except ValueError:
            pass
    # the other extension: writes and copies with odd sizes and offsets
    fd = os.open(str(tf.WORK / "asan.bin"), os.O_RDWR | os.O_CREAT)
    for size in (0, 1, 7, 4096, 65537):
        buf = np.frombuffer(rng.randbytes(size), np.uint8)
        _native.pwrite_all(fd, buf, rng.randint(0, 100), 4096)
        dst = np.empty(size, np.uint8)
        _native.copy_into(dst, buf, 3)
        assert dst.tobytes() == buf.tobytes()
        for bad in (np.empty(max(size - 1, 0), np.uint8), np.empty(size + 1, np.uint8)):
            try:
                _native.copy_into(bad, buf, 2)
            except (ValueError, TypeError):
                pass
    os.close(fd)
    print(f"ASAN-FUZZ inputs={runs} accepted={counts['accepted']} rejected={counts['rejected']} "
          f"merges={counts['merges']} decodes={counts['decodes']} ring_blocks={counts['ring_blocks']} crashes=0")
''')


# Every CRC32 path ($FLOWCHECK_CRC, read at import) over exact-size heap buffers, so that a fold reading past the end
# is an ASan report: every length to 600 and larger ones at misaligned starts, then the ICRC of exact-size frames of
# every payload length and of their truncations (lengths that lie about the frame).
CRC_CHILD = LOAD + textwrap.dedent('''
    import zlib
    from flowcheck.capture.mirror.frames import Endpoint, Opcode, roce_frame
    if _mirror.crc_path() != sys.argv[2]:
        print("ASAN-CRC path=" + _mirror.crc_path()); sys.exit(0)
    rng = random.Random(5)
    exact = lambda b: np.frombuffer(b, np.uint8).copy()  # a heap buffer of exactly len(b) bytes
    for n in [*range(0, 601), 1024, 4096, 9000, 1 << 20]:
        for start in (0, 1, 3):
            data = exact(rng.randbytes(n + start))[start:]
            assert _mirror.crc32(data, n) == zlib.crc32(data, n), (n, start)
    v4 = (Endpoint("02:00:00:00:00:01", "10.0.0.1", vlan=7), Endpoint("02:00:00:00:00:02", "10.0.0.2", vlan=7))
    v6 = (Endpoint("0c:42:a1:9f:58:f8", "fe80::e42:a1ff:fe9f:58f8"),
          Endpoint("08:c0:eb:8c:28:2c", "fe80::ac0:ebff:fe8c:282c"))
    frames = 0
    for src, dst in (v4, v6):
        for n in range(0, 1101, 3):
            for op in (Opcode.WRITE_ONLY, Opcode.WRITE_MIDDLE, Opcode.WRITE_LAST_IMM):
                f = roce_frame(src, dst, sport=7, opcode=op, dqpn=5, psn=n, payload=rng.randbytes(n), va=64, imm=n)
                assert _mirror.frame_icrc(exact(f)) == int.from_bytes(f[-4:], "little")
                _mirror.frame_icrc(exact(f[:rng.randrange(len(f))]))
                frames += 1
    print(f"ASAN-CRC path={_mirror.crc_path()} frames={frames}")
''')


def _sanitized(asan_build, code: str, *args: str, **env_vars: str) -> str:
    """Run code in a child Python on the sanitized build; its stdout, after failing on any sanitizer report."""
    build, libasan = asan_build
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=libasan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86:allocator_may_return_null=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87",
        PYTHONPATH=str(ROOT),
        **env_vars,
    )
    proc = subprocess.run([sys.executable, "-c", code, str(build), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    report = proc.stderr[-6000:]
    assert "AddressSanitizer" not in proc.stderr and "runtime error:" not in proc.stderr, report
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{report}"
    return proc.stdout


def test_native_packet_path_is_clean_under_address_and_ub_sanitizers(asan_build):
    from tests.reliability import test_fuzz as tf

    if not tf.SEED_CAPTURES:  # a checkout without ../shared beside it (CI has it): no seeds to mutate
        pytest.skip(f"the shared real captures are missing ({tf.PCAPS}): the fuzz corpus needs them")
    stdout = _sanitized(asan_build, CHILD, str(INPUTS))
    line = [x for x in stdout.splitlines() if x.startswith("ASAN-FUZZ")]
    assert line, stdout[-2000:]
    assert int(line[0].split("merges=")[1].split()[0]) > 0, line[0]  # the decoder's native merge ran too
    assert int(line[0].split("ring_blocks=")[1].split()[0]) > 0, line[0]  # and the live ring's block copy
    print("\n" + line[0])


@pytest.mark.parametrize("path", ["table", "pclmul", "vpclmul"])
def test_every_crc32_path_reads_only_its_buffer_under_sanitizers(asan_build, path):
    stdout = _sanitized(asan_build, CRC_CHILD, path, FLOWCHECK_CRC=path)
    line = [x for x in stdout.splitlines() if x.startswith("ASAN-CRC")]
    assert line, stdout[-2000:]
    if f"path={path} " not in line[0] + " ":
        pytest.skip(f"this CPU lacks {path}: {line[0]}")
    print("\n" + line[0])
