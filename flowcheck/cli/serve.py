"""`flowcheck serve`: run a checkpoint node until SIGTERM/Ctrl-C."""
from __future__ import annotations

import click

from flowcheck.cli.common import (
    config_option,
    handled,
)


@click.command()
@config_option
@handled
def serve(config_path):
    """Run a checkpoint node: take trainers' pushes into RAM, snapshot per the policy, serve the control API.

    Listens on serve.push for Checkpointer pushes and serve.http (loopback by default) for
    /status /steps /snapshot /resync /metrics. SIGTERM or Ctrl-C: stop taking pushes, finish
    the snapshot in flight, exit. With FLOWCHECK_NODE_TOKEN (serve.auth_token_env) in its
    environment and the trainers', pushes and POSTs need that token; without it the node is
    unauthenticated and listens on loopback only.

    \b
    Example:
      flowcheck serve --config configs/node.yaml
    """
    import signal
    import threading

    from flowcheck import config as config_mod
    from flowcheck.node.service import Node, tune_allocator

    tune_allocator()
    node = Node(config_mod.load(config_path)).start()
    click.echo(f"flowcheck node: run {node.config.run}; push tcp://{node.receiver.address[0]}:{node.receiver.address[1]}; "
               f"control http://{node.api.address[0]}:{node.api.address[1]}", err=True)

    def _stop(signum, _frame):
        click.echo(f"flowcheck node: {signal.Signals(signum).name}: finishing work in flight", err=True)
        threading.Thread(target=node.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    node.wait()
    click.echo("flowcheck node: stopped", err=True)

