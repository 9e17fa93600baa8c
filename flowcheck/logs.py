"""Logging setup for the CLI: human text (default) or JSON lines, with secrets never written.

JSON lines carry ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg`` and, for the node's key events,
structured fields passed as ``extra=`` (``event``, ``step``, ``tier``, ``bytes``, ``seconds``, ...).
Only the fields named in ``FIELDS`` are ever copied from a record — never the whole record — and the
values of secret-looking environment variables (AWS keys, tokens, the HMAC signing key) are masked
wherever they would appear in a message or traceback.

Two guards keep a node's log readable under attack: a message is always one line (control characters
in it, e.g. a newline in a resync ``reason`` sent over HTTP, are escaped as ``\\n``, so no caller can
forge a log line; call sites quote such text with ``oneline`` too, for the JSON fields), and a warning
repeated from one call site is written at most ``RateLimit.burst`` times per ``RateLimit.interval_s``,
then one line says how many similar ones were suppressed.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import sys
import threading
import time

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# structured fields a log call may attach with extra={...}; anything else stays out of the output
FIELDS = ("event", "step", "tier", "bytes", "seconds", "queue_seconds", "steps", "reason", "iteration", "run", "node")
# AWS_ACCESS_KEY_ID too: botocore's debug log prints it in every request's Authorization header
_SECRET_NAME = re.compile(r"(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|HMAC|ACCESS_KEY|_KEY$|_KEY_ID$|^KEY$)", re.IGNORECASE)
_MASK = "***"
# C0/C1 controls and the Unicode line separators: each could start a new line in some log viewer
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def oneline(text: object) -> str:
    """``text`` with its control characters escaped as ``repr`` writes them (a newline becomes ``\\n``): user-supplied
    text (a resync reason, a peer's error message) can then never start a forged line in a log."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` with the message on one line (a traceback, added after it, keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = oneline(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the structured fields present, exc (traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),  # json.dumps escapes control characters: one line per record
        }
        for name in FIELDS:
            if name in record.__dict__:
                out[name] = record.__dict__[name]
        if record.exc_info:
            out["exc"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RedactSecrets(logging.Filter):
    """Mask the values of secret-looking environment variables in the formatted message and arguments."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        super().__init__()
        env = os.environ if environ is None else environ
        # short values would mask ordinary words; real keys and tokens are long
        self.secrets = sorted({v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)

    def mask(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, _MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            msg = record.getMessage()
            masked = self.mask(msg)
            if masked != msg:
                record.msg, record.args = masked, None
            for name in FIELDS:
                if isinstance(record.__dict__.get(name), str):
                    record.__dict__[name] = self.mask(record.__dict__[name])
            if record.exc_info:  # another handler may have rendered the traceback already
                record.exc_text = self.mask(record.exc_text or logging.Formatter().formatException(record.exc_info))
        return True


_PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[a-zA-Z%]")
_MAX_SITES = 1000  # open windows kept; messages that differ every time (pre-formatted ones) share one beyond it


class RateLimit:
    """At most ``burst`` records per call site (logger, level, message template) in each ``interval_s`` window,
    for warnings and above; what a window held back is reported in one line once the window is over.

    A flood of one warning (a peer retrying a refused push, accept() out of file descriptors) would
    otherwise fill the disk: a node under a connection flood once wrote 43 MB of the same lines.
    """

    def __init__(self, burst: int = 10, interval_s: float = 60.0, level: int = logging.WARNING,
                 clock=time.monotonic) -> None:
        self.burst, self.interval_s, self.level, self.clock = burst, interval_s, level, clock
        self._lock = threading.Lock()
        self._windows: dict[tuple, list] = {}  # key -> [window start, records seen, a suppressed record]

    def admit(self, record: logging.LogRecord) -> tuple[bool, list[logging.LogRecord]]:
        """(write ``record``?, summary records of windows now over) for one record."""
        now = self.clock()
        with self._lock:
            summaries = self._expired(now)
            if record.levelno < self.level:
                return True, summaries
            key = self._site(record)
            window = self._windows.setdefault(key, [now, 0, None])
            window[1] += 1
            if window[1] <= self.burst:
                return True, summaries
            window[2] = record
            return False, summaries

    def _site(self, record: logging.LogRecord) -> tuple:
        """What makes records "similar": logger, level and message template; a template that is almost all
        placeholders (``"%s"``) by the start of its text instead; past ``_MAX_SITES`` open windows, the logger."""
        template = str(record.msg)
        if len(_PLACEHOLDER.sub("", template).strip()) < 8:
            template = _message(record)[:80]
        if len(self._windows) >= _MAX_SITES:
            template = "*"
        return record.name, record.levelno, template[:200]

    def flush(self) -> list[logging.LogRecord]:
        """Summaries of every window still holding suppressed records (at exit)."""
        with self._lock:
            return self._expired(None)

    def _expired(self, now: float | None) -> list[logging.LogRecord]:
        out = []
        for key, (start, seen, last) in list(self._windows.items()):
            if now is not None and now - start < self.interval_s:
                continue
            del self._windows[key]
            if seen > self.burst:
                out.append(self._summary(last, seen - self.burst, (now or self.clock()) - start))
        return out

    @staticmethod
    def _summary(last: logging.LogRecord, suppressed: int, seconds: float) -> logging.LogRecord:
        template = oneline(str(last.msg))[:120]
        return logging.LogRecord(last.name, last.levelno, last.pathname, last.lineno,
                                 "suppressed %d similar messages in the last %.0f s (%r; the last: %s)",
                                 (suppressed, seconds, template, _message(last)[:300]), None)


def _message(record: logging.LogRecord) -> str:
    """The record's message; its bare template when the arguments do not fit it (logging reports that on emit)."""
    try:
        return record.getMessage()
    except Exception:  # noqa: BLE001 - a bad log call must not raise where it is made
        return str(record.msg)


class _Handler(logging.StreamHandler):
    """The CLI's stream handler, rate-limited (``RateLimit``): summaries go before the record that ends a window."""

    def __init__(self, stream, limit: RateLimit) -> None:
        super().__init__(stream)
        self.limit = limit

    def handle(self, record: logging.LogRecord) -> bool:
        write, summaries = self.limit.admit(record)
        for summary in summaries:
            super().handle(summary)
        return super().handle(record) if write else False

    def close(self) -> None:
        for summary in self.limit.flush():
            super().handle(summary)
        super().close()


def configure(level: int, fmt: str = "text", stream=None, limit: RateLimit | None = None) -> logging.Handler:
    """Install one root handler writing ``fmt`` (text | json) to ``stream`` (stderr), replacing the one an
    earlier call installed (other handlers, e.g. pytest's, stay); ``limit``: its rate limit (default: 10 per
    call site a minute)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format: expected one of {FORMATS}, found {fmt!r}")
    handler = _Handler(stream or sys.stderr, limit or RateLimit())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    handler.addFilter(RedactSecrets())
    handler.set_name("flowcheck-cli")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "flowcheck-cli"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
