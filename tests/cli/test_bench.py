"""`flowcheck bench`: runs benchmark scripts from the repository's benchmarks/ and prints the ratio table."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from flowcheck.cli.bench import find_benchmarks, load_run_all
from flowcheck.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_quick_p3_end_to_end_prints_the_ratio_table(tmp_path):
    out = tmp_path / "ratios.json"
    env = {**os.environ, "FLOWCHECK_BENCH_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "flowcheck", "bench", "--quick", "--only", "p3", "--gb", "0.02",
                           "--out-dir", str(tmp_path / "results"), "--json", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(proc.stdout)
    assert table == json.loads(out.read_text()) and table["benchmarks"] == ["p3"] and table["failed"] == []
    rows = table["rows"]
    assert len(rows) == 9 and all(set(r) >= {"bench", "method", "seconds", "ratio", "goal", "met"} for r in rows)
    measured = [r for r in rows if not r["goal"]]  # 7 methods, then the two goals of issue 18
    assert sum(r["baseline"] for r in measured) == 1 and all(r["seconds"] > 0 for r in measured)
    goal_rows = [r for r in rows if r["goal"]]
    assert [r["goal"] for r in goal_rows] == [">= 0.9x", ">= 1.0x"]
    assert all("flowcheck" in r["method"] and r["met"] == (r["ratio"] >= float(r["goal"][3:-1])) for r in goal_rows)
    assert (tmp_path / "results" / "p3.json").exists() and (tmp_path / "results" / "p3.log").exists()

    run_all = load_run_all(find_benchmarks())
    md = run_all.format_table(rows).splitlines()
    assert md[0] == "| bench | method | seconds | ratio vs baseline | goal | met? |" and len(md) == 2 + len(rows)
    assert all(line.count("|") == 7 for line in md)


def test_goals_are_read_as_ratios_percentages_and_counts():
    run_all = load_run_all(find_benchmarks())
    assert run_all.goal_met(">= 0.8x", 0.9) is True and run_all.goal_met(">= 0.8x", 0.7) is False
    assert run_all.goal_met("<= 3%", 0.02) is True and run_all.goal_met("<= 3%", 0.05) is False
    assert run_all.goal_met("= 0", 0) is True and run_all.goal_met("-", 1.0) is None


def test_bench_without_a_benchmarks_folder_says_what_to_do(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--quick", "--benchmarks", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert "benchmarks/ folder of a flowcheck source checkout" in result.stderr and "--benchmarks DIR" in result.stderr


def test_bench_rejects_unknown_names():
    result = CliRunner().invoke(main, ["bench", "--only", "p3,p99"])
    assert result.exit_code == 2 and "p99" in result.output + result.stderr
