"""``flowcheck simulate``: the click command (registered by flowcheck/cli/__init__.py)."""
from __future__ import annotations

import click

from flowcheck.errors import FlowcheckError


def _clip(value: str) -> float | None:
    if value.strip().lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(f"expected a max norm (e.g. 1.0) or 'none', found {value!r}", param_hint="--clip")


@click.command("simulate")
@click.option("--dp", type=int, required=True, help="Data-parallel ranks in the ring (2..8).")
@click.option("--iters", type=int, required=True, help="Training iterations.")
@click.option("--model", default="tiny", show_default=True, help="tiny (~30k parameters) or small (~0.86M).")
@click.option("--proto", default="ll", show_default=True, help="NCCL protocol of the ring: ll or simple.")
@click.option("--channels", type=int, default=1, show_default=True, help="NCCL channels (ring connections per link).")
@click.option("--mirror", default=None,
              help="Mirror ports RANK:in|out|both[,...] (out: frames the rank sends; in: frames it receives). "
                   "Default 0:out,1:out,2:out capped at --dp.")
@click.option("--loss", type=float, default=0.0, show_default=True, help="Per-frame drop probability at each mirror port.")
@click.option("--reorder", type=float, default=0.0, show_default=True, help="Per-frame probability of a swap with a later frame.")
@click.option("--dup", type=float, default=0.0, show_default=True, help="Per-frame duplication probability.")
@click.option("--optimizer", default="adam", show_default=True, help="sgd, adam or adamw.")
@click.option("--clip", default="1.0", show_default=True, help="Global-norm gradient clipping max norm, or 'none'.")
@click.option("--mtu", type=int, default=1024, show_default=True, help="RoCE path MTU (256..4096).")
@click.option("--ipv4", is_flag=True, help="IPv4 addresses (default: IPv6 link-local).")
@click.option("--vlan", type=int, default=None, help="802.1Q VLAN id on every frame.")
@click.option("--bucket-kb", type=int, default=None, help="DDP bucket capacity in KiB (default: tiny 32, small 512).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tail", type=click.Choice(["resend", "next"]), default=None,
              help="One more step on every ring connection after the last allreduce: resend (each rank re-sends the "
                   "final chunk it received last) or next (the first step of an allreduce that never finishes).")
@click.option("--tail-frames", type=int, default=None,
              help="Each mirror port keeps only the first K frames of the --tail step (the capture ends there).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
def simulate_command(dp, iters, model, proto, channels, mirror, loss, reorder, dup, optimizer, clip, mtu, ipv4,
                     vlan, bucket_kb, seed, tail, tail_frames, out):
    """Train a small GPT on CPU with N virtual DP ranks and write the mirrored RoCEv2 traffic of its
    ring allreduces (pcap per mirror port), the job description and the ground truth.

    \b
    Example:
      flowcheck simulate --dp 4 --iters 20 --mirror 0:out,1:out,2:out --loss 0.02 --out /tmp/sim
      flowcheck decode --job /tmp/sim/job.yaml --pcap /tmp/sim/mirror-r0-out.pcap /tmp/sim/mirror-r1-out.pcap /tmp/sim/mirror-r2-out.pcap
    """
    from flowcheck.simulate import SimOptions, simulate

    try:
        options = SimOptions(out=out, dp=dp, iters=iters, model=model.lower(), proto=proto.lower(),
                             channels=channels, mirror=mirror, loss=loss, reorder=reorder, dup=dup,
                             optimizer=optimizer.lower(), clip=_clip(clip), mtu=mtu, ipv4=ipv4, vlan=vlan,
                             bucket_kb=bucket_kb, seed=seed, tail=tail, tail_frames=tail_frames)
    except FlowcheckError as e:
        raise click.UsageError(str(e)) from e
    try:
        from flowcheck import progress

        with progress.activity(f"simulate {options.iters} iterations, {options.dp} ranks"):
            result = simulate(options)
    except FlowcheckError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"{result.out}: {len(result.allreduces)} allreduces over {iters} iterations, "
               f"{len(result.job.parameters)} parameters, {result.seconds:.1f} s")
    for name, rec in result.injected["pcaps"].items():
        click.echo(f"  {name}: {rec['written']} frames ({rec['dropped']} dropped, {rec['duplicated']} duplicated, "
                   f"{rec['reordered']} reordered)")
