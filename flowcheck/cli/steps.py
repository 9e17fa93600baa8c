"""Commands over a store's steps: ls, show, snapshot, promote, delete, gc."""
from __future__ import annotations

import json
import os
import sys

import click

from flowcheck import progress as _progress
from flowcheck.cli.common import (
    STEP_HELP,
    branch_option,
    bytes_bar,
    committed,
    config_option,
    handled,
    human,
    reading_store,
    run_option,
    states_text,
    step_arg,
    store_for,
)


@click.command("ls")
@config_option
@run_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one object per row, with its branch).")
@handled
def ls_cmd(config_path, run, as_json):
    """List committed steps per tier and branch with size, time, source and status; * marks the current
    branch (the one whose newest state was committed last: `latest` and GC follow it).

    \b
    Example:
      flowcheck ls --config /tmp/fc-demo/flowcheck.yaml
      flowcheck ls --run other-run --json --config flowcheck.yaml
    """
    listed = reading_store(config_path, run).listing()
    if as_json:
        click.echo(json.dumps([r.to_json() for r in listed.rows], indent=2))
        return
    for line in listed.lines():
        click.echo(line)


@click.command()
@config_option
@click.option("--step", required=True, help=STEP_HELP)
@branch_option
@run_option
@click.option("--tier", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Which tier's manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest.")
@click.option("--verify", is_flag=True, help="Also re-read every file and shard and check their digests.")
@handled
def show(config_path, step, branch, run, prefer, as_json, verify):
    """Summarise one state's manifest: producer, branch, parent chain back to the first step (across
    branches), tensors, files, tiers holding it, and its verification status (manifest integrity,
    signature, same digest in every tier; --verify adds file and shard data digests). Exits 1 when a check fails.

    \b
    Example:
      flowcheck show --step latest --config /tmp/fc-demo/flowcheck.yaml
      flowcheck show --step 40 --verify --config /tmp/fc-demo/flowcheck.yaml
      flowcheck show --step 40 --branch main --config flowcheck.yaml   # the state a rollback left on main
      flowcheck show --step sha256:3f2a9c --config flowcheck.yaml
    """
    from flowcheck.audit import format_chain, parent_chain, step_checks
    from flowcheck.branches import Located
    from flowcheck.restore.source import open_step

    store = reading_store(config_path, run)
    tier, m = open_step(store, step_arg(step), prefer, branch)
    if as_json:
        click.echo(json.dumps(m.to_json(), indent=2))
        return
    at = Located(m.step, tier.branch)
    holders = [t.name for t in store.tiers(include_memory=False) if m.step in store.tier(t.name, at.branch).steps()]
    click.echo(f"run {m.run} step {at}  created {m.created_at}")
    click.echo(f"branch     {_branch_summary(store.history(), at.branch)}")
    click.echo(f"producer   {m.producer.node} flowcheck {m.producer.version} source={m.producer.source}")
    click.echo(f"digest     {m.digest()}")
    click.echo(f"parent     {'none (first step of a lineage)' if m.parent is None else f'step {m.parent.step} {m.parent.manifest_digest}'}")
    click.echo(f"layout     {m.layout_digest}  source tp={m.source_layout.tp} pp={m.source_layout.pp} dp={m.source_layout.dp}")
    click.echo(f"tensors    {len(m.tensors)} ({sum(len(t.shards) for t in m.tensors.values())} shards)")
    click.echo(f"files      {len(m.files)} ({human(m.nbytes)})")
    if m.refs:  # an incremental step (format_version 4): shards it did not write again
        held = ", ".join(f"step {r.step}" + ("" if r.branch == "main" else f" ({r.branch})") for r in m.refs)
        click.echo(f"references {human(m.referenced_nbytes)} in {held}")
    click.echo(f"scalars    optimizer_step={m.scalars.get('optimizer_step')} rng={sorted(m.scalars.get('rng', {}))}")
    click.echo(f"signature  {'hmac-sha256' if m.signature else 'unsigned'}")
    click.echo(f"tiers      {', '.join(holders)}")
    click.echo(f"chain      {format_chain(parent_chain(store, m))}")
    if verify:
        with bytes_bar(f"verify step {at} (files and shard data)") as bar:
            check = step_checks(store, m, data=True, branch=at.branch, progress=bar)
    else:
        check = step_checks(store, m, data=False, branch=at.branch)
    click.echo(f"status     {check.status}")
    for line in check.lines:
        click.echo(f"           {line}")
    sys.exit(0 if check.ok else 1)


def _branch_summary(hist, branch: str) -> str:
    """``b1-2 (current; forks after step 1 of main)``."""
    notes = ["current"] if branch == hist.current() else []
    record = hist.records.get(branch)
    if record is not None and record.fork is not None:
        notes.append(f"forks after step {record.fork.step} of {record.fork.branch or 'a state not stored in this run'}")
    elif record is not None:
        notes.append("a root lineage of its own")
    elif branch != "main":
        notes.append("no fork record (branch.json) found")
    return branch + (f" ({'; '.join(notes)})" if notes else "")


@click.command()
@config_option
@click.option("--state", "state_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A safetensors file, or a torch file (loaded with weights_only=True) of a model state_dict "
                   "or {'model': ..., 'optimizer': ...}.")
@click.option("--step", required=True, type=int, help="Step number to commit it as.")
@click.option("--tier", default="local", type=click.Choice(["local", "object"]), help="Tier to commit to.")
@handled
def snapshot(config_path, state_path, step, tier):
    """Commit a trainer's saved state file as a step (data first, manifest last).

    \b
    Example:
      flowcheck snapshot --state model.safetensors --step 1200 --config flowcheck.yaml
    """
    from flowcheck.restore.state_files import load_snapshot_file

    store = store_for(config_path, progress=True)
    with _progress.activity(f"read {os.path.basename(state_path)}"):
        snap = load_snapshot_file(state_path, store.config.run, step)
    with bytes_bar(f"write step {step} to the {tier} tier") as bar:
        m, said = committed(store, tier, lambda: store.write(snap, tier, progress=bar))
    click.echo(f"{said}: {len(m.tensors)} tensors, {human(m.nbytes)}, digest {m.digest()}")


@click.command()
@config_option
@click.option("--step", default="latest", help="Step to promote (default: 'latest', the newest state of the branch). " + STEP_HELP)
@branch_option
@run_option
@click.option("--to", "dst", default="object", type=click.Choice(["object", "local"]), help="Target tier.")
@handled
def promote(config_path, step, branch, run, dst):
    """Copy a committed step to a slower tier (local -> object by default), verified shard by shard; it keeps its branch.

    \b
    Example:
      flowcheck promote --step 1200 --config flowcheck.yaml
      flowcheck promote --step 1200 --branch b1000-1200 --config flowcheck.yaml
    """
    ref = step_arg(step)
    store = store_for(config_path, progress=True, run=run)
    src = "local" if dst == "object" else "object"
    with bytes_bar(f"promote step {step} {src} -> {dst}") as bar:
        m = store.promote(None if ref == "latest" else ref, src=src, dst=dst, branch=branch, progress=bar)
    held = store.history().by_digest(m.digest())
    click.echo(f"step {held[0] if held else m.step} committed in the {dst} tier ({len(m.files)} files, {human(m.nbytes)})")



@click.command()
@config_option
@run_option
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@handled
def gc(config_path, run, dry_run):
    """Apply retention (keep-last-N, hourly, daily along the current branch; abandoned branches after
    keep_abandoned_hours) per tier; clean abandoned partial writes.  States print as step@branch off main.

    Never deletes the head of the current branch, nor a step it cannot classify.

    \b
    Example:
      flowcheck gc --dry-run --config flowcheck.yaml
      flowcheck gc --run other-run --config flowcheck.yaml
    """
    store = store_for(config_path, run=run)  # only the run named: gc deletes
    states = {s.tier: s for s in store.check_tiers()}  # a configured tier that does not exist: exit 2, named
    with _progress.bar(desc="gc" + (" (dry run)" if dry_run else ""), unit="step") as bar:
        report = store.gc(dry_run=dry_run, progress=bar)
    verb = "would delete" if dry_run else "deleted"
    for tier, deleted in report.deleted.items():
        kept = states_text(report.kept.get(tier, {}))
        if deleted:
            click.echo(f"{tier}: {verb} steps {states_text(deleted)}; keeps {kept}")
        else:
            click.echo(f"{tier}: nothing to delete; keeps {kept}" if report.kept.get(tier) else
                       f"{tier}: no steps" + (f" ({states[tier].describe()})" if tier in states else ""))
        for at in deleted:
            click.echo(f"{tier}:   {at}: {report.why.get(tier, {}).get(at, 'no reason recorded')}")
        for path in report.cleaned.get(tier, []):
            click.echo(f"{tier}: {'would clean' if dry_run else 'cleaned'} {path}")


@click.command()
@config_option
@click.option("--step", required=True, help=STEP_HELP)
@branch_option
@click.option("--tier", default=None, type=click.Choice(["local", "object"]),
              help="Delete it from this tier only (default: every tier holding it).")
@click.option("--force", is_flag=True, help="Also delete the newest state of the current branch (its head).")
@run_option
@handled
def delete(config_path, step, branch, tier, force, run):
    """Delete one stored state, leaving the pruned record GC leaves (audit then reads the gap as deliberate).

    The newest state of the current branch is refused without --force: it is what a restart resumes from.

    \b
    Example:
      flowcheck delete --step 1200 --config flowcheck.yaml
      flowcheck delete --step 40 --branch main --tier local --config flowcheck.yaml
    """
    store = store_for(config_path, run=run)
    rep = store.delete(step_arg(step), tier=tier, branch=branch, force=force)
    head = " (it was the current branch's head)" if rep.was_head else ""
    click.echo(f"deleted step {rep.state} of run {rep.run} from the {' and '.join(rep.tiers)} tier"
               f"{'s' if len(rep.tiers) > 1 else ''}{head}; pruned record left ({rep.manifest_digest})")
