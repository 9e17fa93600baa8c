"""The outputs of export and restore: a disk that refuses them (full, read-only, no permission) or memory that
runs out is one FlowcheckError saying what was expected, what was found, what was left behind and what to do."""
from __future__ import annotations

import errno
import os
import shutil

from flowcheck.errors import FlowcheckError, OutputError, TooLargeError
from flowcheck.progress import human_bytes


def failed_write(exc: BaseException, out: str, *, what: str, need: int, left: str) -> FlowcheckError | None:
    """The error to raise (``from exc``) for a write of ``out`` that failed with ``exc``, or None when ``exc`` is
    not a disk's or memory's refusal (a FlowcheckError already says what went wrong; anything else is a bug).

    The OSError may sit under torch's RuntimeError (``torch.save`` reports a failed write as "unexpected pos")
    or in a DCP ``CheckpointException``.  ``what`` names the output ("the exported file"), ``need`` its expected
    size in bytes, ``left`` what the caller's cleanup left ("nothing was left half-written: ...").
    """
    if isinstance(exc, (FlowcheckError, KeyboardInterrupt, SystemExit)):
        return None
    disk = _under(exc, OSError)
    if disk is not None and disk.errno is not None:
        return _disk_error(disk, out, what, need, left)
    memory = _under(exc, MemoryError)
    if memory is not None:
        return TooLargeError(
            f"cannot write {what} {out}: out of memory ({_one_line(memory) or 'MemoryError'}); expected memory for "
            f"about {human_bytes(need)} of tensors, found too little; {left} — free memory or run on a machine with more"
        )
    return None


def remove(path: str | None) -> str | None:
    """Remove a temporary file or folder of a failed write: None when it is gone, else why it is not."""
    if path is None or not os.path.lexists(path):
        return None
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as e:
        return f"{path} could not be removed ({e.strerror or e}): delete it"
    return None


def _under(exc: BaseException, kind: type) -> BaseException | None:
    """The first ``kind`` in ``exc``'s cause/context chain and in the failures a CheckpointException wraps;
    a FlowcheckError ends its branch (it already explains itself)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or isinstance(e, FlowcheckError):
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend((e.__cause__, e.__context__))
    return None


def _disk_error(e: OSError, out: str, what: str, need: int, left: str) -> OutputError:
    code = errno.errorcode.get(e.errno, f"errno {e.errno}")
    reason = f"{e.strerror or os.strerror(e.errno)} ({code})"
    at = os.fsdecode(e.filename) if e.filename else ""
    at = f" at {at}" if at and at != out else ""
    folder = _existing(os.path.dirname(os.path.abspath(out)))
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(folder).free
        expected, found = f"room for about {human_bytes(need)}", f"{human_bytes(free)} free in {folder}" + (
            " (the disk quota is used up)" if e.errno == errno.EDQUOT else "")
        todo = "free space there or pass another --out"
    elif e.errno in (errno.EACCES, errno.EPERM):
        expected, found = "a folder this user can write", f"{folder} refuses writes"
        todo = "fix the folder's permissions or pass another --out"
    elif e.errno == errno.EROFS:
        expected, found = "a writable filesystem", f"{folder} on a read-only one"
        todo = "pass an --out on a writable filesystem"
    else:
        expected, found = "the write to succeed", reason
        todo = "check the disk (`df`, the kernel log) and try again, or pass another --out"
    message = f"cannot write {what} {out}: {reason}{at}; expected {expected}, found {found}; {left} — {todo}"
    return OutputError(message, e.errno, e.filename)


def _existing(path: str) -> str:
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path or "."


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
