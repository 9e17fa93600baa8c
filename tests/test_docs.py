"""docs/ says what the code does: the mirror-capture block runs as printed in an empty folder, the CLI error it
quotes is what the CLI prints; and every link in the README, docs/ and the benchmark pages stays inside the
repository and resolves."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from urllib.parse import urlparse

from click.testing import CliRunner

from flowcheck.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, name) for name in ("README.md", "BENCHMARKS.md", os.path.join("benchmarks", "README.md"))]
PAGES += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _doc(name: str) -> str:
    return _read(os.path.join(ROOT, "docs", name))


def _first_bash_block(text: str) -> list[str]:
    """The command lines of the first bash block (comments after ``#`` run as the shell reads them)."""
    block = text[text.index("```bash\n") + len("```bash\n"):]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def _anchors(text: str) -> set[str]:
    """The anchors a markdown renderer gives the headings outside code fences (GitHub's rule)."""
    seen: dict[str, int] = {}
    anchors, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _inside(path: str) -> bool:
    return path.startswith(os.path.realpath(ROOT) + os.sep)


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_mirror_capture_block_runs_as_printed_in_an_empty_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FLOWCHECK_CONFIG"}
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    out = ""
    for line in _first_bash_block(_doc("mirror.md")):
        done = subprocess.run(line, shell=True, check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
        out = done.stdout
    assert "bit-exact" in out.splitlines()[-1], out


def test_the_quoted_step_error_is_what_the_cli_prints():
    quoted = re.search(r"`(error: Invalid value for [^`]*?found 'abc';)", _doc("cli.md").replace("\n", " "))
    assert quoted, "docs/cli.md quotes the --step error"
    printed = CliRunner().invoke(main, ["show", "--step", "abc"]).output
    assert printed.startswith(quoted.group(1)), (quoted.group(1), printed)


def test_every_relative_link_resolves_to_a_file_and_heading_inside_the_repository():
    broken = []
    for page in PAGES:
        for target in _links(_read(page)):
            if urlparse(target).scheme:
                continue  # checked below
            path, _, anchor = target.partition("#")
            resolved = os.path.realpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not _inside(resolved) or not os.path.isfile(resolved) or (
                    anchor and resolved.endswith(".md") and anchor not in _anchors(_read(resolved))):
                broken.append((page, target))
    assert not broken, broken


def test_no_page_links_or_points_outside_the_repository():
    outside = []
    for page in PAGES:
        text = _read(page)
        for url in re.findall(r"\b[a-z][a-z0-9+.-]*://[^\s`)\"'>]+", text):
            parsed = urlparse(url)
            if parsed.scheme in ("http", "https") and parsed.hostname not in LOOPBACK:
                outside.append((page, url))
        for target in _links(text):
            if urlparse(target).scheme in ("http", "https", "ftp", "mailto"):
                outside.append((page, target))
        for rel in re.findall(r"(?<![\w./])(\.\./[\w./-]+)", text):
            if not _inside(os.path.realpath(os.path.join(os.path.dirname(page), rel))):
                outside.append((page, rel))
    assert not outside, outside
