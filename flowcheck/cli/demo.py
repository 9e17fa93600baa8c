"""`flowcheck demo`: the main job (push half, then mirror half)."""
from __future__ import annotations

import os
import sys

import click

from flowcheck import progress as _progress
from flowcheck.cli.common import (
    config_option,
    echo_over,
    handled,
    human,
)
from flowcheck.cli.steps import ls_cmd


@click.command()
@config_option
@click.option("--workdir", default="./flowcheck-demo", show_default=True, type=click.Path(file_okay=False),
              help="New or empty folder (or one a previous demo made); gets flowcheck.yaml describing the store.")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(1), help="Training steps.")
@click.option("--local-every", default=25, show_default=True, type=click.IntRange(1), help="Local snapshot every N steps.")
@click.option("--object-seconds", default=2.0, show_default=True, type=click.FloatRange(0.1),
              help="Object promotion period (the hourly policy, compressed to seconds).")
@click.option("--object-url", default=None, help="Object store URL (default file://WORKDIR/object; s3://bucket/prefix uses the AWS env).")
@handled
def demo(config_path, workdir, steps, local_every, object_seconds, object_url):
    """A trainer pushes to a node; it is killed, restored, resumed (same losses); then list, audit, export;
    then mirror capture: simulate a DP ring, rebuild its state from mirrored frames, diff with the trainer.

    \b
    Example:
      flowcheck demo --workdir /tmp/fc-demo
      AWS_ENDPOINT_URL=http://127.0.0.1:5000 flowcheck demo --object-url s3://demo-bucket/ckpt
    """
    from flowcheck.demo import loss_summary, run_demo

    with _progress.activity("demo: push half") as bar:
        cfg, res = run_demo(workdir, steps=steps, object_url=object_url, local_every=local_every,
                            object_seconds=object_seconds, echo=echo_over(bar))
    cfg_path = os.path.join(os.path.abspath(workdir), "flowcheck.yaml")
    status = res["status"]
    click.echo(f"\ntrained steps {res['first_step']}..{res['last_step']}: {loss_summary(res['losses'])}")
    click.echo(f"node: {status['push']['steps']} pushed steps applied, {status['push']['aborted_steps']} aborted "
               f"(a push cut short by the kill is aborted, never half-applied), local snapshots {status['policy']['local_snapshots']}, "
               f"object promotions {status['policy']['promotions']}")
    policy_errors = status["policy"]["errors"]
    if policy_errors:
        click.echo(f"policy errors: {policy_errors}", err=True)
    click.echo("\n$ flowcheck ls")
    ctx = click.get_current_context()
    ctx.invoke(ls_cmd, config_path=cfg_path, run=None, as_json=False)
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
    click.echo(f"\n$ flowcheck export --step {last} --out {out}\nexported {human(size)} from the {tier.name} tier; "
               f"safetensors.torch.load_file == live trainer state bit for bit: {exact}")
    from flowcheck.cli.demo_mirror import run_mirror_demo

    with _progress.activity("demo: mirror half") as bar:
        mirror = run_mirror_demo(workdir, echo=echo_over(bar))
    click.echo(f"\nnext: flowcheck lineage --config {cfg_path}")
    ok = report.ok and exact and res["identical"] and mirror["exact"]
    sys.exit(0 if ok else 1)


