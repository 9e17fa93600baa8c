"""The `flowcheck` command line: the group and its commands, one module per family.

Every command takes ``--config FILE`` (or $FLOWCHECK_CONFIG, or ``flowcheck --config FILE <command>``; the
embedded defaults otherwise).  FlowcheckErrors print as one line and exit 2; audit
exits 1 when it finds a problem.  Long work shows progress on stderr when it
is a terminal (``--no-progress`` or FLOWCHECK_NO_PROGRESS=1 turn it off).  The commands parse and print;
the work lives in the library.
"""
from __future__ import annotations

import logging
import os
import sys

import click

from flowcheck.version import __version__
from flowcheck import progress as _progress
from flowcheck.cli.common import handled, reader_gone


class _OneLineErrors(click.Group):
    """Usage errors (a bad --step, a missing option) as one line and exit 2, like every other error: click's own
    form is three lines (usage, hint, error) that scripts and people must parse apart."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            sys.stdout.flush()  # a reader that went away (`| head -1`) is met here, not in Python's exit
        except BrokenPipeError:
            reader_gone()
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx is not None else "flowcheck"
            click.echo(f"error: {e.format_message()} (see `{command} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flowcheck")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              envvar="FLOWCHECK_LOG_FORMAT", help="Logs on stderr as human text or JSON lines (ts, level, logger, msg, "
              "event fields); json logs at info level unless -v asks for more. Env: FLOWCHECK_LOG_FORMAT.")
@click.option("--no-progress", is_flag=True, envvar="FLOWCHECK_NO_PROGRESS",
              help="No progress bars (they are off anyway when stderr is not a terminal). Env: FLOWCHECK_NO_PROGRESS=1.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Store/policy YAML for the command that follows (same as giving it --config).")
def main(verbose: int, log_format: str, no_progress: bool, config_path: str | None) -> None:
    """flowcheck: multi-tier checkpoint storage for large-model training.

    \b
    Example:
      flowcheck demo --workdir /tmp/fc-demo
      flowcheck ls --config /tmp/fc-demo/flowcheck.yaml
      flowcheck --config /tmp/fc-demo/flowcheck.yaml audit
      flowcheck --log-format json -v serve --config node.yaml
    """
    from flowcheck.logs import configure

    if log_format == "json":
        level = logging.DEBUG if verbose >= 2 else logging.INFO
    else:
        level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    configure(level, log_format)
    if no_progress:
        os.environ[_progress.ENV] = "1"  # also reaches the subprocesses of demo and bench


def _register_commands() -> None:
    from flowcheck.cli.bench import bench_command
    from flowcheck.cli.capture import capture_command, decode_command
    from flowcheck.cli.demo import demo
    from flowcheck.cli.plan import plan_command
    from flowcheck.cli.restore import export, import_, restore
    from flowcheck.cli.serve import serve
    from flowcheck.cli.simulate import simulate_command
    from flowcheck.cli.steps import delete, gc, ls_cmd, promote, show, snapshot
    from flowcheck.cli.verify import audit, diff, lineage

    for cmd in (ls_cmd, show, snapshot, promote, delete, export, restore, serve, diff, import_, audit, lineage, gc, demo):
        main.add_command(cmd)
    for cmd in (simulate_command, decode_command, capture_command, plan_command, bench_command):
        main.add_command(_handled_command(cmd))


def _handled_command(cmd: click.Command) -> click.Command:
    cmd.callback = handled(cmd.callback)
    return cmd


_register_commands()

if __name__ == "__main__":
    main()
