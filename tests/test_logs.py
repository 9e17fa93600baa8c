"""Structured logs: --log-format json writes one parseable JSON object per line with the event's fields; secrets never appear."""
from __future__ import annotations

import io
import json
import logging

import pytest
from click.testing import CliRunner

from flowcheck.cli import main
from flowcheck.config import PolicyConfig, TierPolicy
from flowcheck.logs import configure
from flowcheck.policy import PolicyRunner
from tests.helpers import make_snapshot
from tests.test_store import advance, make_store


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_policy_commits_log_json_lines_with_step_tier_bytes_seconds(tmp_path):
    out = io.StringIO()
    handler = configure(logging.INFO, "json", out)
    try:
        store = make_store(tmp_path, local_keep=1, object_keep=1)
        runner = PolicyRunner(store, PolicyConfig(local=TierPolicy(keep_last=1), object=TierPolicy(keep_last=1)))
        store.push(make_snapshot(step=1))
        runner.snapshot_now()
        advance(store, 2)
        runner.flush()  # snapshot of step 2 (GC deletes 1), then its upload
        runner.stop()
    finally:
        logging.getLogger().removeHandler(handler)
    records = _lines(out.getvalue())
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    by_event = {}
    for r in records:
        by_event.setdefault(r.get("event"), []).append(r)
    snaps = by_event["snapshot_committed"]
    assert [r["step"] for r in snaps] == [1, 2] and all(r["tier"] == "local" and r["bytes"] > 0 for r in snaps)
    assert all(r["seconds"] >= 0 and r["queue_seconds"] >= 0 and r["level"] == "info" for r in snaps)
    (upload,) = by_event["upload_committed"]
    assert upload["step"] == 2 and upload["tier"] == "object" and upload["logger"] == "flowcheck.policy"
    assert any(r["tier"] == "local" and r["steps"] == [1] for r in by_event["gc"])


def test_secret_values_from_the_environment_are_masked(monkeypatch):
    monkeypatch.setenv("FLOWCHECK_HMAC_KEY", "hmac-key-value-0123456789")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws/secret+value/ABCDEFGH")
    out = io.StringIO()
    handler = configure(logging.INFO, "json", out)
    try:
        log = logging.getLogger("flowcheck.test")
        log.warning("connecting with %s and %s", "aws/secret+value/ABCDEFGH", "hmac-key-value-0123456789",
                    extra={"reason": "key hmac-key-value-0123456789 rejected"})
        try:
            raise RuntimeError("bad key aws/secret+value/ABCDEFGH")
        except RuntimeError:
            log.exception("upload failed")
    finally:
        logging.getLogger().removeHandler(handler)
    text = out.getvalue()
    assert "ABCDEFGH" not in text and "0123456789" not in text
    first, second = _lines(text)
    assert first["msg"] == "connecting with *** and ***" and first["reason"] == "key *** rejected"
    assert "RuntimeError: bad key ***" in second["exc"]


def test_cli_log_format_json_from_flag_and_environment(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    cfg = tmp_path / "fc.yaml"
    cfg.write_text(f"run: r\ntiers: {{local: {{root: {tmp_path}/local}}, object: {{url: file://{tmp_path}/object}}}}\n")
    state = str(tmp_path / "model.safetensors")
    save_file({"decoder.final_layernorm.weight": np.ones(8, np.float32)}, state)
    runner = CliRunner()
    for step, args, env in ((1, ["--log-format", "json"], {}), (2, [], {"FLOWCHECK_LOG_FORMAT": "json"})):
        result = runner.invoke(main, [*args, "snapshot", "--state", state, "--step", str(step), "--config", str(cfg)],
                               env=env)
        assert result.exit_code == 0, result.output
        records = _lines(result.stderr)  # json logs at info level without -v
        assert any("committed" in r["msg"] and r["level"] == "info" for r in records), result.stderr
    text = runner.invoke(main, ["-v", "snapshot", "--state", state, "--step", "3", "--config", str(cfg)])
    assert text.exit_code == 0 and "INFO" in text.stderr and not text.stderr.lstrip().startswith("{")


def test_a_repeated_warning_is_written_at_most_burst_times_per_interval_then_counted_in_one_line():
    from flowcheck.logs import RateLimit

    now = [0.0]
    out = io.StringIO()
    handler = configure(logging.INFO, "text", out, limit=RateLimit(burst=3, interval_s=60, clock=lambda: now[0]))
    try:
        log = logging.getLogger("flowcheck.test")
        for i in range(500):
            log.warning("push: connection from %s refused", f"10.0.0.{i}")
        log.warning("another warning")  # a different call site has its own budget
        log.info("push: connection from %s refused", "info is never limited")
        now[0] = 61.0
        log.warning("push: connection from %s refused", "10.0.1.1")  # a new window: first the summary
        for i in range(5):
            log.warning("%s", f"pre-formatted message {i}")  # told apart by their text, not the bare "%s"
    finally:
        logging.getLogger().removeHandler(handler)
    lines = out.getvalue().splitlines()
    refused = [line for line in lines if "refused" in line and "suppressed" not in line]
    assert len(refused) == 3 + 1 + 1, lines
    (summary,) = [line for line in lines if "suppressed" in line]
    assert "suppressed 497 similar messages in the last 61 s" in summary and "10.0.0.499" in summary
    assert lines.index(summary) < lines.index(refused[-1]) and "another warning" in out.getvalue()
    assert sum("pre-formatted message" in line for line in lines) == 5


def test_suppressed_counts_are_written_when_the_log_closes():
    from flowcheck.logs import RateLimit

    out = io.StringIO()
    handler = configure(logging.INFO, "json", out, limit=RateLimit(burst=2, interval_s=3600))
    log = logging.getLogger("flowcheck.test")
    for _ in range(10):
        log.warning("disk almost full")
    logging.getLogger().removeHandler(handler)
    handler.close()  # at exit, logging.shutdown() does this
    records = _lines(out.getvalue())
    assert [r["msg"] for r in records][:2] == ["disk almost full"] * 2
    assert records[-1]["msg"].startswith("suppressed 8 similar messages") and len(records) == 3


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_user_text_with_newlines_cannot_forge_a_log_line(log_format):
    out = io.StringIO()
    handler = configure(logging.INFO, log_format, out)
    try:
        forged = "ok\n2026-01-01 00:00:00,000 ERROR flowcheck.node: [ERROR] forged\r\x1b[2Kcleared\u2028next"
        logging.getLogger("flowcheck.test").warning("resync requested: %s", forged)
        try:
            raise ValueError("multi\nline")
        except ValueError:
            logging.getLogger("flowcheck.test").exception("failed: %s", forged)
    finally:
        logging.getLogger().removeHandler(handler)
    text = out.getvalue()
    assert not any(line.startswith(("2026-01-01", "[ERROR]", "cleared", "next")) for line in text.splitlines())
    if log_format == "text":
        first = text.splitlines()[0]
        assert first.endswith("resync requested: ok\\n2026-01-01 00:00:00,000 ERROR flowcheck.node: [ERROR] forged"
                              "\\r\\x1b[2Kcleared\\u2028next")
        assert "Traceback" in text  # a traceback keeps its own lines, after the one-line message
    else:
        assert _lines(text)[0]["msg"] == "resync requested: " + forged
