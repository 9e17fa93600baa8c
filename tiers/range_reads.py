"""Batched byte-range reads: nearby ranges of one file merged, many requests in flight at once.

Reading a step shard by shard from an object store costs one round trip per
shard; reading whole files costs bytes nobody asked for.  Ranges that lie
close together in one file are merged (up to ``max_bytes`` a request) and all
requests go out together through fsspec's ``cat_ranges`` (concurrent on s3fs).
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


def read_into(want: Want, dest) -> None:
    """A local file's byte range read straight into ``dest`` (a writable buffer of ``end - start`` bytes)."""
    view = memoryview(dest).cast("B")
    fd = os.open(want.path, os.O_RDONLY)
    try:
        done = 0
        while done < view.nbytes:
            n = os.preadv(fd, [view[done:done + (1 << 30)]], want.start + done)
            if n == 0:
                raise IntegrityError(f"{want.path}: range {want.start}-{want.end} returned {done} bytes; "
                                     "the file is truncated")
            done += n
    finally:
        os.close(fd)


def split(wants: list[Want], dests: list, most: int) -> list[tuple[Want, object]]:
    """(want, destination) pairs of at most ``most`` bytes covering the given ones."""
    out = []
    for w, d in zip(wants, dests):
        view = memoryview(d).cast("B")
        for at in range(0, max(1, w.end - w.start), most):
            end = min(w.end - w.start, at + most)
            out.append((Want(w.path, w.start + at, w.start + end), view[at:end]))
    return out
