"""`flowcheck decode` and `flowcheck capture`: mirror-capture files in, allreduces / committed steps out."""
from __future__ import annotations

import json
import sys

import click

from flowcheck.cli.common import config_option


def _load_job(path: str):
    from flowcheck.capture.mirror.job import load_job

    return load_job(path)


@click.command("decode")
@click.option("--job", "job_path", required=True, type=click.Path(dir_okay=False), help="Job description YAML.")
@click.option("--pcap", "pcaps", required=True, multiple=True, type=click.Path(dir_okay=False),
              help="pcap/pcapng file(s); repeat --pcap or list several after it.")
@click.argument("more", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object (the documented report).")
@click.option("--dump", "dump_dir", default=None, type=click.Path(file_okay=False),
              help="Write allreduce-<k>.npy (and .missing.npy masks) here.")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Threads for the native work: parse + ICRC, reassembly (whole streams) and the merge of final "
                   "sends (disjoint ranges); the report does not depend on it.")
def decode_command(job_path, pcaps, more, as_json, dump_dir, workers):
    """Print, per allreduce, what was recovered, from which stream, and what is missing.

    Exit status 0 when every allreduce is complete, 3 when some are not, 2 on bad input.

    \b
    Example:
      flowcheck decode --job sim/job.yaml --pcap sim/mirror-r0-out.pcap sim/mirror-r1-out.pcap --json
    """
    from flowcheck import progress
    from flowcheck.capture.mirror.decode import Decoded, decode, dump, read_all, report

    job = _load_job(job_path)
    info = Decoded()
    with progress.activity("read captures"):
        frames = read_all(list(pcaps) + list(more))
    allreduces = list(progress.bar(decode(job, frames, info, workers=workers), desc="decode", unit="allreduce"))
    out = report(allreduces, info)
    if dump_dir:
        dump(allreduces, dump_dir)
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        _print_decode(out)
    sys.exit(0 if allreduces and all(a.complete for a in allreduces) else 3)


def _print_decode(out: dict) -> None:
    click.echo(f"{len(out['allreduces'])} allreduces, {out['channels']} channel(s), packets {out['packets']}")
    for a in out["allreduces"]:
        state = "complete" if a["complete"] else f"INCOMPLETE, missing {a['missing'][:4]}{' ...' if len(a['missing']) > 4 else ''}"
        streams = sorted({s["stream"] for s in a["sources"] if s.get("elements_seen")})
        click.echo(f"  #{a['index']} iteration {a['iteration']} bucket {a['bucket']}: {a['elements']} x {a['dtype']} "
                   f"{state}; copies {a['copies']['min']}..{a['copies']['max']} from {', '.join(streams) or 'nothing'}"
                   + (f"; sha256 {a['sha256'][:16]}" if a.get("sha256") else ""))
    for an in out["anomalies"][:20]:
        click.echo(f"  anomaly: {an}")
    if len(out["anomalies"]) > 20:
        click.echo(f"  ... {len(out['anomalies']) - 20} more anomalies (--json for all)")


def _live(job, info, interface: str, duration_s: float | None, max_frames: int | None, settle_s: float,
          drops: list[int], ring, decode_workers: int = 1):
    """Allreduces decoded from a live interface until the duration, the frame count or SIGINT/SIGTERM;
    ``drops[0]`` counts the frames the kernel dropped because the capture fell behind."""
    import signal
    import threading
    import time

    from flowcheck.capture.mirror.live import live_frames
    from flowcheck.capture.mirror.streaming import StreamingDecoder

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    batches = live_frames(interface, duration_s=duration_s, max_frames=max_frames, stop=stop, idle=True,
                          on_open=lambda: click.echo(f"capturing live on {interface}", err=True),
                          on_drops=lambda n: drops.__setitem__(0, drops[0] + n), ring=ring)
    return StreamingDecoder(job, info, settle_s=settle_s, clock=time.time_ns, workers=decode_workers).run(batches)


@click.command("capture")
@config_option
@click.option("--job", "job_path", required=True, type=click.Path(dir_okay=False), help="Job description YAML.")
@click.option("--pcap", "pcaps", multiple=True, type=click.Path(dir_okay=False), help="pcap/pcapng file(s).")
@click.argument("more", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--interface", default=None,
              help="Capture live from this interface (the mirror port's NIC; needs CAP_NET_RAW) instead of files.")
@click.option("--duration", "duration_s", type=click.FloatRange(min=0), default=None, help="Live: stop after this many seconds.")
@click.option("--frames", "max_frames", type=click.IntRange(min=1), default=None, help="Live: stop after this many frames.")
@click.option("--settle", "settle_s", type=click.FloatRange(min=0), default=0.1, show_default=True,
              help="Live: an allreduce is decoded once this many seconds of capture time passed since its last send.")
@click.option("--init", default=None, help="Initial state: a stored step number or a .safetensors file (default: the job's init).")
@click.option("--resync", "resync_dir", default=None, type=click.Path(file_okay=False),
              help="Directory of full states step-<N>.safetensors used after an unrecoverable iteration (default: the job's resync).")
@click.option("--capture-workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Live: PACKET_FANOUT sockets (rings), one reader thread each; flows are hashed over them.")
@click.option("--ring-block-kb", type=click.IntRange(4, 1 << 20), default=4096, show_default=True,
              help="Live: PACKET_MMAP block size in KiB (a multiple of the page size).")
@click.option("--ring-blocks", type=click.IntRange(2, 1 << 16), default=64, show_default=True,
              help="Live: PACKET_MMAP blocks per socket.")
@click.option("--decode-workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Threads for the decoder's native work (parse + ICRC, reassembly, merge); the result does not depend on it.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def capture_command(config_path, job_path, pcaps, more, interface, duration_s, max_frames, settle_s, init, resync_dir,
                    capture_workers, ring_block_kb, ring_blocks, decode_workers, as_json):
    """Replay mirrored captures (or capture live) into a RAM replica and commit steps per the policy.

    An iteration that cannot be completed marks the state stale (never snapshotted) and
    resyncs from --resync when it has the step.  Live capture (--interface) decodes as frames
    arrive and runs until --duration, --frames, or SIGINT/SIGTERM.

    \b
    Example:
      flowcheck capture --config flowcheck.yaml --job sim/job.yaml --pcap sim/*.pcap
      flowcheck capture --config flowcheck.yaml --job job.yaml --interface ens1f1 --duration 3600
    """
    from flowcheck import config as config_mod
    from flowcheck import progress
    from flowcheck.capture.mirror.decode import Decoded, decode, read_all
    from flowcheck.capture.mirror.pipeline import MirrorSession
    from flowcheck.policy import PolicyRunner
    from flowcheck.store import open_store

    files = list(pcaps) + list(more)
    if bool(files) == bool(interface):
        raise click.UsageError("expected captures (--pcap FILE ...) or a live --interface, not both and not neither")
    if not interface and (duration_s is not None or max_frames is not None):
        raise click.UsageError("--duration and --frames apply to a live --interface capture")
    from flowcheck.capture.mirror.packet_ring import RingConfig

    try:
        ring = RingConfig(block_size=ring_block_kb << 10, block_count=ring_blocks, workers=capture_workers)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--ring-block-kb") from e
    job = _load_job(job_path)
    store = open_store(config_mod.load(config_path))
    runner = PolicyRunner(store).start()
    info = Decoded()
    try:
        session = MirrorSession(job, store, on_step=runner.on_step, on_stale=lambda it, why: store.memory.mark_stale(why),
                                init=init, resync_dir=resync_dir)
        drops = [0]
        if interface:
            allreduces = _live(job, info, interface, duration_s, max_frames, settle_s, drops, ring, decode_workers)
        else:
            with progress.activity("read captures"):
                frames = read_all(files)
            allreduces = decode(job, frames, info, workers=decode_workers)
        result = session.run(progress.bar(allreduces, desc="capture", unit="allreduce"))
        with progress.activity("flush: snapshot and upload the last step"):
            runner.flush()
    finally:
        runner.stop()
    hist = store.history(["local"])
    branch = hist.current()
    committed = sorted(n for n, b in hist.path(branch).items())
    out = {"branch": branch, "iterations_applied": result.iterations, "allreduces": result.allreduces, "stale": [s.to_json() for s in result.stale],
           "resyncs": result.resyncs, "final_step": result.steps[-1] if result.steps else session.replica.step,
           "stale_at_end": store.memory.stale, "local_steps": committed, "anomalies": len(info.anomalies),
           "policy_errors": runner.stats.errors}
    if interface:
        out["kernel_drops"] = drops[0]
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        click.echo(f"applied {result.iterations} iterations from {result.allreduces} allreduces; "
                   f"{len(result.stale)} stale, resynced at {result.resyncs}; RAM at step {out['final_step']}"
                   f"{' (STALE: not snapshotted)' if store.memory.stale else ''}; local steps {committed}"
                   f"{'' if branch == 'main' else f' on branch {branch}'}")
        for s in result.stale:
            click.echo(f"  stale: iteration {s.iteration}: {s.reason}")
        if out.get("kernel_drops"):
            click.echo(f"  the kernel dropped {out['kernel_drops']} frames: the capture fell behind the link")
    sys.exit(0 if not runner.stats.errors else 1)
