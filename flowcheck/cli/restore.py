"""Commands that move a step out of or into the store: export, restore, import."""
from __future__ import annotations

import os

import click

from flowcheck import progress as _progress
from flowcheck.cli.common import (
    STEP_HELP,
    at_text,
    branch_option,
    bytes_bar,
    committed,
    config_option,
    handled,
    human,
    outside_tiers,
    reading_store,
    step_arg,
    store_for,
)


@click.command()
@config_option
@click.option("--step", required=True, help=STEP_HELP)
@branch_option
@click.option("--run", default=None, help="Run name (default: the config's run).")
@click.option("--format", "fmt", default=None, type=click.Choice(["safetensors", "torch"]),
              help="Output format (default: from --out's extension: .safetensors, or .pt/.pth/.bin for torch; "
                   "safetensors for any other).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output file.")
@click.option("--from", "prefer", default="auto", type=click.Choice(["auto", "local", "object"]), help="Tier to read.")
@click.option("--no-optim", is_flag=True, help="Model tensors only.")
@handled
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

    fmt = _export_format(out, fmt)
    store = reading_store(config_path, run)
    outside_tiers(store, out, "--out")
    tier, m = open_step(store, step_arg(step), prefer, branch)
    at = at_text(m, tier)
    with bytes_bar(f"export step {at} from the {tier.name} tier") as bar:
        size, digest = export_file(tier, m, out, fmt=fmt, include_optimizer=not no_optim, progress=bar)
    click.echo(f"exported step {at} from the {tier.name} tier to {out} ({human(size)}, {digest})")


_BY_EXTENSION = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def _export_format(out: str, fmt: str | None) -> str:
    """--format, else the one --out's extension names; a file named for one format never holds the other
    (`torch.load` cannot read safetensors, nor the reverse)."""
    ext = os.path.splitext(out)[1].lower()
    implied = _BY_EXTENSION.get(ext)
    if fmt is None:
        return implied or "safetensors"
    if implied is not None and implied != fmt:
        raise click.BadParameter(f"--out {out} names a {implied} file ({ext}) but --format is {fmt}: "
                                 f"expected matching ones; change the extension or --format", param_hint="--format")
    return fmt


@click.command()
@config_option
@click.option("--step", required=True, help=STEP_HELP)
@branch_option
@click.option("--run", default=None,
              help="The run to read (default: the config's run; when that run has no step and the store holds exactly "
                   "one run, that one). `flowcheck ls --run R` lists a run's steps.")
@click.option("--tp", type=int, default=1, show_default=True, help="Target tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--vpp", type=int, default=1, show_default=True, help="Virtual pipeline size (model chunks per stage).")
@click.option("--format", "fmt", default="megatron-dist", show_default=True,
              type=click.Choice(["megatron-dist", "megatron"]), help="torch_dist (DCP) or legacy mp_rank_* files.")
@click.option("--from", "prefer", default="auto", type=click.Choice(["auto", "memory", "local", "object"]),
              help="The tier to read. auto (default): the fastest tier holding the step, every shard verified, and a "
                   "damaged shard read from another tier holding the same state (with a warning naming it); "
                   "local/object: that tier only (a damaged shard fails the restore); memory: a node's RAM, "
                   "only inside the node process.")
@click.option("--no-optim", is_flag=True,
              help="Write model weights only, no optimizer state or LR schedule (load with --no-load-optim). "
                   "Without it, a step's Adam moments, fp32 masters, param groups and scheduler state are written "
                   "when it holds them; a step without them is written model-only with a warning naming the flags.")
@click.option("--use-distributed-optimizer", "dist_optim", is_flag=True,
              help="The trainer runs Megatron's distributed optimizer: optimizer state then needs --format "
                   "megatron-dist (it loads at any data-parallel size); --format megatron refuses it.")
@click.option("--adam", default="auto", show_default=True, type=click.Choice(["auto", "fused", "torch"]),
              help="The trainer's Adam: fused = Transformer Engine / Apex FusedAdam (megatron-core's choice when "
                   "either is installed), torch = torch.optim.AdamW; auto: as the stored step's optimizer was, else fused.")
@click.option("--dtype", default=None, type=click.Choice(["bf16", "fp32"]), help="Weights dtype (default: as stored).")
@click.option("--layer-spec", default=None, type=click.Choice(["local", "te"]), help="Key names (default: as stored).")
@click.option("--arch", "arch_path", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Model description (Megatron argument names, YAML/JSON) when the step carries none.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to create.")
@click.option("--force", is_flag=True,
              help="Replace --out if it exists and holds a Megatron checkpoint or a previous restore (any other "
                   "directory is refused).")
@click.option("--workers", type=int, default=4, show_default=True, help="Parallel readers.")
@handled
def restore(config_path, step, branch, run, tp, pp, vpp, fmt, prefer, no_optim, dist_optim, adam, dtype, layer_spec,
            arch_path, out, force, workers):
    """Write a stored step as a Megatron checkpoint in any TP/PP/VPP layout (verified, resharded, atomic).

    Load it with Megatron's --load OUT plus the flags this command prints:
    --no-load-rng with --format megatron (flowcheck writes no RNG state: another
    layout's means nothing), --no-load-optim when the step holds no optimizer
    state or --no-optim was given, --override-opt_param-scheduler when the step
    stores no learning-rate schedule and no job arguments to rebuild it.
    Optimizer state carries complete param groups, the scheduler state and the
    consumed samples, so the LR schedule and the data continue where they were.

    \b
    Example:
      flowcheck restore --step latest --tp 2 --pp 2 --out ckpt/ --config flowcheck.yaml
      flowcheck restore --step latest --tp 4 --use-distributed-optimizer --out ckpt/ --config flowcheck.yaml
      flowcheck restore --step 1200 --branch main --out ckpt-main/ --config flowcheck.yaml
    """
    from flowcheck.branches import Located
    from flowcheck.restore.arch import load_arch
    from flowcheck.restore.megatron_common import Target
    from flowcheck.restore.service import restore as do_restore

    store = reading_store(config_path, run, progress=True)
    target = Target(tp=tp, pp=pp, vpp=vpp, fmt=fmt, dtype=dtype, optim=not no_optim, layer_spec=layer_spec,
                    dist_optim=dist_optim, adam=None if adam == "auto" else adam)
    arch = load_arch(arch_path) if arch_path else None
    rep = do_restore(store, step_arg(step), target, out, prefer=prefer, arch=arch, force=force,
                     progress=_progress.enabled(), workers=workers, branch=branch)
    click.echo(
        f"restored step {Located(rep.step, rep.branch)} of run {rep.run} from the {rep.tier} tier into {rep.out}: "
        f"{fmt}, TP={tp} PP={pp} VPP={vpp}, {len(rep.files)} files, {human(rep.bytes)} in {rep.seconds:.1f} s"
    )
    for f in rep.files:
        click.echo(f"  {os.path.relpath(f, rep.out)}")
    res = rep.resume
    if res is not None:
        what = ("optimizer state (Adam moments, param groups, LR schedule)" if res.optimizer
                else "model weights only (no optimizer state)")
        click.echo(f"resumes: {what}; iteration {rep.step}, consumed_train_samples={res.consumed_train_samples}")
        for part, source in res.sources.items():
            click.echo(f"  {part}: {source}")
        click.echo(f"load with Megatron: --load {rep.out}" + "".join(f" {f}" for f in res.flags))
    if rep.vocab is not None:
        click.echo(f"vocabulary: {rep.vocab.note()}")


@click.command(name="import")
@config_option
@click.option("--run", default=None, help="Run name (default: the config's run).")
@click.option("--step", required=True, type=int, help="Step number to commit the checkpoint as.")
@click.option("--arch", "arch_path", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Model description when the checkpoint carries none (Megatron argument names).")
@click.option("--tier", default="local", type=click.Choice(["local", "object"]), help="Tier to commit to.")
@click.option("--trust-pickle", is_flag=True,
              help="Allow arbitrary pickled objects in the checkpoint's .pt files and DCP .metadata, and store a DCP "
                   "directory's non-tensor items as raw bytes (trusted sources only: unpickling can run code).")
@click.argument("source", type=click.Path(exists=True))
@handled
def import_(config_path, run, step, arch_path, tier, trust_pickle, source):
    """Commit an existing checkpoint (Megatron directory in either format, a PyTorch DCP directory, or safetensors)
    as a step.

    \b
    Example:
      flowcheck import --run gpt --step 5000 /ckpts/gpt/ --config flowcheck.yaml
    """
    from flowcheck.restore.arch import load_arch
    from flowcheck.restore.importer import import_into

    store = store_for(config_path, progress=True, run=run)
    arch = load_arch(arch_path) if arch_path else None
    m, said = committed(store, tier, lambda: import_into(store, source, step, arch=arch, tier=tier, trust_pickle=trust_pickle))
    click.echo(
        f"{said} ({m.producer.source}, "
        f"source layout TP={m.source_layout.tp} PP={m.source_layout.pp} VPP={m.source_layout.vpp}): "
        f"{len(m.tensors)} tensors, {human(m.nbytes)}, digest {m.digest()}"
    )

