"""flowcheck._mirror: capture index, RoCEv2 parse, reassembly and NCCL unpacking (native).

Use it through flowcheck.capture.pcap and flowcheck.capture.roce, which own the record dtypes
and turn ValueError into CaptureError.
"""
from collections.abc import Buffer

import numpy as np

def layouts() -> dict[str, tuple[list[tuple[str, str, int]], int]]:
    """Record layouts {packet, stream, message, segment, missing, gap}: ([(field, numpy format, offset)], itemsize)."""

def crc32(data: Buffer, value: int = 0) -> int:
    """zlib-compatible CRC32 of data, continuing from value."""

def index_capture(file: Buffer) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """(offsets int64, lengths int32, ts_ns int64, linktypes int32, "pcap" | "pcapng"); ValueError when malformed."""

def parse(buf: Buffer, offsets: Buffer, lengths: Buffer, out: Buffer, check_icrc: bool = True) -> None:
    """Fill `out` (a packet-layout table, one row per frame) from the frames buf[offsets[i]:+lengths[i]]."""

def frame_icrc(frame: Buffer) -> int:
    """The ICRC a RoCEv2 frame should carry (its last 4 bytes, little-endian), or -1 if it is not one."""

def reassemble(packets: Buffer, pmtu: int = 0) -> dict[str, np.ndarray]:
    """{streams, messages, segments, missing, gaps}: raw uint8 rows; {stream_of, message_of}: int32 per frame."""

def ll_unpack(buf: Buffer, segments: Buffer, out: Buffer, expected_flag: int = -1) -> tuple[int, int, int]:
    """Copy LL data words to out[msg_offset/2:]; (flag or -1, lines, bad_lines)."""

def ll128_unpack(buf: Buffer, segments: Buffer, out: Buffer, expected_flag: int = -1) -> tuple[int, int, int]:
    """Copy LL128 data (120 of every 128 bytes) to out[msg_offset/128*120:]; (flag or -1, lines, bad_lines)."""

def simple_copy(buf: Buffer, segments: Buffer, out: Buffer) -> int:
    """Copy raw payload to out[msg_offset:]; returns bytes copied."""

def place(buf: Buffer, segments: Buffer, out: Buffer, shift: int, flag: int, ll: bool) -> np.ndarray:
    """Place segments at out[(msg_offset + shift) (/2 for LL):], clipped; int32 per segment: 0 placed,
    -1 misaligned (LL), > 0 lines with a wrong flag (LL, nothing written), -2 outside out."""
