"""What every command shares: --config, one-line errors (exit 2), the store to read, --step/--branch parsing."""
from __future__ import annotations

import functools
import logging
import re
import sys

import click

from flowcheck import progress as _progress
from flowcheck.errors import FlowcheckError

log = logging.getLogger("flowcheck")

CONFIG_HELP = ("Store/policy YAML (default: `flowcheck --config F`, else $FLOWCHECK_CONFIG, else embedded defaults: "
               "./flowcheck-data, file:// object store).")


def _group_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``flowcheck --config F audit`` means ``flowcheck audit --config F``: the command's own option wins, then the
    group's, then $FLOWCHECK_CONFIG."""
    source = ctx.get_parameter_source("config_path")
    if source is click.core.ParameterSource.COMMANDLINE:
        return value
    return ctx.find_root().params.get("config_path") or value


def config_option(fn):
    return click.option(
        "--config", "config_path", envvar="FLOWCHECK_CONFIG", type=click.Path(dir_okay=False),
        callback=_group_config, help=CONFIG_HELP,
    )(fn)


def handled(fn):
    """Turn FlowcheckErrors into one clear line on stderr and exit status 2.

    The library turns every failure it can name (a full disk, a forged manifest, memory that runs out) into a
    FlowcheckError; anything else is a bug or a case not foreseen: one line too, and its traceback with -v.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlowcheckError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except BrokenPipeError:
            reader_gone()
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # usage errors, ctx.exit(), Ctrl-C: click reports them itself
        except Exception as e:  # noqa: BLE001 - the last resort: one line instead of a traceback
            if verbosity():
                import traceback

                traceback.print_exc(file=sys.stderr)
            detail = " ".join(str(e).split())
            detail = detail if len(detail) <= 300 else detail[:297] + "..."
            more = "the traceback is above" if verbosity() else "re-run with -v for the traceback"
            click.echo(f"error: unexpected {type(e).__name__}{': ' + detail if detail else ''} "
                       f"(a flowcheck bug or a case it does not handle yet; {more}, and please report it)", err=True)
            sys.exit(2)

    return wrapper


PIPE_CLOSED = 141  # the exit status of a command whose reader closed its output (128 + SIGPIPE, as a shell shows)


def reader_gone() -> None:
    """The reader of stdout closed the pipe (``flowcheck ls | head -1``): stop quietly, as a tool that SIGPIPE ends
    does; nothing more is written to the closed pipe."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # Python's own flush of stdout at exit would fail again
    sys.exit(PIPE_CLOSED)


def verbosity() -> int:
    """The -v count given to the `flowcheck` group (0 outside a click context)."""
    ctx = click.get_current_context(silent=True)
    return (ctx.find_root().params.get("verbose") or 0) if ctx is not None else 0


def store_for(config_path: str | None, progress: bool = False, run: str | None = None):
    from dataclasses import replace

    from flowcheck import config as config_mod
    from flowcheck.store import open_store

    cfg = config_mod.load(config_path)
    if run is not None and run != cfg.run:
        cfg = replace(cfg, run=run)
    return open_store(cfg, progress=progress and _progress.enabled())


def reading_store(config_path: str | None, run: str | None, progress: bool = False):
    """The store to read from: ``--run``, else the config's run — or, when that run has no step and the
    local tier holds exactly one run, that one (``--run`` may be left out when the store holds one run)."""
    store = store_for(config_path, progress=progress, run=run)
    if run is not None or any(t.steps() for t in store.tiers(include_memory=False)):
        return store
    runs = store.runs()
    if len(runs) == 1:
        log.info("run %r has no steps; reading the store's only run %r", store.config.run, runs[0])
        return store_for(config_path, progress=progress, run=runs[0])
    return store


def outside_tiers(store, path: str, flag: str) -> None:
    """A file the CLI writes never lands inside a tier's folder: it could replace a committed step's files (an
    ``export --out`` naming a step's manifest.json overwrote it)."""
    import os

    from flowcheck.errors import ConfigError

    roots = [store.config.tiers.local.root]
    url = store.config.tiers.object.url
    if url.startswith("file://"):
        roots.append(url[len("file://"):])
    target = os.path.realpath(path)
    for root in roots:
        real = os.path.realpath(root)
        if target == real or target.startswith(real.rstrip(os.sep) + os.sep):
            raise ConfigError(f"{flag} {path}: expected a path outside the store, found one inside the tier folder "
                              f"{root} (writing there could replace a stored step's files); choose another path")


STEP_HELP = "Step number, 'latest', or a manifest digest prefix sha256:<hex> (see `flowcheck ls --json`)."
_DIGEST_PREFIX = re.compile(r"sha256:[0-9a-fA-F]{1,64}")


def step_arg(step: str) -> int | str:
    """--step as the store resolves it (flowcheck/branches.py): a number, 'latest', or a digest prefix."""
    if step.lower() == "latest":
        return "latest"
    if _DIGEST_PREFIX.fullmatch(step):
        return step.lower()
    if not (step.isascii() and step.isdigit()):
        raise click.BadParameter(f"expected a step number, 'latest' or a manifest digest prefix 'sha256:<hex>', "
                                 f"found {step!r}; `flowcheck ls` lists the run's steps", param_hint="--step")
    return int(step)


def run_option(fn):
    return click.option(
        "--run", default=None, metavar="NAME",
        help="Run to read (default: the config's run, or the store's only run when the config's has no step).",
    )(fn)


def branch_option(fn):
    return click.option(
        "--branch", default=None, metavar="NAME",
        help="Branch to resolve --step on (default: the current branch; `flowcheck ls` lists them), "
             "e.g. --branch main for the state a rollback left behind.",
    )(fn)


def bytes_bar(desc: str):
    """A byte-counting bar; the library call it is passed to sets its total before the first update."""
    return _progress.bar(desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


def at_text(manifest, tier) -> str:
    """A state as flowcheck prints it: ``40`` on main, ``40@b30-40`` on another branch."""
    from flowcheck.branches import Located

    return str(Located(manifest.step, tier.branch))


human = _progress.human_bytes


def states_text(located) -> str:
    """``[1, 2, 2@b1-2, 3]``: by step, main's state first."""
    return "[" + ", ".join(str(k) for k in sorted(located, key=lambda k: (k.step, k.branch != "main", k.branch))) + "]"


def echo_over(bar):
    """click.echo that clears the progress line first (tqdm redraws it below the text)."""
    def echo(message: str = "", **kw) -> None:
        if bar.disable:
            click.echo(message, **kw)
        else:
            with bar.external_write_mode():
                click.echo(message, **kw)

    return echo


def committed(store, tier: str, write):
    """Run ``write()`` (a commit to ``tier``) and say what it did: ``(manifest, "committed step 7@root-7 of run r to …")``, or
    ``"step 7 of run r is already committed … with this content: nothing written"`` when the same state was there before."""
    before = {s.digest for s in store.history([tier]).states}
    m = write()
    held = store.history([tier]).by_digest(m.digest())
    at = held[0] if held else m.step  # "7@root-7" when a different state already held step 7: both are kept
    if m.digest() in before:
        return m, f"step {at} of run {m.run} is already committed in the {tier} tier with this content: nothing written"
    return m, f"committed step {at} of run {m.run} to the {tier} tier"
