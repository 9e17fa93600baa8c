"""The README says what the code does: its mirror-capture block runs as printed in an empty folder, and what it
quotes of the CLI (an error line, the demo's time) is what the CLI prints."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from click.testing import CliRunner

from flowcheck.cli import main

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _block_after(heading: str) -> list[str]:
    """The command lines of the first bash block under ``heading`` (comments after ``#`` dropped)."""
    text = _readme()
    section = text[text.index(heading):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def test_the_mirror_capture_block_runs_as_printed_in_an_empty_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FLOWCHECK_CONFIG"}
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    out = ""
    for line in _block_after("## Mirror capture"):
        done = subprocess.run(line, shell=True, check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
        out = done.stdout
    assert "bit-exact" in out.splitlines()[-1], out


def test_the_quoted_step_error_is_what_the_cli_prints():
    quoted = re.search(r"`(error: Invalid value for [^`]*?found 'abc';)", _readme().replace("\n", " "))
    assert quoted, "the README quotes the --step error"
    printed = CliRunner().invoke(main, ["show", "--step", "abc"]).output
    assert printed.startswith(quoted.group(1)), (quoted.group(1), printed)


def test_the_demo_time_in_the_readme_is_the_one_demo_help_gives():
    said = re.search(r"the demo takes about (\d+) s on 2 cores", _readme())
    assert said, "the README gives the demo's time"
    help_text = " ".join(CliRunner().invoke(main, ["demo", "--help"]).output.split())
    assert f"About {said.group(1)} s on 2 cores" in help_text, help_text
