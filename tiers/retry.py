"""Bounded retries of object-store operations: exponential backoff with full jitter, a deadline, the last error.

botocore already retries each HTTP request (standard mode); this loop is the layer above it, around
whole operations the library cannot repeat by itself: a file upload whose parts ran out of
attempts, a manifest commit whose answer was lost, a read whose body came back short.  Only the
outermost loop of a thread retries: an operation retried inside another one fails at once and
lets the outer loop (which owns the time budget) start over, so attempts never multiply.
"""
from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from flowcheck.errors import TierAccessError, TierError, TierMissingError

log = logging.getLogger(__name__)

T = TypeVar("T")
_depth = threading.local()


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` more attempts after the first, none started past ``deadline_s`` from the first."""

    retries: int = 4
    deadline_s: float = 600.0
    base_s: float = 0.1  # first backoff at most this long; doubles per attempt (full jitter)
    cap_s: float = 5.0

    def run(self, what: str, fn: Callable[[], T], retry_on: tuple[type[BaseException], ...] = (TierError,)) -> T:
        """``fn()``, retried while it raises a transient ``retry_on`` error; the final error names
        ``what``, the attempts and the time spent, and chains the last error."""
        if getattr(_depth, "n", 0):
            return fn()  # an outer loop owns the budget
        _depth.n = 1
        try:
            return self._loop(what, fn, retry_on)
        finally:
            _depth.n = 0

    def _loop(self, what: str, fn: Callable[[], T], retry_on: tuple[type[BaseException], ...]) -> T:
        start = time.monotonic()
        for attempt in range(1, self.retries + 2):
            try:
                return fn()
            except retry_on as e:
                if not transient(e) or self.retries == 0:
                    raise
                spent = time.monotonic() - start
                delay = random.uniform(0, min(self.cap_s, self.base_s * 2 ** (attempt - 1)))
                if attempt > self.retries or spent + delay > self.deadline_s:
                    if not isinstance(e, TierError):
                        raise  # what stays wrong on every read (a damaged copy) keeps its own error
                    raise TierError(
                        f"{what}: gave up after {attempt} attempt{'s' if attempt > 1 else ''} in {spent:.1f}s "
                        f"(tiers.object.retries={self.retries}, retry_deadline_s={self.deadline_s:g}); "
                        f"last error: {e}"
                    ) from e
                log.warning("%s: attempt %d failed (%s); retrying in %.2fs", what, attempt, e, delay,
                            extra={"event": "object_retry", "attempt": attempt})
                time.sleep(delay)
        raise AssertionError("unreachable")


_PERMANENT_ERRNO = {errno.EINVAL, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOSPC, errno.EROFS}

AWS_CREDENTIALS_HINT = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, see "
                        "https://docs.aws.amazon.com/cli/latest/userguide/cli-configure-envvars.html")
# botocore raises these before any request is sent: no attempt can find credentials the first one did not
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound",
                   "NoAuthTokenError", "UnauthorizedSSOTokenError", "SSOTokenLoadError"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
           "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidClientTokenId", "403"}


def access_problem(e: BaseException | None) -> str | None:
    """Why a store refuses this process, by the error or its causes: ``"credentials"`` (none found),
    ``"denied"`` (an invalid key, a bad signature, 403), ``"no-bucket"`` (NoSuchBucket); None otherwise."""
    for link in _chain(e):
        if type(link).__name__ in _NO_CREDENTIALS:
            return "credentials"
        code = _error_code(link)
        if code == "NoSuchBucket":
            return "no-bucket"
        if code in _DENIED:
            return "denied"
    return None


def precondition_failed(e: BaseException | None) -> bool:
    """Whether the store answered 412 PreconditionFailed (by the error or its causes): a conditional write found
    its condition false. AWS names the condition (``If-None-Match``), which s3fs turns into FileExistsError;
    SeaweedFS sends the same code without it, which s3fs reports as EINVAL."""
    return any(_error_code(link) in ("PreconditionFailed", "412") for link in _chain(e))


def _error_code(e: BaseException) -> str | None:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
    return None


def _chain(e: BaseException | None, limit: int = 8):
    """``e`` and the errors it was raised from (``__cause__``, else an unsuppressed ``__context__``)."""
    for _ in range(limit):
        if e is None:
            return
        yield e
        e = e.__cause__ if e.__cause__ is not None else None if e.__suppress_context__ else e.__context__


def transient(e: BaseException) -> bool:
    """Whether an error may go away by trying again: 5xx, SlowDown, resets, read timeouts and short
    bodies do; bad requests, missing credentials, permissions, a missing bucket and an endpoint that
    cannot be connected to do not (a refused connection is a wrong URL or an outage longer than any
    retry budget: fail fast)."""
    if access_problem(e) is not None:
        return False  # no credentials, access denied, no such bucket: trying again changes nothing
    for link in _chain(e):
        if isinstance(link, (TierAccessError, TierMissingError)):
            return False
        name = type(link).__name__
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "InvalidURL"):
            return False
        status = getattr(link, "response", None)
        if isinstance(status, dict):
            code = status.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if 400 <= code < 500 and code not in (408, 409, 429):
                return False
        if isinstance(link, OSError) and link.errno in _PERMANENT_ERRNO:
            return False
        if isinstance(link, (FileNotFoundError, FileExistsError, PermissionError)):
            return False
    return True
