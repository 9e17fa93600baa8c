"""`flowcheck bench`: run the benchmark suite (benchmarks/ of a source checkout) and print the ratio table."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import click

from flowcheck.errors import ConfigError

ENV = "FLOWCHECK_BENCHMARKS"


def find_benchmarks(given: str | None = None) -> str:
    """The benchmarks folder: --benchmarks / $FLOWCHECK_BENCHMARKS, else beside the package (the repository
    of an editable install), else ./benchmarks.  They are not part of the installed package."""
    import flowcheck

    repo = os.path.dirname(os.path.dirname(os.path.abspath(flowcheck.__file__)))
    candidates = [given] if given else [os.environ.get(ENV), os.path.join(repo, "benchmarks"),
                                        os.path.join(os.getcwd(), "benchmarks")]
    tried = []
    for path in (c for c in candidates if c):
        if os.path.isfile(os.path.join(path, "run_all.py")):
            return os.path.abspath(path)
        tried.append(path)
    raise ConfigError(
        f"flowcheck bench: expected the benchmarks/ folder of a flowcheck source checkout (with run_all.py), found none "
        f"at {', '.join(tried)}; the benchmarks are not installed with the package: clone the repository and run from "
        f"it, or pass --benchmarks DIR (or set ${ENV})")


def load_run_all(directory: str):
    spec = importlib.util.spec_from_file_location("flowcheck_bench_run_all", os.path.join(directory, "run_all.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@click.command("bench")
@click.option("--only", default=None, help="Comma-separated benchmarks: p3 (local snapshot), p5 (object upload), "
              "readback, p6 (restore), p4 (push, and the node's RSS while it receives), rss (node RSS at --gb), mirror, mirror_loss (default: p3,p5,readback,p6,p4; "
              "--quick: p3,p5,readback,p6).")
@click.option("--quick", is_flag=True, help="Small sizes, one round, warm cache: ~1-2 min on 2 cores (a smoke run; "
              "the goals need full sizes to mean anything).")
@click.option("--gb", type=float, default=None, help="Training-state size in GB for the sized benchmarks "
              "(default 1.3; --quick: 0.05).")
@click.option("--repeats", type=int, default=None, help="Rounds per alternative (default 3; --quick: 1).")
@click.option("--out-dir", default="bench-results", show_default=True, type=click.Path(file_okay=False),
              help="Where each benchmark's JSON, log and summary.md go.")
@click.option("--out", "out_file", default=None, type=click.Path(dir_okay=False),
              help="Also write the ratio table to this file (markdown; JSON with --json).")
@click.option("--json", "as_json", is_flag=True, help="Print the ratio table as JSON.")
@click.option("--benchmarks", "bench_dir", default=None, type=click.Path(file_okay=False),
              help=f"The repository's benchmarks/ folder (default: found beside the package, ${ENV}, ./benchmarks).")
def bench_command(only, quick, gb, repeats, out_dir, out_file, as_json, bench_dir):
    """Run the side-by-side benchmarks, each in its own process, and print the ratio table
    (method, seconds, ratio vs baseline, goal, met?).  Exit 1 when a benchmark failed.

    \b
    Example:
      flowcheck bench --quick --only p3
      flowcheck bench --only p3,p5 --gb 1.3 --out ratios.md
    """
    from flowcheck import progress

    run_all = load_run_all(find_benchmarks(bench_dir))
    try:
        keys = run_all.parse_only(only, quick)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--only") from e
    bar = progress.bar(total=len(keys), desc="bench", unit="bench")

    def start(key, _cmd):
        bar.set_description(f"bench {key}: {run_all.BENCHES[key].what}")
        if bar.disable:
            click.echo(f"bench: running {key} ({run_all.BENCHES[key].what}); log {os.path.join(out_dir, key + '.log')}",
                       err=True)

    def done(key, rc, seconds):
        bar.update(1)
        if bar.disable or rc:
            click.echo(f"bench: {key} {'done' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.0f} s", err=True)

    with bar:
        results = run_all.run(keys, out_dir, gb=gb, repeats=repeats, quick=quick, log_to_files=True,
                              on_start=start, on_done=done)
    rows = [r for k in keys for r in run_all.ratio_rows(k, results[k])]
    failed = [k for k, r in results.items() if r is None]
    if as_json:
        text = json.dumps({"quick": quick, "benchmarks": keys, "failed": failed, "rows": rows,
                           "out_dir": os.path.abspath(out_dir)}, indent=1)
    else:
        text = run_all.format_table(rows)
    click.echo(text)
    if out_file:
        with open(out_file, "w") as f:
            f.write(text + "\n")
    if not as_json:
        click.echo(f"\nevery benchmark's own tables: {os.path.join(out_dir, 'summary.md')}"
                   + (" (quick preset: sizes too small for the goals to be meaningful)" if quick else ""), err=True)
    for key in failed:
        click.echo(f"bench: {key} failed; see {os.path.join(out_dir, key + '.log')}", err=True)
    sys.exit(1 if failed else 0)
