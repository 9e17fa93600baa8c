"""Structured logs: --log-format json writes one parseable JSON object per line with the event's fields; secrets never appear."""
from __future__ import annotations

import io
import json
import logging

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
