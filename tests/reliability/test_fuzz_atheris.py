"""A short, bounded libFuzzer pass over the capture reader (tests/reliability/fuzz_atheris_pcap.py); skipped without atheris."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("fuzz_atheris_pcap.py")
RUNS = int(os.environ.get("FLOWCHECK_ATHERIS_RUNS", "1500"))


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None,
                    reason="atheris is not installed (optional: pip install -e .[fuzz]); the libFuzzer harness needs it")
def test_atheris_capture_harness_finds_no_crash_in_a_bounded_run(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the harness's seeds and scratch input land here
    # -artifact_prefix: a crash input lands in tmp_path, named in the output below
    proc = subprocess.run([sys.executable, str(HARNESS), f"-runs={RUNS}", f"-artifact_prefix={tmp_path}/", "-seed=1"],
                          capture_output=True, text=True, timeout=300, env=env)
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, f"atheris found a crash (exit {proc.returncode}):\n{tail}"
    assert f"Done {RUNS} runs" in proc.stderr, tail
