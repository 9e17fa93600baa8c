"""The `flowcheck` command line: list, show, snapshot, promote, export, audit, lineage, gc, demo.

Every command takes ``--config FILE`` (or $FLOWCHECK_CONFIG; the embedded
defaults otherwise).  FlowcheckErrors print as one line and exit 2; audit
exits 1 when it finds a problem.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys

import click

from flowcheck import __version__
from flowcheck.errors import FlowcheckError

log = logging.getLogger("flowcheck")


def _config_option(fn):
    return click.option(
        "--config", "config_path", envvar="FLOWCHECK_CONFIG", type=click.Path(dir_okay=False),
        help="Store/policy YAML (default: $FLOWCHECK_CONFIG, else embedded defaults: ./flowcheck-data, file:// object store).",
    )(fn)


def _handled(fn):
    """Turn FlowcheckErrors into one clear line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlowcheckError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)

    return wrapper


def _store(config_path: str | None, progress: bool = False):
    from flowcheck.store import open_store

    return open_store(config_path, progress=progress)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flowcheck")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """flowcheck: multi-tier checkpoint storage for large-model training.

    \b
    Example:
      flowcheck demo --workdir /tmp/fc-demo
      flowcheck ls --config /tmp/fc-demo/flowcheck.yaml
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command("ls")
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handled
def ls_cmd(config_path, as_json):
    """List committed steps per tier with size, time, source and status.

    \b
    Example:
      flowcheck ls --config /tmp/fc-demo/flowcheck.yaml
    """
    store = _store(config_path)
    rows = []
    for tier in store.tiers(include_memory=False):
        for step in tier.steps():
            try:
                m = tier.manifest(step)
                rows.append({"tier": tier.name, "step": step, "bytes": m.nbytes, "created_at": m.created_at,
                             "source": m.producer.source, "status": "committed", "digest": m.digest()})
            except FlowcheckError as e:
                rows.append({"tier": tier.name, "step": step, "bytes": 0, "created_at": "", "source": "",
                             "status": f"unreadable: {e}", "digest": ""})
        for name in tier.incomplete():
            rows.append({"tier": tier.name, "step": None, "bytes": 0, "created_at": "", "source": "",
                         "status": f"incomplete ({name})", "digest": ""})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"run {store.config.run}   local {store.local.root}   object {store.object.url if store.object else '-'}")
    click.echo(f"{'tier':7} {'step':>9} {'size':>10}  {'created (UTC)':27} {'source':7} status")
    for r in rows:
        step = "-" if r["step"] is None else str(r["step"])
        click.echo(f"{r['tier']:7} {step:>9} {_size(r['bytes']):>10}  {r['created_at']:27} {r['source']:7} {r['status']}")
    if not rows:
        click.echo("(no steps yet: run `flowcheck demo` or a checkpoint node)")


@main.command()
@_config_option
@click.option("--step", required=True, help="Step number or 'latest'.")
@click.option("--tier", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Which tier's manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest.")
@_handled
def show(config_path, step, prefer, as_json):
    """Summarise one step's manifest: producer, parent chain, tensors, files, tiers holding it.

    \b
    Example:
      flowcheck show --step latest --config /tmp/fc-demo/flowcheck.yaml
    """
    store = _store(config_path)
    m = store.manifest(step if step == "latest" else int(step), prefer)
    if as_json:
        click.echo(json.dumps(m.to_json(), indent=2))
        return
    holders = [t.name for t in store.tiers(include_memory=False) if m.step in t.steps()]
    click.echo(f"run {m.run} step {m.step}  created {m.created_at}")
    click.echo(f"producer   {m.producer.node} flowcheck {m.producer.version} source={m.producer.source}")
    click.echo(f"digest     {m.digest()}")
    click.echo(f"parent     {'none (first step of a lineage)' if m.parent is None else f'step {m.parent.step} {m.parent.manifest_digest}'}")
    click.echo(f"layout     {m.layout_digest}  source tp={m.source_layout.tp} pp={m.source_layout.pp} dp={m.source_layout.dp}")
    click.echo(f"tensors    {len(m.tensors)} ({sum(len(t.shards) for t in m.tensors.values())} shards)")
    click.echo(f"files      {len(m.files)} ({_size(m.nbytes)})")
    click.echo(f"scalars    optimizer_step={m.scalars.get('optimizer_step')} rng={sorted(m.scalars.get('rng', {}))}")
    click.echo(f"signature  {'hmac-sha256' if m.signature else 'unsigned'}")
    click.echo(f"tiers      {', '.join(holders)}")


@main.command()
@_config_option
@click.option("--state", "state_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A safetensors file, or a torch file (loaded with weights_only=True) of a model state_dict "
                   "or {'model': ..., 'optimizer': ...}.")
@click.option("--step", required=True, type=int, help="Step number to commit it as.")
@click.option("--tier", default="local", type=click.Choice(["local", "object"]), help="Tier to commit to.")
@_handled
def snapshot(config_path, state_path, step, tier):
    """Commit a trainer's saved state file as a step (data first, manifest last).

    \b
    Example:
      flowcheck snapshot --state model.safetensors --step 1200 --config flowcheck.yaml
    """
    from flowcheck.state_files import load_state_file

    store = _store(config_path, progress=True)
    snap = load_state_file(state_path, store.config.run, step)
    m = store.write(snap, tier)
    click.echo(f"committed step {m.step} to the {tier} tier: {len(m.tensors)} tensors, {_size(m.nbytes)}, digest {m.digest()}")


@main.command()
@_config_option
@click.option("--step", default="latest", help="Step to promote (default: the newest local step).")
@click.option("--to", "dst", default="object", type=click.Choice(["object", "local"]), help="Target tier.")
@_handled
def promote(config_path, step, dst):
    """Copy a committed step to a slower tier (local -> object by default), verified shard by shard.

    \b
    Example:
      flowcheck promote --step 1200 --config flowcheck.yaml
    """
    store = _store(config_path, progress=True)
    src = "local" if dst == "object" else "object"
    m = store.promote(None if step == "latest" else int(step), src=src, dst=dst)
    click.echo(f"step {m.step} committed in the {dst} tier ({len(m.files)} files, {_size(m.nbytes)})")


@main.command()
@_config_option
@click.option("--step", required=True, help="Step number or 'latest'.")
@click.option("--format", "fmt", default="safetensors", type=click.Choice(["safetensors"]), help="Output format.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output file.")
@click.option("--from", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Tier to read.")
@click.option("--no-optim", is_flag=True, help="Model tensors only.")
@_handled
def export(config_path, step, fmt, out, prefer, no_optim):
    """Write one step as a consolidated safetensors file (full tensors, every digest verified).

    \b
    Example:
      flowcheck export --step latest --format safetensors --out model.safetensors --config flowcheck.yaml
    """
    from flowcheck.restore import export_safetensors

    store = _store(config_path)
    tier = store.find(step if step == "latest" else int(step), prefer if prefer != "auto" else "auto")
    if tier.name == "memory":
        tier = store.find(tier.latest() if step == "latest" else int(step), "local")
    m = tier.manifest(tier.latest() if step == "latest" else int(step))
    size, digest = export_safetensors(tier, m, out, include_optimizer=not no_optim)
    click.echo(f"exported step {m.step} from the {tier.name} tier to {out} ({_size(size)}, {digest})")


@main.command()
@_config_option
@click.option("--no-data", is_flag=True, help="Check manifests, files and chain, skip re-reading shard data.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@_handled
def audit(config_path, no_data, as_json):
    """Verify every step in every tier: manifests, file digests, shard digests, hash chain, gaps, forks.

    Exits 1 if anything is wrong.

    \b
    Example:
      flowcheck audit --config /tmp/fc-demo/flowcheck.yaml
    """
    from flowcheck.audit import audit as run_audit
    from flowcheck.audit import to_json

    report = run_audit(_store(config_path), data=not no_data)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, **to_json(report)}, indent=2))
    else:
        for p in report.problems:
            click.echo(str(p))
        for parent, children in report.forks:
            click.echo(f"[info] lineage fork after step {parent}: branches start at steps {children}")
        status = "OK" if report.ok else "FAILED"
        errors = sum(p.severity == "error" for p in report.problems)
        click.echo(f"audit {status}: {report.checked_steps} step copies checked, {len(report.nodes)} distinct states, "
                   f"{errors} errors, {len(report.problems) - errors} warnings")
    sys.exit(0 if report.ok else 1)


@main.command()
@_config_option
@click.option("--format", "fmt", default="text", type=click.Choice(["text", "json", "dot"]), help="Output format.")
@_handled
def lineage(config_path, fmt):
    """Draw the run's lineage tree (steps, tiers holding each, forks).

    \b
    Example:
      flowcheck lineage --format dot --config flowcheck.yaml | dot -Tpng > lineage.png
    """
    from flowcheck.audit import dumps
    from flowcheck.audit import lineage as run_lineage

    click.echo(dumps(run_lineage(_store(config_path)), fmt))


@main.command()
@_config_option
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@_handled
def gc(config_path, dry_run):
    """Apply retention (keep-last-N, hourly, daily) per tier; clean abandoned partial writes.

    Never deletes the newest committed step of a tier, nor a step it cannot classify.

    \b
    Example:
      flowcheck gc --dry-run --config flowcheck.yaml
    """
    report = _store(config_path).gc(dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    for tier, steps in report.deleted.items():
        click.echo(f"{tier}: {verb} steps {steps or 'none'}; keeps {sorted(report.kept.get(tier, {}))}")
        for path in report.cleaned.get(tier, []):
            click.echo(f"{tier}: {'would clean' if dry_run else 'cleaned'} {path}")


@main.command()
@_config_option
@click.option("--workdir", default="./flowcheck-demo", show_default=True, type=click.Path(file_okay=False),
              help="New or empty folder (or one a previous demo made); gets flowcheck.yaml describing the store.")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(1), help="Training steps.")
@click.option("--local-every", default=25, show_default=True, type=click.IntRange(1), help="Local snapshot every N steps.")
@click.option("--object-seconds", default=2.0, show_default=True, type=click.FloatRange(0.1),
              help="Object promotion period (the hourly policy, compressed to seconds).")
@click.option("--object-url", default=None, help="Object store URL (default file://WORKDIR/object; s3://bucket/prefix uses the AWS env).")
@_handled
def demo(config_path, workdir, steps, local_every, object_seconds, object_url):
    """Train a small GPT on CPU while snapshotting per the policy, then list, audit and export.

    \b
    Example:
      flowcheck demo --workdir /tmp/fc-demo
      AWS_ENDPOINT_URL=http://127.0.0.1:5000 flowcheck demo --object-url s3://demo-bucket/ckpt
    """
    from flowcheck.demo import loss_summary, run_demo

    cfg, res = run_demo(workdir, steps=steps, object_url=object_url, local_every=local_every,
                        object_seconds=object_seconds, echo=click.echo)
    cfg_path = os.path.join(os.path.abspath(workdir), "flowcheck.yaml")
    stats = res["stats"]
    click.echo(f"\ntrained steps {res['first_step']}..{res['last_step']}: {loss_summary(res['losses'])}")
    click.echo(f"trainer time: {res['train_seconds']:.2f} s training, {res['push_seconds']:.2f} s pushing state to RAM "
               f"({100 * res['push_seconds'] / max(res['train_seconds'], 1e-9):.1f}% — the only cost on the training thread)")
    click.echo(f"local snapshots at steps {stats.local_snapshots}; object promotions {stats.promotions}; "
               f"{stats.coalesced} triggers coalesced; {res['cow_copies']} copy-on-write shard copies")
    if stats.errors:
        click.echo(f"policy errors: {stats.errors}", err=True)
    click.echo("\n$ flowcheck ls")
    ctx = click.get_current_context()
    ctx.invoke(ls_cmd, config_path=cfg_path, as_json=False)
    from flowcheck.audit import audit as run_audit
    from flowcheck.restore import export_safetensors
    from flowcheck.store import open_store

    store = open_store(cfg_path)
    report = run_audit(store)
    click.echo(f"\n$ flowcheck audit\naudit {'OK' if report.ok else 'FAILED'}: {report.checked_steps} step copies verified")
    for p in report.problems:
        click.echo(str(p))
    last = res["last_step"]
    tier = store.find(last, "object") if store.object and last in store.object.steps() else store.find(last, "local")
    out = os.path.join(os.path.abspath(workdir), "export", f"step-{last}.safetensors")
    size, _ = export_safetensors(tier, tier.manifest(last), out)
    from safetensors.torch import load_file

    from flowcheck.torch import to_numpy

    loaded = load_file(out)
    exact = all(to_numpy(loaded[s.tensor]).tobytes() == a.tobytes() and loaded[s.tensor].shape == a.shape
                for s, a in res["final_state"].items())
    click.echo(f"\n$ flowcheck export --step {last} --out {out}\nexported {_size(size)} from the {tier.name} tier; "
               f"safetensors.torch.load_file == live trainer state bit for bit: {exact}")
    click.echo(f"\nnext: flowcheck lineage --config {cfg_path}")
    ok = report.ok and exact and not stats.errors
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
