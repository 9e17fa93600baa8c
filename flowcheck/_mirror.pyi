"""flowcheck._mirror: capture index, RoCEv2 parse, reassembly and NCCL unpacking (native).

Use it through flowcheck.capture.mirror.pcap, .roce and .packet_ring, which own the record dtypes
and turn ValueError into CaptureError.
"""
from collections.abc import Buffer

import numpy as np

def layouts() -> dict[str, tuple[list[tuple[str, str, int]], int]]:
    """Record layouts {packet, stream, message, segment, missing, gap}: ([(field, numpy format, offset)], itemsize)."""

def crc32(data: Buffer, value: int = 0) -> int:
    """zlib-compatible CRC32 of data, continuing from value."""

def crc_path() -> str:
    """The CRC32 folding in use: "vpclmul", "pclmul" or "table" (the CPU's widest, capped by $FLOWCHECK_CRC)."""

def index_capture(file: Buffer) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """(offsets int64, lengths int32, ts_ns int64, linktypes int32, "pcap" | "pcapng"); ValueError when malformed."""

def parse(buf: Buffer, offsets: Buffer, lengths: Buffer, out: Buffer, check_icrc: bool = True) -> np.ndarray:
    """Fill `out` (a packet-layout table, one row per frame) from the frames buf[offsets[i]:+lengths[i]];
    returns int64 counts: frames per status (4), then frames with a BTH per opcode (256)."""

def frame_icrc(frame: Buffer) -> int:
    """The ICRC a RoCEv2 frame should carry (its last 4 bytes, little-endian), or -1 if it is not one."""

def reassemble(packets: Buffer, pmtu: int = 0, workers: int = 1) -> dict[str, np.ndarray]:
    """{streams, messages, segments, missing, gaps}: raw uint8 rows; {stream_of, message_of}: int32 per frame.
    Whole streams on `workers` threads (1..256); the tables do not depend on it."""

def parse_reassemble(buf: Buffer, offsets: Buffer, lengths: Buffer, out: Buffer, check_icrc: bool = True,
                     pmtu: int = 0, ranges: int = 1, workers: int = 1) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """parse into `out`, then reassemble, in one call: (parse's counts, reassemble's tables), the same as the two
    calls; each of `ranges` threads (1..256) parses a run of frames and demultiplexes its rows as it goes."""

def ll_unpack(buf: Buffer, segments: Buffer, out: Buffer, expected_flag: int = -1) -> tuple[int, int, int]:
    """Copy LL data words to out[msg_offset/2:]; (flag or -1, lines, bad_lines)."""

def ll128_unpack(buf: Buffer, segments: Buffer, out: Buffer, expected_flag: int = -1) -> tuple[int, int, int]:
    """Copy LL128 data (120 of every 128 bytes) to out[msg_offset/128*120:]; (flag or -1, lines, bad_lines)."""

def simple_copy(buf: Buffer, segments: Buffer, out: Buffer) -> int:
    """Copy raw payload to out[msg_offset:]; returns bytes copied."""


def merge_send(buf: Buffer, parts: list[tuple[Buffer, int]], flag: int, ll: bool, data: Buffer,
               copies: Buffer) -> tuple[int, int, list[tuple[int, int]]]:
    """Place a final send's (segments, shift) parts into an allreduce's data/copies slices: first valid copy of
    each whole element wins, later copies compared bitwise, copies saturate at 255; (seen, differing, unplaced)."""

def merge_sends(jobs: list[tuple[Buffer, list[tuple[Buffer, int]], int, bool, Buffer, Buffer]]
                ) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """merge_send over (buf, parts, flag, ll, data, copies) jobs in list order, the GIL released once for all;
    every job checked before any is merged; one (seen, differing, unplaced) per job."""

def merge_rows(buf: Buffer, segments: Buffer, rows: np.ndarray, ll: bool, data: Buffer, copies: Buffer
               ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """merge_send of each (seg_start, seg_end, shift, flag, lo, hi) int64 row: segments[seg_start:seg_end] into
    data[lo:hi] / copies[lo:hi], in row order, the GIL released once; every row checked first.
    (seen int64[n], differing int64[n], [(row, status, bytes)] of the LL segments not placed)."""

def segment_flags(buf: Buffer, segments: Buffer) -> np.ndarray:
    """int64 per segment: the LL flag of its first line (bytes 4..8), -1 under 16 bytes."""

def ring_block(block: Buffer, out: Buffer, at: int, offsets: Buffer, lengths: Buffer, ts_ns: Buffer,
               row: int) -> tuple[int, int]:
    """Copy the frames of a retired TPACKET_V3 block to out[at:] (stripped VLAN tags put back, frames this host
    sent skipped), their offsets/lengths/ts_ns to rows from `row`; (rows after, out offset after); ValueError
    when the block is malformed or an output is too small."""
