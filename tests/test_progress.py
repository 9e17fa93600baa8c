"""Progress bars: shown only on a terminal, never in captured output, off with --no-progress / FLOWCHECK_NO_PROGRESS."""
from __future__ import annotations

import io
import os

import numpy as np
from click.testing import CliRunner

from flowcheck import progress
from flowcheck.cli import main


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_enabled_only_on_a_terminal_and_not_when_asked_off(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    assert progress.enabled(_Tty()) and not progress.enabled(io.StringIO())
    monkeypatch.setenv(progress.ENV, "1")
    assert not progress.enabled(_Tty())
    monkeypatch.setenv(progress.ENV, "0")
    assert progress.enabled(_Tty())


def test_bars_are_disabled_off_tty(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)  # pytest's stderr is not a terminal
    with progress.bar(total=3, desc="x") as b:
        assert b.disable
    with progress.activity("y") as a:
        assert a.disable


def test_cli_output_has_no_progress_artifacts_off_tty(tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    monkeypatch.delenv(progress.ENV, raising=False)
    cfg = tmp_path / "fc.yaml"
    cfg.write_text(f"run: r\ntiers: {{local: {{root: {tmp_path}/local}}, object: {{url: file://{tmp_path}/object}}}}\n")
    state = str(tmp_path / "model.safetensors")
    save_file({"decoder.final_layernorm.weight": np.ones(8, np.float32)}, state)
    runner = CliRunner()
    for args in (["snapshot", "--state", state, "--step", "1"], ["promote", "--step", "1"], ["audit"], ["gc"],
                 ["export", "--step", "1", "--out", str(tmp_path / "x.safetensors")]):
        result = runner.invoke(main, [*args, "--config", str(cfg)])
        assert result.exit_code == 0, result.output
        assert "\r" not in result.output and "\r" not in result.stderr and "it/s" not in result.stderr, args


def test_no_progress_flag_reaches_subprocesses(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    result = CliRunner().invoke(main, ["--no-progress", "ls", "--config", os.devnull + ".yaml"])
    assert os.environ.get(progress.ENV) == "1", result.output
    monkeypatch.delenv(progress.ENV)


def test_long_commands_show_bars_that_reach_their_known_totals(tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    bars = []
    real_bar = progress.bar

    def recording_bar(*a, **kw):
        b = real_bar(*a, **kw)
        bars.append(b)
        return b

    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setattr(progress, "enabled", lambda stream=None: True)  # as on a terminal
    monkeypatch.setattr(progress, "bar", recording_bar)
    cfg = tmp_path / "fc.yaml"
    cfg.write_text(f"run: r\ntiers: {{local: {{root: {tmp_path}/local}}, object: {{url: file://{tmp_path}/object}}}}\n"
                   "policy: {local: {keep_last: 1}}\n")
    state = str(tmp_path / "model.safetensors")
    save_file({"decoder.final_layernorm.weight": np.ones(4096, np.float32), "embedding.weight": np.ones((64, 32), np.float32)}, state)
    runner = CliRunner()
    data = 4096 * 4 + 64 * 32 * 4
    cases = [(["snapshot", "--state", state, "--step", "1"], "B"), (["snapshot", "--state", state, "--step", "2", "--tier", "object"], "B"),
             (["promote", "--step", "1"], "B"), (["promote", "--step", "2", "--to", "local"], "B"),
             (["export", "--step", "1", "--out", str(tmp_path / "x.safetensors")], "B"),
             (["show", "--step", "1", "--verify"], "B"), (["audit"], "B"), (["audit", "--no-data"], "B"),
             (["lineage", "--verify"], "B"), (["gc"], "step")]
    for args, unit in cases:
        bars.clear()
        result = runner.invoke(main, [*args, "--config", str(cfg)])
        assert result.exit_code == 0, (args, result.output, result.stderr)
        counted = [b for b in bars if b.unit == unit]
        assert counted and all(b.total and b.n == b.total for b in counted), (args, [(b.desc, b.n, b.total) for b in bars])
        assert counted[0].desc.split()[0] in result.stderr, (args, result.stderr)
        assert counted[0].total >= (data if unit == "B" else 1), args
        if args in (cases[0][0], cases[3][0], cases[4][0]):  # local writes and export count tensor bytes exactly
            assert counted[0].total == data, args
    # gc with keep_last 1 deleted local step 1 and counted every committed step (2 local, 2 object)
    assert bars[-1].total == 4 and "deleted steps [1]" in result.output
