"""benchmarks/bench_push_gpu.py (issue 33): without CUDA it refuses to run, says why in one line, and exits with 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_push_gpu.py")


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, SCRIPT, *argv], check=False, capture_output=True, encoding="utf-8",
                          timeout=120, env=env, cwd=REPO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the script would run the benchmark")
@pytest.mark.parametrize("argv", [(), ("--smoke",)])
def test_without_cuda_it_says_so_in_one_line_and_exits_2(argv, tmp_path):
    out = tmp_path / "push_gpu.json"
    proc = run(*argv, "--out", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = ("bench_push_gpu: needs a CUDA device (torch.cuda.is_available() is False); run it on a GPU machine — "
               "see BENCHMARKS.md")
    assert proc.stderr.splitlines() == [message]
    assert proc.stdout == "" and not out.exists()


def test_help_names_the_cadences_and_the_staging_flag():
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--every" in proc.stdout and "--gpu-staging" in proc.stdout and "exits with status 2" in proc.stdout
