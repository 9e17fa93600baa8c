"""Batched byte-range reads: nearby ranges of one file merged, many requests in flight at once.

Reading a step shard by shard from an object store costs one round trip per
shard; reading whole files costs bytes nobody asked for.  Ranges that lie
close together in one file are merged (up to ``max_bytes`` a request) and all
requests go out together through fsspec's ``cat_ranges`` (concurrent on s3fs).

Local folders and S3 read ``streams`` instead: ranges that follow each other in one file, each stream read
front to back straight into the caller's arrays (``read_stream`` on a file descriptor, ``get_stream`` as one
ranged GET), no bytes objects in between.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from flowcheck.errors import IntegrityError, TierError


@dataclass(frozen=True)
class Want:
    path: str
    start: int
    end: int


@dataclass
class _Group:
    path: str
    start: int
    end: int
    members: list[int]


def merge(wants: list[Want], max_gap: int = 1 << 20, max_bytes: int = 64 << 20) -> list[_Group]:
    """Requests covering every non-empty want; a gap of up to ``max_gap`` bytes is read rather than split."""
    order = sorted((i for i, w in enumerate(wants) if w.end > w.start), key=lambda i: (wants[i].path, wants[i].start))
    groups: list[_Group] = []
    for i in order:
        w = wants[i]
        g = groups[-1] if groups else None
        if g and g.path == w.path and w.start - g.end <= max_gap and max(g.end, w.end) - g.start <= max_bytes:
            g.end = max(g.end, w.end)
            g.members.append(i)
        else:
            groups.append(_Group(w.path, w.start, w.end, [i]))
    return groups


def fetch(fs, wants: list[Want], *, max_gap: int = 1 << 20, max_bytes: int = 64 << 20) -> list[bytes | memoryview]:
    """The bytes of every want, in order; raises if a range comes back short (a truncated file)."""
    groups = merge(wants, max_gap, max_bytes)
    blobs = fs.cat_ranges([g.path for g in groups], [g.start for g in groups], [g.end for g in groups], on_error="return")
    out: list[bytes | memoryview] = [b""] * len(wants)
    for g, blob in zip(groups, blobs):
        if isinstance(blob, BaseException):
            raise _named(g, blob) from blob
        if len(blob) != g.end - g.start:
            raise IntegrityError(f"{g.path}: range {g.start}-{g.end} returned {len(blob)} bytes; the file is truncated")
        view = memoryview(blob)
        for i in g.members:
            out[i] = view[wants[i].start - g.start:wants[i].end - g.start]
    return out


def _named(g: _Group, err: BaseException) -> BaseException:
    """The error of one range, naming its file: a range past the end means the file is truncated."""
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(f"{g.path}: missing")
    if isinstance(err, OSError) and err.errno == errno.EINVAL:  # S3 InvalidRange: 416
        return IntegrityError(f"{g.path}: range {g.start}-{g.end} is past the end of the file; the file is truncated")
    return TierError(f"{g.path}: reading range {g.start}-{g.end} failed: {err}")


def streams(wants: list[Want], dests: list, most: int) -> list[tuple[str, list[tuple[int, int, memoryview]]]]:
    """The wants (each with a writable destination of its size) as streams of at most ``most`` bytes: ranges that
    follow each other in one file join, a longer one is cut.  A stream is ``(path, [(want index, file offset,
    destination view)])``, read front to back on one file descriptor so that the kernel reads ahead of it."""
    out: list[tuple[str, list[tuple[int, int, memoryview]]]] = []
    size, end = 0, None
    for i in sorted(range(len(wants)), key=lambda i: (wants[i].path, wants[i].start)):
        w, view = wants[i], memoryview(dests[i]).cast("B")
        at = 0
        while True:
            if not out or out[-1][0] != w.path or end != w.start + at or size >= most:
                out.append((w.path, []))
                size = 0
            take = min(w.end - w.start - at, most - size)
            out[-1][1].append((i, w.start + at, view[at:at + take]))
            size, at, end = size + take, at + take, w.start + at + take
            if at >= w.end - w.start:
                break
    return out


def read_stream(path: str, pieces: list[tuple[int, int, memoryview]], done, block: int = 2 << 20) -> None:
    """One stream of ``streams``: its ranges read in order into their views, in requests of ``block`` bytes on
    one descriptor (the kernel's sequential readahead keeps the disk busy ahead of them; one large request would
    wait for all its bytes, then leave the disk idle); ``done(i)`` after each piece."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, pieces[0][1], 0, os.POSIX_FADV_SEQUENTIAL)
        for i, start, view in pieces:
            got = 0
            while got < view.nbytes:
                n = os.preadv(fd, [view[got:got + block]], start + got)
                if n == 0:
                    raise IntegrityError(f"{path}: range {start}-{start + view.nbytes} returned {got} bytes; "
                                         "the file is truncated")
                got += n
            done(i)
    finally:
        os.close(fd)


def get_stream(client, path: str, pieces: list[tuple[int, int, memoryview]], done, block: int = 8 << 20) -> None:
    """One stream of ``streams`` from S3 (``path`` is ``bucket/key``): one ranged GET through the boto3 ``client``,
    its body read straight into the pieces' views in requests of ``block`` bytes; ``done(i)`` after each piece.
    A missing object raises FileNotFoundError; a range past the end, or a body shorter than asked, IntegrityError
    naming the file (truncated)."""
    start, end = pieces[0][1], pieces[-1][1] + pieces[-1][2].nbytes
    if end > start:
        with _get(client, path, start, end) as body:
            for i, at, view in pieces:
                _fill(body, view, path, start, end, at - start, block)
                done(i)
        return
    for i, _, _ in pieces:  # nothing to read (S3 refuses an empty range)
        done(i)


def get_file(client, path: str, size: int, place, done, block: int = 8 << 20) -> None:
    """A stored file of ``size`` bytes (the manifest's) read from S3 by one GET, for a read that wants (nearly)
    all of it: ``place(read)`` parses the file's header through ``read(start, end)`` (the body's first bytes, asked
    for in order) and returns the pieces ``[(i, file offset, destination view)]``; the rest of the body streams
    into the views in file order (bytes between them read and dropped), ``done(i)`` after each piece.  Errors as
    ``get_stream``'s; pieces that overlap raise IntegrityError."""
    with _get(client, path, 0, size) as body:
        pos = 0

        def read(a: int, b: int) -> bytes:
            nonlocal pos
            if a != pos:
                raise ValueError(f"{path}: header bytes asked out of order ({a}, expected {pos})")
            buf = bytearray(b - a)
            _fill(body, memoryview(buf), path, 0, size, a, block)
            pos = b
            return bytes(buf)

        pieces = sorted(place(read), key=lambda p: p[1])
        scratch = memoryview(bytearray(min(block, 1 << 20)))
        for i, at, view in pieces:
            if at < pos:
                raise IntegrityError(f"{path}: the pieces read overlap at byte {at}")
            while pos < at:  # a gap between pieces: read and dropped
                _fill(body, scratch[:min(at - pos, scratch.nbytes)], path, 0, size, pos, block)
                pos += min(at - pos, scratch.nbytes)
            _fill(body, view, path, 0, size, at, block)
            pos = at + view.nbytes
            done(i)


def _get(client, path: str, start: int, end: int):
    """The body of a GET of bytes ``start``..``end`` of ``path`` (``bucket/key``)."""
    bucket, key = path.split("/", 1)
    try:
        return client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
    except Exception as e:  # botocore's ClientError: its code says what went wrong
        code = str((getattr(e, "response", None) or {}).get("Error", {}).get("Code"))
        if code in ("NoSuchKey", "404"):
            raise FileNotFoundError(f"{path}: missing") from e
        if code in ("InvalidRange", "416"):
            raise IntegrityError(f"{path}: range {start}-{end} is past the end of the file; the file is "
                                 "truncated") from e
        raise


def _fill(body, view: memoryview, path: str, start: int, end: int, at: int, block: int) -> None:
    """``view`` filled from ``body`` (a GET of ``start``..``end``, ``at`` bytes of it already read)."""
    got = 0
    while got < view.nbytes:
        n = body.readinto(view[got:got + block])
        if not n:
            raise IntegrityError(f"{path}: range {start}-{end} returned {at + got} bytes; the file is truncated")
        got += n
