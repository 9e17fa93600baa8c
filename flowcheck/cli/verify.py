"""Commands that check what is stored: audit, lineage, diff."""
from __future__ import annotations

import json
import sys

import click

from flowcheck import progress as _progress
from flowcheck.cli.common import (
    STEP_HELP,
    at_text,
    branch_option,
    bytes_bar,
    config_option,
    handled,
    reading_store,
    run_option,
    step_arg,
)


@click.command()
@config_option
@click.option("--step", required=True, help=STEP_HELP)
@branch_option
@click.option("--run", default=None, help="Run name (default: the config's run).")
@click.option("--against", "reference", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Reference safetensors file (canonical tensor names).")
@click.option("--from", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Tier to read.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handled
def diff(config_path, step, branch, run, reference, prefer, as_json):
    """Compare a stored step with a reference file, bit for bit per tensor (exit 1 when anything differs).

    Every shard read is verified against its digest first.

    \b
    Example:
      flowcheck diff --config flowcheck.yaml --step 50 --against sim/truth/step-50.safetensors
      flowcheck diff --config flowcheck.yaml --step 50 --branch main --against step-50.safetensors
    """
    from flowcheck.restore.diff import diff_step, report
    from flowcheck.restore.source import open_step

    store = reading_store(config_path, run)
    tier, m = open_step(store, step_arg(step), prefer, branch)
    result = report(diff_step(tier, m, reference))
    if as_json:
        click.echo(json.dumps({"step": m.step, "branch": tier.branch, "tier": tier.name, **result}, indent=2))
    else:
        for t in result["tensors"]:
            extra = f" ({t['differing']}/{t['elements']} differ, max |diff| {t['max_abs_diff']:.3g})" if t["status"] == "different" else ""
            click.echo(f"{t['status']:<15} {t['name']}{extra}{' ' + t['detail'] if t['detail'] else ''}")
        verdict = "bit-exact" if result["bit_exact"] else "NOT bit-exact"
        click.echo(f"step {at_text(m, tier)} ({tier.name} tier) vs {reference}: {verdict} {result['counts']}")
    sys.exit(0 if result["bit_exact"] else 1)


@click.command()
@config_option
@run_option
@click.option("--no-data", is_flag=True, help="Check manifests, files and chain, skip re-reading shard data.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@handled
def audit(config_path, run, no_data, as_json):
    """Verify every state of every branch in every tier: manifests, file digests, shard digests, hash chain
    (across branches), gaps; forks (a rollback or restore starting a branch) are reported as information.

    Exits 1 if anything is wrong.

    \b
    Example:
      flowcheck audit --config /tmp/fc-demo/flowcheck.yaml
      flowcheck audit --run other-run --config /tmp/fc-demo/flowcheck.yaml
    """
    from flowcheck.audit import audit as run_audit
    from flowcheck.audit import info_lines
    from flowcheck.lineage_view import to_json

    store = reading_store(config_path, run)
    states = store.check_tiers()  # a configured tier that does not exist is an error (exit 2), not "0 steps OK"
    with bytes_bar("audit: re-reading every file" + ("" if no_data else " and shard")) as bar:
        report = run_audit(store, data=not no_data, progress=bar)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, **to_json(report)}, indent=2))
    else:
        for state in states:
            if state.empty:
                click.echo(f"[info] {state.describe()}")
        for p in report.problems:
            click.echo(str(p))
        for line in info_lines(report):
            click.echo(line)
        status = "OK" if report.ok else "FAILED"
        errors = sum(p.severity == "error" for p in report.problems)
        branches = len({n.branch for n in report.nodes.values()})
        click.echo(f"audit {status}: {report.checked_steps} step copies checked, {len(report.nodes)} distinct states "
                   f"on {branches} branch{'' if branches == 1 else 'es'}, {errors} errors, "
                   f"{len(report.problems) - errors} warnings")
    sys.exit(0 if report.ok else 1)


@click.command()
@config_option
@run_option
@click.option("--format", "fmt", default="text", type=click.Choice(["text", "json", "dot", "png"]), help="Output format.")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Output file (required for png; default: stdout).")
@click.option("--verify", is_flag=True, help="Also check every file's size and digest (green = verified); default: manifests and links only.")
@handled
def lineage(config_path, run, fmt, out, verify):
    """Draw the run's lineage tree: one node per state (step@branch off main, source, tiers holding it),
    coloured by audit status (green verified, yellow warning, red damaged, grey unverified); a rollback or
    restore forks a branch (text: ├─ per branch; dot/png: a box per branch, bold edges out of the fork).
    png needs Graphviz's `dot` (Debian package graphviz). Exits 1 when a state is damaged or the chain is broken,
    as audit does (the drawing is still written).

    \b
    Example:
      flowcheck lineage --format png --out lineage.png --verify --config flowcheck.yaml
      flowcheck lineage --format dot --config flowcheck.yaml | dot -Tsvg > lineage.svg
      flowcheck lineage --run other-run --config flowcheck.yaml
    """
    from flowcheck.audit import lineage as run_lineage
    from flowcheck.lineage_view import dumps, render_png, to_dot

    if fmt == "png" and out is None:
        raise click.UsageError("--format png writes an image file: expected --out FILE.png, found none")
    store = reading_store(config_path, run)
    states = store.check_tiers()  # a configured tier that does not exist is an error (exit 2), not an empty tree
    if verify:
        with bytes_bar("lineage: verifying files") as bar:
            report = run_lineage(store, verify=True, progress=bar)
    else:
        with _progress.activity("lineage"):
            report = run_lineage(store)
    if not report.nodes:
        for state in states:
            click.echo(f"({state.describe()})", err=True)
    if fmt == "png":
        render_png(to_dot(report), out)
        forks = len(report.forks)
        click.echo(f"wrote {out} ({len(report.nodes)} states, {forks} fork{'' if forks == 1 else 's'})")
    elif out is not None:
        with open(out, "w") as f:
            f.write(dumps(report, fmt) + "\n")
    else:
        click.echo(dumps(report, fmt))
    sys.exit(0 if report.ok and all(n.ok for n in report.nodes.values()) else 1)

