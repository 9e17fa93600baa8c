"""The `flowcheck` command line: list, show, diff, snapshot, promote, export, restore, import, serve, audit, lineage, gc,
demo, bench.

Every command takes ``--config FILE`` (or $FLOWCHECK_CONFIG; the embedded
defaults otherwise).  FlowcheckErrors print as one line and exit 2; audit
exits 1 when it finds a problem.  Long work shows progress on stderr when it
is a terminal (``--no-progress`` or FLOWCHECK_NO_PROGRESS=1 turn it off).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys

import click

from flowcheck import __version__
from flowcheck import progress as _progress
from flowcheck.errors import FlowcheckError

log = logging.getLogger("flowcheck")


def _config_option(fn):
    return click.option(
        "--config", "config_path", envvar="FLOWCHECK_CONFIG", type=click.Path(dir_okay=False),
        help="Store/policy YAML (default: $FLOWCHECK_CONFIG, else embedded defaults: ./flowcheck-data, file:// object store).",
    )(fn)


def _handled(fn):
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
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # usage errors, ctx.exit(), Ctrl-C: click reports them itself
        except Exception as e:  # noqa: BLE001 - the last resort: one line instead of a traceback
            if _verbosity():
                import traceback

                traceback.print_exc(file=sys.stderr)
            detail = " ".join(str(e).split())
            detail = detail if len(detail) <= 300 else detail[:297] + "..."
            more = "the traceback is above" if _verbosity() else "re-run with -v for the traceback"
            click.echo(f"error: unexpected {type(e).__name__}{': ' + detail if detail else ''} "
                       f"(a flowcheck bug or a case it does not handle yet; {more}, and please report it)", err=True)
            sys.exit(2)

    return wrapper


def _verbosity() -> int:
    """The -v count given to the `flowcheck` group (0 outside a click context)."""
    ctx = click.get_current_context(silent=True)
    return (ctx.find_root().params.get("verbose") or 0) if ctx is not None else 0


def _store(config_path: str | None, progress: bool = False, run: str | None = None):
    from dataclasses import replace

    from flowcheck import config as config_mod
    from flowcheck.store import open_store

    cfg = config_mod.load(config_path)
    if run is not None and run != cfg.run:
        cfg = replace(cfg, run=run)
    return open_store(cfg, progress=progress and _progress.enabled())


def _reading_store(config_path: str | None, run: str | None, progress: bool = False):
    """The store to read from: ``--run``, else the config's run — or, when that run has no step and the
    local tier holds exactly one run, that one (``--run`` may be left out when the store holds one run)."""
    store = _store(config_path, progress=progress, run=run)
    if run is not None or any(t.steps() for t in store.tiers(include_memory=False)):
        return store
    runs = store.runs()
    if len(runs) == 1:
        log.info("run %r has no steps; reading the store's only run %r", store.config.run, runs[0])
        return _store(config_path, progress=progress, run=runs[0])
    return store


STEP_HELP = "Step number, 'latest', or a manifest digest prefix sha256:<hex> (see `flowcheck ls --json`)."
_DIGEST_PREFIX = re.compile(r"sha256:[0-9a-fA-F]{1,64}")


def _step_arg(step: str) -> int | str:
    """--step as the store resolves it (flowcheck/branches.py): a number, 'latest', or a digest prefix."""
    if step == "latest":
        return step
    if _DIGEST_PREFIX.fullmatch(step):
        return step.lower()
    if not (step.isascii() and step.isdigit()):
        raise click.BadParameter(f"expected a step number, 'latest' or a manifest digest prefix 'sha256:<hex>', "
                                 f"found {step!r}; `flowcheck ls` lists the run's steps", param_hint="--step")
    return int(step)


def _branch_option(fn):
    return click.option(
        "--branch", default=None, metavar="NAME",
        help="Branch to resolve --step on (default: the current branch; `flowcheck ls` lists them), "
             "e.g. --branch main for the state a rollback left behind.",
    )(fn)


def _bytes_bar(desc: str):
    """A byte-counting bar; the library call it is passed to sets its total before the first update."""
    return _progress.bar(desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


def _at(manifest, tier) -> str:
    """A state as flowcheck prints it: ``40`` on main, ``40@b30-40`` on another branch."""
    from flowcheck.branches import Located

    return str(Located(manifest.step, tier.branch))


_size = _progress.human_bytes


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flowcheck")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              envvar="FLOWCHECK_LOG_FORMAT", help="Logs on stderr as human text or JSON lines (ts, level, logger, msg, "
              "event fields); json logs at info level unless -v asks for more. Env: FLOWCHECK_LOG_FORMAT.")
@click.option("--no-progress", is_flag=True, envvar="FLOWCHECK_NO_PROGRESS",
              help="No progress bars (they are off anyway when stderr is not a terminal). Env: FLOWCHECK_NO_PROGRESS=1.")
def main(verbose: int, log_format: str, no_progress: bool) -> None:
    """flowcheck: multi-tier checkpoint storage for large-model training.

    \b
    Example:
      flowcheck demo --workdir /tmp/fc-demo
      flowcheck ls --config /tmp/fc-demo/flowcheck.yaml
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


@main.command("ls")
@_config_option
@click.option("--run", default=None, help="Run name (default: the config's run, or the store's only run).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one object per row, with its branch).")
@_handled
def ls_cmd(config_path, run, as_json):
    """List committed steps per tier and branch with size, time, source and status; * marks the current
    branch (the one whose newest state was committed last: `latest` and GC follow it).

    \b
    Example:
      flowcheck ls --config /tmp/fc-demo/flowcheck.yaml
      flowcheck ls --run other-run --json --config flowcheck.yaml
    """
    store = _reading_store(config_path, run)
    current = store.history().current()
    rows = [row for t in store.tiers(include_memory=False) for bt in store.branch_tiers(t.name)
            for row in _ls_rows(bt, current)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"run {store.config.run}   current branch {current}   local {store.local.root}   "
               f"object {store.object.url if store.object else '-'}")
    width = max([len("branch")] + [len(r["branch"]) + 2 for r in rows])
    click.echo(f"{'tier':7} {'branch':{width}} {'step':>9} {'size':>10}  {'created (UTC)':27} {'source':7} status")
    for r in rows:
        step = "-" if r["step"] is None else str(r["step"])
        branch = r["branch"] + (" *" if r["current"] else "")
        click.echo(f"{r['tier']:7} {branch:{width}} {step:>9} {_size(r['bytes']):>10}  {r['created_at']:27} "
                   f"{r['source']:7} {r['status']}")
    if not rows:
        click.echo("(no steps yet: run `flowcheck demo` or a checkpoint node)")


def _ls_rows(tier, current: str) -> list[dict]:
    """One tier at one branch: a row per committed step, then one per incomplete write."""
    base = {"tier": tier.name, "branch": tier.branch, "current": tier.branch == current}
    empty = {"bytes": 0, "created_at": "", "source": "", "digest": ""}
    rows = []
    for step in tier.steps():
        try:
            m = tier.manifest(step)
        except FlowcheckError as e:
            rows.append({**base, "step": step, **empty, "status": f"unreadable: {e}"})
            continue
        rows.append({**base, "step": step, "bytes": m.nbytes, "created_at": m.created_at,
                     "source": m.producer.source, "status": "committed", "digest": m.digest()})
    rows += [{**base, "step": None, **empty, "status": f"incomplete ({name})"} for name in tier.incomplete()]
    return rows


@main.command()
@_config_option
@click.option("--step", required=True, help=STEP_HELP)
@_branch_option
@click.option("--tier", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Which tier's manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest.")
@click.option("--verify", is_flag=True, help="Also re-read every file and shard and check their digests.")
@_handled
def show(config_path, step, branch, prefer, as_json, verify):
    """Summarise one state's manifest: producer, branch, parent chain back to the first step (across
    branches), tensors, files, tiers holding it, and its verification status (manifest integrity,
    signature, same digest in every tier; --verify adds file and shard data digests).

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

    store = _store(config_path)
    tier, m = open_step(store, _step_arg(step), prefer, branch)
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
    click.echo(f"files      {len(m.files)} ({_size(m.nbytes)})")
    click.echo(f"scalars    optimizer_step={m.scalars.get('optimizer_step')} rng={sorted(m.scalars.get('rng', {}))}")
    click.echo(f"signature  {'hmac-sha256' if m.signature else 'unsigned'}")
    click.echo(f"tiers      {', '.join(holders)}")
    click.echo(f"chain      {format_chain(parent_chain(store, m))}")
    if verify:
        with _bytes_bar(f"verify step {at} (files and shard data)") as bar:
            status, per_tier = step_checks(store, m, data=True, branch=at.branch, progress=bar)
    else:
        status, per_tier = step_checks(store, m, data=False, branch=at.branch)
    click.echo(f"status     {status}")
    for line in per_tier:
        click.echo(f"           {line}")


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
    with _progress.activity(f"read {os.path.basename(state_path)}"):
        snap = load_state_file(state_path, store.config.run, step)
    with _bytes_bar(f"write step {step} to the {tier} tier") as bar:
        m = store.write(snap, tier, progress=bar)
    held = store.history([tier]).by_digest(m.digest())
    at = held[0] if held else m.step  # "7@root-7" when a different state already held step 7: both are kept
    click.echo(f"committed step {at} to the {tier} tier: {len(m.tensors)} tensors, {_size(m.nbytes)}, digest {m.digest()}")


@main.command()
@_config_option
@click.option("--step", default="latest", help="Step to promote (default: 'latest', the newest state of the branch). " + STEP_HELP)
@_branch_option
@click.option("--to", "dst", default="object", type=click.Choice(["object", "local"]), help="Target tier.")
@_handled
def promote(config_path, step, branch, dst):
    """Copy a committed step to a slower tier (local -> object by default), verified shard by shard; it keeps its branch.

    \b
    Example:
      flowcheck promote --step 1200 --config flowcheck.yaml
      flowcheck promote --step 1200 --branch b1000-1200 --config flowcheck.yaml
    """
    ref = _step_arg(step)
    store = _store(config_path, progress=True)
    src = "local" if dst == "object" else "object"
    with _bytes_bar(f"promote step {step} {src} -> {dst}") as bar:
        m = store.promote(None if ref == "latest" else ref, src=src, dst=dst, branch=branch, progress=bar)
    held = store.history().by_digest(m.digest())
    click.echo(f"step {held[0] if held else m.step} committed in the {dst} tier ({len(m.files)} files, {_size(m.nbytes)})")


@main.command()
@_config_option
@click.option("--step", required=True, help=STEP_HELP)
@_branch_option
@click.option("--run", default=None, help="Run name (default: the config's run).")
@click.option("--format", "fmt", default="safetensors", type=click.Choice(["safetensors", "torch"]), help="Output format.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output file.")
@click.option("--from", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Tier to read.")
@click.option("--no-optim", is_flag=True, help="Model tensors only.")
@_handled
def export(config_path, step, branch, run, fmt, out, prefer, no_optim):
    """Write one step as a consolidated single-layout file (full tensors, every digest verified).

    safetensors (HF-style; the model description goes into __metadata__) or a
    torch.save'd dict of tensors.

    \b
    Example:
      flowcheck export --step latest --format safetensors --out model.safetensors --config flowcheck.yaml
      flowcheck export --step 40 --branch main --out before-rollback.safetensors --config flowcheck.yaml
    """
    from flowcheck.restore import export_file
    from flowcheck.restore.source import open_step

    store = _reading_store(config_path, run)
    tier, m = open_step(store, _step_arg(step), prefer, branch)
    at = _at(m, tier)
    with _bytes_bar(f"export step {at} from the {tier.name} tier") as bar:
        size, digest = export_file(tier, m, out, fmt=fmt, include_optimizer=not no_optim, progress=bar)
    click.echo(f"exported step {at} from the {tier.name} tier to {out} ({_size(size)}, {digest})")


@main.command()
@_config_option
@click.option("--step", required=True, help=STEP_HELP)
@_branch_option
@click.option("--run", default=None, help="Run name (default: the config's run).")
@click.option("--tp", type=int, default=1, show_default=True, help="Target tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--vpp", type=int, default=1, show_default=True, help="Virtual pipeline size (model chunks per stage).")
@click.option("--format", "fmt", default="megatron-dist", show_default=True,
              type=click.Choice(["megatron-dist", "megatron"]), help="torch_dist (DCP) or legacy mp_rank_* files.")
@click.option("--from", "prefer", default="auto", type=click.Choice(["auto", "memory", "local", "object"]),
              help="Tier to read (auto: the fastest holding the step).")
@click.option("--no-optim", is_flag=True, help="Model weights only.")
@click.option("--dtype", default=None, type=click.Choice(["bf16", "fp32"]), help="Weights dtype (default: as stored).")
@click.option("--layer-spec", default=None, type=click.Choice(["local", "te"]), help="Key names (default: as stored).")
@click.option("--arch", "arch_path", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Model description (Megatron argument names, YAML/JSON) when the step carries none.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to create.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.option("--workers", type=int, default=4, show_default=True, help="Parallel readers.")
@_handled
def restore(config_path, step, branch, run, tp, pp, vpp, fmt, prefer, no_optim, dtype, layer_spec, arch_path, out, force, workers):
    """Write a stored step as a Megatron checkpoint in any TP/PP/VPP layout (verified, resharded, atomic).

    Load it with Megatron's --load OUT (add --no-load-rng: RNG states of
    another layout are not meaningful, flowcheck does not write them).

    \b
    Example:
      flowcheck restore --step latest --tp 2 --pp 2 --out ckpt/ --config flowcheck.yaml
      flowcheck restore --step 1200 --branch main --out ckpt-main/ --config flowcheck.yaml
    """
    from flowcheck.branches import Located
    from flowcheck.restore.arch import load_arch
    from flowcheck.restore.megatron_common import Target
    from flowcheck.restore.service import restore as do_restore

    store = _reading_store(config_path, run, progress=True)
    target = Target(tp=tp, pp=pp, vpp=vpp, fmt=fmt, dtype=dtype, optim=not no_optim, layer_spec=layer_spec)
    arch = load_arch(arch_path) if arch_path else None
    rep = do_restore(store, _step_arg(step), target, out, prefer=prefer, arch=arch, force=force,
                     progress=_progress.enabled(), workers=workers, branch=branch)
    click.echo(
        f"restored step {Located(rep.step, rep.branch)} of run {rep.run} from the {rep.tier} tier into {rep.out}: "
        f"{fmt}, TP={tp} PP={pp} VPP={vpp}, {len(rep.files)} files, {_size(rep.bytes)} in {rep.seconds:.1f} s"
    )
    for f in rep.files:
        click.echo(f"  {os.path.relpath(f, rep.out)}")


@main.command()
@_config_option
@_handled
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


@main.command()
@_config_option
@click.option("--step", required=True, help=STEP_HELP)
@_branch_option
@click.option("--run", default=None, help="Run name (default: the config's run).")
@click.option("--against", "reference", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Reference safetensors file (canonical tensor names).")
@click.option("--from", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Tier to read.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handled
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

    store = _reading_store(config_path, run)
    tier, m = open_step(store, _step_arg(step), prefer, branch)
    result = report(diff_step(tier, m, reference))
    if as_json:
        click.echo(json.dumps({"step": m.step, "branch": tier.branch, "tier": tier.name, **result}, indent=2))
    else:
        for t in result["tensors"]:
            extra = f" ({t['differing']}/{t['elements']} differ, max |diff| {t['max_abs_diff']:.3g})" if t["status"] == "different" else ""
            click.echo(f"{t['status']:<15} {t['name']}{extra}{' ' + t['detail'] if t['detail'] else ''}")
        verdict = "bit-exact" if result["bit_exact"] else "NOT bit-exact"
        click.echo(f"step {_at(m, tier)} ({tier.name} tier) vs {reference}: {verdict} {result['counts']}")
    sys.exit(0 if result["bit_exact"] else 1)


@main.command(name="import")
@_config_option
@click.option("--run", default=None, help="Run name (default: the config's run).")
@click.option("--step", required=True, type=int, help="Step number to commit the checkpoint as.")
@click.option("--arch", "arch_path", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Model description when the checkpoint carries none (Megatron argument names).")
@click.option("--tier", default="local", type=click.Choice(["local", "object"]), help="Tier to commit to.")
@click.option("--trust-pickle", is_flag=True,
              help="Allow arbitrary pickled objects in the checkpoint's .pt files and DCP .metadata "
                   "(trusted sources only: unpickling can run code).")
@click.argument("source", type=click.Path(exists=True))
@_handled
def import_(config_path, run, step, arch_path, tier, trust_pickle, source):
    """Commit an existing checkpoint (Megatron directory in either format, or safetensors) as a step.

    \b
    Example:
      flowcheck import --run gpt --step 5000 /ckpts/gpt/ --config flowcheck.yaml
    """
    from flowcheck.restore.arch import load_arch
    from flowcheck.restore.importer import import_into

    store = _store(config_path, progress=True, run=run)
    arch = load_arch(arch_path) if arch_path else None
    m = import_into(store, source, step, arch=arch, tier=tier, trust_pickle=trust_pickle)
    click.echo(
        f"committed step {m.step} of run {m.run} to the {tier} tier ({m.producer.source}, "
        f"source layout TP={m.source_layout.tp} PP={m.source_layout.pp} VPP={m.source_layout.vpp}): "
        f"{len(m.tensors)} tensors, {_size(m.nbytes)}, digest {m.digest()}"
    )


@main.command()
@_config_option
@click.option("--no-data", is_flag=True, help="Check manifests, files and chain, skip re-reading shard data.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@_handled
def audit(config_path, no_data, as_json):
    """Verify every state of every branch in every tier: manifests, file digests, shard digests, hash chain
    (across branches), gaps; forks (a rollback or restore starting a branch) are reported as information.

    Exits 1 if anything is wrong.

    \b
    Example:
      flowcheck audit --config /tmp/fc-demo/flowcheck.yaml
    """
    from flowcheck.audit import audit as run_audit
    from flowcheck.audit import info_lines
    from flowcheck.lineage_view import to_json

    with _bytes_bar("audit: re-reading every file" + ("" if no_data else " and shard")) as bar:
        report = run_audit(_store(config_path), data=not no_data, progress=bar)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, **to_json(report)}, indent=2))
    else:
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


@main.command()
@_config_option
@click.option("--format", "fmt", default="text", type=click.Choice(["text", "json", "dot", "png"]), help="Output format.")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Output file (required for png; default: stdout).")
@click.option("--verify", is_flag=True, help="Also check every file's size and digest (green = verified); default: manifests and links only.")
@_handled
def lineage(config_path, fmt, out, verify):
    """Draw the run's lineage tree: one node per state (step@branch off main, source, tiers holding it),
    coloured by audit status (green verified, yellow warning, red damaged, grey unverified); a rollback or
    restore forks a branch (text: ├─ per branch; dot/png: a box per branch, bold edges out of the fork).
    png needs Graphviz's `dot` (Debian package graphviz).

    \b
    Example:
      flowcheck lineage --format png --out lineage.png --verify --config flowcheck.yaml
      flowcheck lineage --format dot --config flowcheck.yaml | dot -Tsvg > lineage.svg
    """
    from flowcheck.audit import lineage as run_lineage
    from flowcheck.lineage_view import dumps, render_png, to_dot

    if fmt == "png" and out is None:
        raise click.UsageError("--format png writes an image file: expected --out FILE.png, found none")
    if verify:
        with _bytes_bar("lineage: verifying files") as bar:
            report = run_lineage(_store(config_path), verify=True, progress=bar)
    else:
        with _progress.activity("lineage"):
            report = run_lineage(_store(config_path))
    if fmt == "png":
        render_png(to_dot(report), out)
        forks = len(report.forks)
        click.echo(f"wrote {out} ({len(report.nodes)} states, {forks} fork{'' if forks == 1 else 's'})")
    elif out is not None:
        with open(out, "w") as f:
            f.write(dumps(report, fmt) + "\n")
    else:
        click.echo(dumps(report, fmt))


@main.command()
@_config_option
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@_handled
def gc(config_path, dry_run):
    """Apply retention (keep-last-N, hourly, daily along the current branch; abandoned branches after
    keep_abandoned_hours) per tier; clean abandoned partial writes.  States print as step@branch off main.

    Never deletes the head of the current branch, nor a step it cannot classify.

    \b
    Example:
      flowcheck gc --dry-run --config flowcheck.yaml
    """
    with _progress.bar(desc="gc" + (" (dry run)" if dry_run else ""), unit="step") as bar:
        report = _store(config_path).gc(dry_run=dry_run, progress=bar)
    verb = "would delete" if dry_run else "deleted"
    for tier, deleted in report.deleted.items():
        gone = _states(deleted) if deleted else "none"
        click.echo(f"{tier}: {verb} steps {gone}; keeps {_states(report.kept.get(tier, {}))}")
        for at in deleted:
            click.echo(f"{tier}:   {at}: {report.why.get(tier, {}).get(at, 'no reason recorded')}")
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
                            object_seconds=object_seconds, echo=_echo_over(bar))
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
    click.echo(f"\n$ flowcheck export --step {last} --out {out}\nexported {_size(size)} from the {tier.name} tier; "
               f"safetensors.torch.load_file == live trainer state bit for bit: {exact}")
    from flowcheck.demo_mirror import run_mirror_demo

    with _progress.activity("demo: mirror half") as bar:
        mirror = run_mirror_demo(workdir, echo=_echo_over(bar))
    click.echo(f"\nnext: flowcheck lineage --config {cfg_path}")
    ok = report.ok and exact and res["identical"] and mirror["exact"]
    sys.exit(0 if ok else 1)



def _states(located) -> str:
    """``[1, 2, 2@b1-2, 3]``: by step, main's state first."""
    return "[" + ", ".join(str(k) for k in sorted(located, key=lambda k: (k.step, k.branch != "main", k.branch))) + "]"


def _echo_over(bar):
    """click.echo that clears the progress line first (tqdm redraws it below the text)."""
    def echo(message: str = "", **kw) -> None:
        if bar.disable:
            click.echo(message, **kw)
        else:
            with bar.external_write_mode():
                click.echo(message, **kw)

    return echo


def _register_commands() -> None:
    from flowcheck.bench_cli import bench_command
    from flowcheck.capture.commands import capture_command, decode_command
    from flowcheck.plan_cli import plan_command
    from flowcheck.simulate.cli import simulate_command

    for cmd in (simulate_command, decode_command, capture_command, plan_command, bench_command):
        main.add_command(_handled_command(cmd))


def _handled_command(cmd: click.Command) -> click.Command:
    cmd.callback = _handled(cmd.callback)
    return cmd


_register_commands()

if __name__ == "__main__":
    main()
