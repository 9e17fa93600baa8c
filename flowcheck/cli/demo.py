"""`flowcheck demo`: the main job (push half, checks, mirror half); the work is flowcheck.demo's, this prints it."""
from __future__ import annotations

import sys

import click

from flowcheck import progress as _progress
from flowcheck.cli.common import _group_config, echo_over, handled, reading_store
from flowcheck.errors import FlowcheckError


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), callback=_group_config,
              help="Store/policy YAML whose run, tiers and policy the demo uses (field by field: an option given "
                   "here wins, then this file, then the demo's defaults). $FLOWCHECK_CONFIG is not read: the demo "
                   "writes into the store it is given.")
@click.option("--workdir", default="./flowcheck-demo", show_default=True, type=click.Path(file_okay=False),
              help="New or empty folder (or one a previous demo made); gets flowcheck.yaml describing the store.")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(1), help="Training steps.")
@click.option("--local-every", default=None, type=click.IntRange(1),
              help="Local snapshot every N steps (default: the config's policy.local.every_steps, else 25).")
@click.option("--object-seconds", default=None, type=click.FloatRange(0.1),
              help="Object promotion period in seconds, the hourly policy compressed (default: the config's "
                   "policy.object.every_seconds, else 2).")
@click.option("--object-url", default=None,
              help="Object store URL (default: the config's tiers.object.url, else file://WORKDIR/object; "
                   "s3://bucket/prefix uses the AWS env).")
@handled
def demo(config_path, workdir, steps, local_every, object_seconds, object_url):
    """A trainer pushes to a node; it is killed, restored, resumed (same losses); then list, audit, export,
    and restore into Megatron at TP=2/PP=2 in both formats, each read back and compared with the trainer's
    state; then mirror capture: simulate a DP ring, rebuild its state from mirrored frames, diff with the
    trainer.  Ends with `demo: PASSED — …` or `demo: FAILED — …` (exit status 1; 2 when it cannot finish).

    Every `$ flowcheck …` line it prints runs as printed, from any folder.  With --config, the demo honours
    the file's run, tiers and policy (keep_last, …) and fills in only what it leaves out; its relative folders
    are taken from WORKDIR (the store stays under it); the merged config is written to WORKDIR/flowcheck.yaml.
    A policy that promotes hourly does not reach the object tier in a demo: the verdict says so.  About 25 s
    on 2 cores.

    \b
    Example:
      flowcheck demo --workdir /tmp/fc-demo
      echo 'policy: {local: {keep_last: 1000}}' > /tmp/keepall.yaml
      flowcheck demo --workdir /tmp/fc-keep --config /tmp/keepall.yaml
      AWS_ENDPOINT_URL=http://127.0.0.1:5000 flowcheck demo --object-url s3://demo-bucket/ckpt
    """
    from flowcheck.demo import DemoOptions, prepare

    opts = DemoOptions(workdir, steps, config_path, local_every, object_seconds, object_url)
    cfg = prepare(opts)  # a bad folder, option or config: one `error:` line, exit status 2, nothing run
    try:
        summary = _run(opts, cfg)
    except FlowcheckError as e:  # the demo could not finish: that is its verdict too
        click.echo(f"demo: FAILED — {e}")
        sys.exit(2)
    click.echo(summary.verdict)
    sys.exit(0 if summary.ok else 1)


def _run(opts, cfg):
    from flowcheck.demo import command, run_mirror, run_push, verify

    with _progress.activity("demo: push half") as bar:
        push = run_push(opts, cfg, echo=echo_over(bar))
    status = push.status
    click.echo(f"\ntrained steps {push.first}..{push.last}: {push.loss_summary}")
    click.echo(f"node: {status['push']['steps']} pushed steps applied, {status['push']['aborted_steps']} aborted "
               f"(a push cut short by the kill is aborted, never half-applied), local snapshots "
               f"{status['policy']['local_snapshots']}, object promotions {status['policy']['promotions']}")
    if status["policy"]["errors"]:
        click.echo(f"policy errors: {status['policy']['errors']}", err=True)
    with _progress.activity("demo: audit, export, restore") as bar:
        echo = echo_over(bar)
        show = _printer(echo)

        def on_check(check) -> None:
            show(check)
            if check.name == "resume":  # then what the store holds, as `flowcheck ls` lists it
                echo(f"\n$ {command('ls', '--config', push.config_path)}")
                for line in reading_store(push.config_path, None).listing().lines():
                    echo(line)

        summary = verify(push, on_check=on_check)
    with _progress.activity("demo: mirror half") as bar:
        echo = echo_over(bar)
        echo("")
        printer = _printer(echo, blank=False)
        checks = run_mirror(opts.workdir)
        for check in checks:
            printer(check)
    click.echo(f"\nnext: {command('lineage', '--config', push.config_path)}")
    return summary.plus(*checks)


def _printer(echo, blank: bool = True):
    def show(check) -> None:
        if check.command:
            echo(f"{chr(10) if blank else ''}$ {check.command}")
        for line in check.report:
            echo(line)

    return show
