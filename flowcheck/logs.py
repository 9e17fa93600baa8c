"""Logging setup for the CLI: human text (default) or JSON lines, with secrets never written.

JSON lines carry ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg`` and, for the node's key events,
structured fields passed as ``extra=`` (``event``, ``step``, ``tier``, ``bytes``, ``seconds``, ...).
Only the fields named in ``FIELDS`` are ever copied from a record — never the whole record — and the
values of secret-looking environment variables (AWS keys, tokens, the HMAC signing key) are masked
wherever they would appear in a message or traceback.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import sys

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# structured fields a log call may attach with extra={...}; anything else stays out of the output
FIELDS = ("event", "step", "tier", "bytes", "seconds", "queue_seconds", "steps", "reason", "iteration", "run", "node")
# AWS_ACCESS_KEY_ID too: botocore's debug log prints it in every request's Authorization header
_SECRET_NAME = re.compile(r"(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|HMAC|ACCESS_KEY|_KEY$|_KEY_ID$|^KEY$)", re.IGNORECASE)
_MASK = "***"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the structured fields present, exc (traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
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


def configure(level: int, fmt: str = "text", stream=None) -> logging.Handler:
    """Install one root handler writing ``fmt`` (text | json) to ``stream`` (stderr), replacing the one an
    earlier call installed (other handlers, e.g. pytest's, stay)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format: expected one of {FORMATS}, found {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RedactSecrets())
    handler.set_name("flowcheck-cli")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "flowcheck-cli"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
