"""libFuzzer (atheris) harness over the capture reader and the RoCE parser: any exception but a FlowcheckError is a crash.

Coverage-guided where test_fuzz.py is Hypothesis-driven: libFuzzer mutates the inputs that reach new
Python branches of flowcheck.capture (the native block walker and parser are exercised, not instrumented).
Seeds are prefixes of the shared captures (../shared/data/pcaps) and small classic pcaps written here, so
the fuzzer starts past the magic numbers.  atheris is optional (``pip install -e .[fuzz]``); CI runs a short
bounded pass through tests/reliability/test_fuzz_atheris.py.

    python tests/reliability/fuzz_atheris_pcap.py -runs=100000
    python tests/reliability/fuzz_atheris_pcap.py my-corpus/ -max_total_time=600   # keep what it finds

A crash prints the traceback and writes the input to ./crash-<sha1> (replay: pass that file as the argument).
"""
from __future__ import annotations

import struct
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["flowcheck.capture"]):
    import numpy as np

    from flowcheck import _mirror
    from flowcheck.capture.mirror import roce
    from flowcheck.capture.mirror.pcap import PcapWriter, read_capture
    from flowcheck.errors import FlowcheckError

ROOT = Path(__file__).resolve().parents[2]
PCAPS = ROOT / ".." / "shared" / "data" / "pcaps"
# one file rewritten per input: read_capture takes a path (it memory-maps the file)
WORK = Path(tempfile.mkdtemp(prefix="fc-atheris-"))  # $TMPDIR: the bounded test points it at its own tmp folder
INPUT = WORK / "input.cap"


def decode(data: bytes) -> None:
    """Read, index, parse and reassemble one capture; check that nothing points outside the file."""
    INPUT.write_bytes(data)
    try:
        frames = read_capture(str(INPUT))
        size = len(frames.buf)
        if not (np.all(frames.offsets >= 0) and np.all(frames.offsets + frames.lengths <= size)):
            raise AssertionError("a frame indexed outside the file")
        for check_icrc in (True, False):
            packets = roce.parse(frames, check_icrc=check_icrc)
            ok = packets.table["status"] == 0
            if np.any(packets.table["payload_off"][ok] + packets.table["payload_len"][ok] > size):
                raise AssertionError("a payload placed outside the file")
        roce.reassemble(frames, packets)
        table, offsets, lengths = roce._frame_columns(frames)  # parse + demux on 3 threads, reassembly on 2
        _mirror.parse_reassemble(frames.buf, offsets, lengths, table, True, 0, 3, 2)
    except FlowcheckError:
        pass  # a clean rejection of a bad capture


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the name libFuzzer looks for
    decode(data)


def _pcapng_prefix(data: bytes, limit: int = 24 << 10) -> bytes:
    """The file cut at the last little-endian pcapng block boundary before ``limit``: small and still valid."""
    pos = last = 0
    while pos + 12 <= len(data) and pos <= limit:
        last = pos
        (n,) = struct.unpack_from("<I", data, pos + 4)
        if n < 12:
            break
        pos += n
    return data[:last]


def seed_corpus() -> Path:
    """A folder of seed inputs: shared capture prefixes (when present) and classic pcaps in both time units."""
    seeds = WORK / "seeds"
    seeds.mkdir(exist_ok=True)
    frames = [bytes(range(i, i + 60)) for i in range(4)]
    for name in ("rdma32", "iter_80000", "allreduce+p2p"):
        path = PCAPS / f"{name}.pcapng"
        if path.exists():
            (seeds / f"{name}.pcapng").write_bytes(_pcapng_prefix(path.read_bytes()))
    if (PCAPS / "rdma32.pcapng").exists():
        shared = read_capture(str(PCAPS / "rdma32.pcapng"))
        frames = [shared.frame(i) for i in range(min(len(shared), 16))]
    for nano in (True, False):
        with PcapWriter(str(seeds / f"small-{'ns' if nano else 'us'}.pcap"), nanosecond=nano) as w:
            for i, frame in enumerate(frames):
                w.write(frame, 1_700_000_000_000_000_000 + i * 1000)
    return seeds


def main(argv: list[str]) -> None:
    # no corpus folder given: start from the seeds (libFuzzer treats non-flag arguments as corpus folders/files)
    if not any(not a.startswith("-") for a in argv[1:]):
        argv = [*argv, str(seed_corpus())]
    atheris.Setup(argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
