"""The README is the front door: at most 250 lines, the two commands at its top exactly as `.ci/run` and users run
them, the demo's time as `demo --help` gives it, and a link to every page in docs/."""
from __future__ import annotations

import os
import re

from click.testing import CliRunner

from flowcheck.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MAIN_JOB = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && "
            "flowcheck demo --workdir ./flowcheck-demo")
TESTS = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[dev]' && "
         "python -m pytest -q")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _bash_blocks(text: str) -> list[tuple[int, list[str]]]:
    """Every ```bash block: (the line number of its opening fence, its lines)."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if line == "```bash":
            end = lines.index("```", i + 1)
            blocks.append((i + 1, lines[i + 1:end]))
    return blocks


def test_the_readme_is_at_most_250_lines():
    assert len(_readme().splitlines()) <= 250


def test_the_readme_starts_with_the_main_job_and_the_test_command_byte_for_byte():
    (first_at, first), (second_at, second) = _bash_blocks(_readme())[:2]
    assert first == [MAIN_JOB] and second == [TESTS]
    assert first_at < second_at <= 40, "both commands stand at the top"
    after = " ".join(_readme().splitlines()[second_at + 1:second_at + 5])
    assert re.search(r"The tests take about [\d–]+ minutes on 2 cores .*\([\d,]+ tests; .*[\d.]+ min\)", after), after


def test_ci_runs_exactly_the_readmes_test_command():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        last = [line for line in f.read().splitlines() if line.strip()][-1]
    assert last == TESTS


def test_the_readme_links_every_page_in_docs():
    linked = {os.path.normpath(t.split("#")[0]) for t in re.findall(r"\]\(([^)\s]+)\)", _readme())}
    pages = {os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")}
    assert pages and pages <= linked, sorted(pages - linked)


def test_the_demo_time_in_the_readme_is_the_one_demo_help_gives():
    said = re.search(r"the demo takes about (\d+) s on 2 cores", _readme())
    assert said, "the README gives the demo's time"
    help_text = " ".join(CliRunner().invoke(main, ["demo", "--help"]).output.split())
    assert f"About {said.group(1)} s on 2 cores" in help_text, help_text
