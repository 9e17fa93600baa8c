"""`flowcheck plan`: the checkpoint-interval planner's command line (the model is :mod:`flowcheck.plan`).

``--json`` prints one object:

* ``nodes``, ``gpus``, ``failures_per_day`` (λ = N·r_f, whole job), ``mtbf_hours`` (1/λ),
  ``restart_min`` (u0), ``capture`` (none|push|mirror);
* ``formula``: ``first_order`` and ``exact``, the two ETTR formulas, as text;
* ``intervals``: per ``--interval-min``: ``interval_min``, ``ettr_first_order`` (HPCA'25 estimate,
  saves not charged), ``ettr_exact`` (Daly's Poisson model, same terms), ``formula`` (the first-order
  formula with the numbers substituted), ``tiers`` ({tier: exact ETTR charging that tier's save and restore});
* ``tiers``: per tier: ``tier``, ``save_s``, ``restore_s``, ``blocking`` (the save stalls training),
  ``interval_min`` (recommended: Young/Daly sqrt(2·save·M)), ``daly_interval_min`` (Daly's higher-order
  optimum), ``lost_work_min`` and ``recovery_min`` (per failure), ``ettr_first_order``, ``ettr_exact``;
* ``per_iteration``: null without ``--iteration-s``, else ``iteration_s``, ``lost_work_s``,
  ``recovery_min``, ``ettr_first_order``, ``ettr_exact`` for a recovery point every iteration;
* ``cost``: null without ``--gpu-node-usd-h``, else ``gpu_nodes``, ``baseline`` (what capture is
  compared with), ``baseline_ettr``, ``capture_ettr``, ``baseline_usd_day`` and ``capture_usd_day``
  (lost to failures), ``ckpt_nodes_usd_day``, ``net_saving_usd_day``;
* ``mirror_node``: null without ``--params``, else the mirror-capture node's load per iteration
  (:mod:`flowcheck.capture.mirror.capacity`): ``wire_gb_per_stream``, ``wire_gb``, ``decode_core_s``,
  ``update_core_s``, ``core_s``, ``cores`` (to keep up with the iteration time), ``rates`` used, and
  ``scale_out``: null without ``--cores-per-node``, else ``cores_per_node``, ``nodes`` (the fewest checkpoint
  nodes sharing the capture, each its part of the parameters, that keep up; null: none does),
  ``cores_needed_per_node``, ``core_s_per_node``, ``shared_core_s`` (the decode work every node repeats).

``--from-benchmarks FILE`` reads a markdown table whose header has the columns ``tier`` and
``save s/GB`` (and optionally ``restore s/GB``), e.g.::

    | tier | save s/GB | restore s/GB |
    |---|---:|---:|
    | local | 4.3 | 0.5 |

and multiplies by ``--state-gb``.  Today's BENCHMARKS.md has no such table (its tables compare
methods on one small VM, not per-tier costs of a real job), so pass ``--save-s TIER=SECONDS``.
"""
from __future__ import annotations

import json
import math
import re

import click

from flowcheck.capture.mirror.capacity import (
    DEFAULT_DECODE_GB_PER_CORE_S,
    DEFAULT_UPDATE_NS_PER_PARAM,
    DEFAULT_SHARED_DECODE_FRACTION,
    MirrorLoad,
    capacity,
    render_scale_out,
    scale_out,
)
from flowcheck.capture.mirror.capacity import render as render_capacity
from flowcheck.errors import ConfigError, FlowcheckError
from flowcheck.plan import (
    CAPTURES,
    EXACT_FORMULA,
    FIRST_ORDER_FORMULA,
    CostInputs,
    Plan,
    PlanInputs,
    TierCost,
    plan,
)

_GREEDY = ("--interval-min", "--save-s", "--restore-s")  # take several values: --interval-min 60 5
_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _spread(args: list[str]) -> list[str]:
    """Rewrite ``--interval-min 60 5`` as ``--interval-min 60 --interval-min 5`` (click options take one value)."""
    out: list[str] = []
    greedy, have_value = None, False
    for i, tok in enumerate(args):
        if tok == "--":
            return out + args[i:]
        if tok.startswith("-") and len(tok) > 1 and not _NUMBER.match(tok):
            name, eq, _ = tok.partition("=")
            greedy, have_value = (name if name in _GREEDY else None), bool(eq)
        elif greedy is not None:
            if have_value:
                out.append(greedy)
            have_value = True
        out.append(tok)
    return out


class _PlanCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _spread(list(args)))


class _TierSeconds(click.ParamType):
    """``TIER=SECONDS`` → (tier, seconds)."""

    name = "TIER=SECONDS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        tier, eq, seconds = str(value).partition("=")
        try:
            s = float(seconds)
        except ValueError:
            s = math.nan
        if not eq or not re.fullmatch(r"[A-Za-z0-9_-]+", tier) or not math.isfinite(s) or s < 0:
            self.fail(f"expected TIER=SECONDS with a tier name and seconds ≥ 0 (e.g. local=60), found {value!r}",
                      param, ctx)
        return tier, s


def _pairs(pairs: tuple[tuple[str, float], ...], option: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for tier, s in pairs:
        if tier in out:
            raise click.BadParameter(f"tier {tier!r} given twice", param_hint=option)
        out[tier] = s
    return out


def _cell(text: str) -> str:
    return text.strip().strip("*`").strip().lower()


def tiers_from_benchmarks(text: str, source: str, state_gb: float) -> dict[str, tuple[float, float]]:
    """{tier: (save_s, restore_s)} from the one markdown table headed ``| tier | save s/GB | ...``."""
    lines = text.splitlines()
    found: dict[str, tuple[float, float]] = {}
    tables = 0
    for i, line in enumerate(lines):
        cols = [_cell(c) for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if "tier" not in cols or "save s/gb" not in cols:
            continue
        tables += 1
        ti, si = cols.index("tier"), cols.index("save s/gb")
        ri = cols.index("restore s/gb") if "restore s/gb" in cols else None
        for row in lines[i + 2:]:
            if not row.lstrip().startswith("|"):
                break
            cells = [c.strip().strip("*`").strip() for c in row.strip().strip("|").split("|")]
            try:
                save = float(cells[si])
                restore = float(cells[ri]) if ri is not None else 0.0
            except (IndexError, ValueError) as e:
                raise ConfigError(f"{source}: planner table row {row.strip()!r}: expected numbers in 'save s/GB'"
                                  f"{' and restore s/GB' if ri is not None else ''}") from e
            if save <= 0 or restore < 0:
                raise ConfigError(f"{source}: planner table row {row.strip()!r}: expected save s/GB > 0 and "
                                  "restore s/GB ≥ 0")
            found[cells[ti]] = (save * state_gb, restore * state_gb)
    if tables != 1 or not found:
        what = "no table" if tables == 0 else f"{tables} tables" if tables > 1 else "an empty table"
        raise ConfigError(f"{source}: expected one markdown table with columns 'tier' and 'save s/GB' (optionally "
                          f"'restore s/GB'), found {what}; its other tables are not per-tier save costs. "
                          "Pass the measured costs instead: --save-s TIER=SECONDS [--restore-s TIER=SECONDS]")
    return found


def _tiers(save: dict[str, float], restore: dict[str, float], bench: dict[str, tuple[float, float]]
           ) -> tuple[tuple[TierCost, ...], float]:
    """TierCosts (explicit --save-s/--restore-s over the benchmarks table) and the RAM copy's restore time."""
    costs = {name: [s, r] for name, (s, r) in bench.items()}
    for name, s in save.items():
        costs.setdefault(name, [s, 0.0])[0] = s
    capture_restore = restore.get("memory", 0.0)
    if "memory" not in costs:
        restore.pop("memory", None)
    for name, r in restore.items():
        if name not in costs:
            raise click.BadParameter(f"no tier {name!r}: give its save time with --save-s {name}=SECONDS "
                                     "(or name the RAM copy 'memory')", param_hint="--restore-s")
        costs[name][1] = r
    for name, (s, _) in costs.items():
        if s <= 0:
            raise click.BadParameter(f"tier {name!r}: expected a save time > 0 s, found {s:g}", param_hint="--save-s")
    return tuple(TierCost(n, s, r) for n, (s, r) in costs.items()), capture_restore


def _render(p: Plan) -> list[str]:
    i = p.inputs
    rate = (f"{i.nodes} × {i.failures_per_node_day:g}/node-day" if i.failures_per_node_day is not None
            else f"job MTBF {i.mtbf_hours:g} h")
    m_min = i.mtbf_s / 60.0
    out = [(f"flowcheck plan: {i.gpus} GPUs = {i.nodes} nodes × {i.gpus_per_node}; {rate} = "
           f"{i.failures_per_day:.3g} failures/day (M = job MTBF {m_min:.1f} min)"),
           f"restart u0 = {i.restart_s / 60:g} min; capture: {i.capture}"
           + (" (the trainer's own saves stall it)" if i.blocking_saves else " (saves come from the checkpoint node)")]
    if p.intervals:
        out += ["", "ETTR at the intervals asked (saves not charged, as in HPCA'25):",
                f"  {'interval':>9}  {'first-order':>11}  {'exact':>6}  formula"]
        for r in p.intervals:
            out.append(f"  {r.interval_s / 60:>5.4g} min  {r.ettr_first_order:>11.3f}  {r.ettr_exact:>6.3f}  "
                       f"E[ETTR] ≈ {r.formula}")
            if r.tiers:
                out.append("  " + " " * 11 + "charging each tier's save and restore (exact): "
                           + ", ".join(f"{n} {e:.3f}" for n, e in r.tiers))
    if p.tiers:
        out += ["", (f"Per tier: recommended interval τ* = sqrt(2·δ·M) (Young/Daly), δ = the tier's save time, "
                    f"M = {m_min:.1f} min:"),
                (f"  {'tier':10} {'save s':>8} {'restore s':>9} {'stalls':>6} {'τ*':>10} {'Daly τ':>10} "
                f"{'lost/fail':>10} {'first-order':>11} {'exact':>6}")]
        for t in p.tiers:
            out.append(f"  {t.name:10} {t.save_s:>8.4g} {t.restore_s:>9.4g} {'yes' if t.blocking else 'no':>6} "
                       f"{t.interval_s / 60:>6.1f} min {t.daly_interval_s / 60:>6.1f} min "
                       f"{t.lost_work_s / 60:>6.1f} min {t.ettr_first_order:>11.3f} {t.ettr_exact:>6.3f}")
    out += ["", "Per-iteration capture (push/mirror: a recovery point every iteration, no stall):"]
    c = p.capture
    if c is None:
        out.append("  (give --iteration-s to see it)")
    else:
        out.append(f"  iteration {c.iteration_s:g} s: lost {c.lost_work_s:g} s + recovery {c.recovery_s / 60:g} min "
                   f"per failure → ETTR {c.ettr_first_order:.3f} first-order, {c.ettr_exact:.3f} exact")
    if p.cost is not None:
        k = p.cost
        out += ["", f"Cost view ({k.gpu_nodes} GPU servers), $/day:",
                f"  lost to failures, {k.baseline} (ETTR {k.baseline_ettr:.3f}): {k.baseline_usd_day:,.0f}",
                f"  lost to failures, per-iteration capture (ETTR {k.capture_ettr:.3f}): {k.capture_usd_day:,.0f}",
                f"  checkpoint nodes: {k.ckpt_nodes_usd_day:,.0f}",
                f"  net saving: {k.net_saving_usd_day:,.0f}"]
    out += ["", "Formulas:",
            f"  first order (Kokolis et al., HPCA'25): {FIRST_ORDER_FORMULA}   (− δ/Δt when saves stall: Young 1974)",
            f"  exact (Daly 2006, Poisson failures):   {EXACT_FORMULA}",
            "      M = 1/(N·r_f) the job's MTBF; R = u0 + restore (+ the save time when saves do not stall:",
            "      a step is a recovery point only once saved); δ = the stall per save"]
    return out


@click.command("plan", cls=_PlanCommand)
@click.option("--config", "config_path", envvar="FLOWCHECK_CONFIG", type=click.Path(dir_okay=False),
              help="Accepted for uniformity with every flowcheck command and ignored: the planner reads no store.")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs in the job.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--failures-per-node-day", "rate", type=click.FloatRange(min=0, min_open=True),
              help="r_f per node and day (HPCA'25 RSC-1: 0.0065).")
@click.option("--mtbf-hours", type=click.FloatRange(min=0, min_open=True), help="The whole job's MTBF instead of r_f.")
@click.option("--restart-min", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="u0: restart overhead per failure (5 fits HPCA'25's RSC-1 figures; their own u0 is unconfirmed).")
@click.option("--iteration-s", type=click.FloatRange(min=0, min_open=True), help="Seconds per training iteration.")
@click.option("--save-s", "save", type=_TierSeconds(), multiple=True,
              help="Measured save time per tier, one or more: --save-s local=60 object=600.")
@click.option("--restore-s", "restore", type=_TierSeconds(), multiple=True,
              help="Restore time per tier on top of u0, one or more ('memory' = the checkpoint node's RAM copy).")
@click.option("--capture", type=click.Choice(CAPTURES), default="none", show_default=True,
              help="none: the trainer saves (and stalls); push|mirror: a checkpoint node saves, every iteration.")
@click.option("--interval-min", "intervals", type=click.FloatRange(min=0, min_open=True), multiple=True,
              help="Checkpoint intervals to evaluate, one or more: --interval-min 60 5.")
@click.option("--gpu-node-usd-h", type=click.FloatRange(min=0), help="Price of one GPU server, $/h (cost view).")
@click.option("--ckpt-node-usd-h", type=click.FloatRange(min=0), default=0.0, help="Price of one checkpoint node, $/h.")
@click.option("--ckpt-nodes", type=click.IntRange(min=0), default=0, help="Checkpoint nodes for the job.")
@click.option("--from-benchmarks", "bench_path", type=click.Path(exists=True, dir_okay=False),
              help="Markdown file with one table headed '| tier | save s/GB | restore s/GB |' (restore optional); "
                   "needs --state-gb.")
@click.option("--state-gb", type=click.FloatRange(min=0, min_open=True),
              help="Checkpoint size, GB (for --from-benchmarks).")
@click.option("--params", type=click.FloatRange(min=0, min_open=True),
              help="With --capture mirror: parameters the DP group all-reduces (e.g. 1.3e9); adds the node's core count.")
@click.option("--dp", type=click.IntRange(min=2), help="With --params: ranks in the DP ring (N).")
@click.option("--mirrored-ranks", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --params: mirrored streams one node decodes.")
@click.option("--protocol", type=click.Choice(["ll", "simple"]), default="ll", show_default=True,
              help="With --params: NCCL protocol of the ring.")
@click.option("--decode-gb-per-core-s", type=click.FloatRange(min=0, min_open=True),
              default=DEFAULT_DECODE_GB_PER_CORE_S, show_default=True,
              help="Measured decode rate, GB of wire per core-second (benchmarks/bench_mirror.py).")
@click.option("--update-ns-per-param", type=click.FloatRange(min=0), default=DEFAULT_UPDATE_NS_PER_PARAM,
              show_default=True, help="Measured optimizer update, ns per parameter on one core.")
@click.option("--cores-per-node", type=click.IntRange(min=1),
              help="With --params: cores of one checkpoint node; adds how many nodes must share the capture "
                   "(each decodes and updates its part of the parameters) to keep up.")
@click.option("--shared-decode-fraction", type=click.FloatRange(min=0, max=1),
              default=DEFAULT_SHARED_DECODE_FRACTION, show_default=True,
              help="Measured share of decode work every scaled-out node repeats (benchmarks/bench_mirror_scaleout.py).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (fields: flowcheck.cli.plan docs).")
@click.pass_context
def plan_command(ctx, config_path, gpus, gpus_per_node, rate, mtbf_hours, restart_min, iteration_s, save, restore,
                 capture, intervals, gpu_node_usd_h, ckpt_node_usd_h, ckpt_nodes, bench_path, state_gb, params, dp,
                 mirrored_ranks, protocol, decode_gb_per_core_s, update_ns_per_param, cores_per_node,
                 shared_decode_fraction, as_json):
    """Recommend checkpoint intervals per tier and the ETTR to expect, with the formulas used.

    \b
    Example:
      flowcheck plan --gpus 16000 --failures-per-node-day 0.0065 --restart-min 5 --interval-min 60 5
      flowcheck plan --gpus 3072 --mtbf-hours 3 --iteration-s 102 --save-s local=120 object=900 \\
          --restore-s local=60 object=600 --gpu-node-usd-h 32 --ckpt-node-usd-h 4 --ckpt-nodes 48
      flowcheck plan --gpus 1024 --failures-per-node-day 0.0065 --capture mirror --iteration-s 6 --json
      flowcheck plan --gpus 64 --mtbf-hours 24 --capture mirror --iteration-s 6 --params 1.3e9 --dp 8
      flowcheck plan --gpus 64 --mtbf-hours 24 --capture mirror --iteration-s 6 --params 1.3e9 --dp 8 \
          --cores-per-node 8
    """
    if (rate is None) == (mtbf_hours is None):
        raise click.UsageError("give exactly one of --failures-per-node-day and --mtbf-hours; found "
                               + ("both" if rate is not None else "neither"))
    if capture != "none" and iteration_s is None:
        raise click.BadParameter(f"--capture {capture} makes every iteration a recovery point: "
                                 "give the iteration time", param_hint="--iteration-s")
    if gpu_node_usd_h is not None and iteration_s is None:
        raise click.UsageError("the cost view compares against per-iteration capture: give --iteration-s")
    if params is not None and (capture != "mirror" or dp is None):
        raise click.UsageError("--params sizes a mirror-capture node: give --capture mirror and --dp too")
    if cores_per_node is not None and params is None:
        raise click.UsageError("--cores-per-node sizes a scaled-out mirror capture: give --params, --dp and "
                               "--capture mirror too")
    if bench_path is not None and state_gb is None:
        raise click.UsageError("--from-benchmarks gives seconds per GB: give the checkpoint size with --state-gb")
    try:
        bench = {}
        if bench_path is not None:
            with open(bench_path, encoding="utf-8") as f:
                bench = tiers_from_benchmarks(f.read(), bench_path, state_gb)
        tiers, capture_restore = _tiers(_pairs(save, "--save-s"), _pairs(restore, "--restore-s"), bench)
        if gpu_node_usd_h is not None and not tiers and not intervals:
            raise click.UsageError("the cost view needs a baseline without capture: give --save-s or --interval-min")
        cost = None if gpu_node_usd_h is None else CostInputs(gpu_node_usd_h, ckpt_node_usd_h, ckpt_nodes)
        result = plan(PlanInputs(
            gpus=gpus, gpus_per_node=gpus_per_node, failures_per_node_day=rate, mtbf_hours=mtbf_hours,
            restart_s=restart_min * 60.0, iteration_s=iteration_s, tiers=tiers, capture=capture,
            capture_restore_s=capture_restore, intervals_s=tuple(m * 60.0 for m in intervals), cost=cost))
        node = None if params is None else capacity(MirrorLoad(
            params=params, dp=dp, mirrored=mirrored_ranks, iteration_s=iteration_s, protocol=protocol,
            decode_gb_per_core_s=decode_gb_per_core_s, update_ns_per_param=update_ns_per_param,
            shared_decode_fraction=shared_decode_fraction))
        scaled = None if node is None or cores_per_node is None else scale_out(node, cores_per_node)
    except (FlowcheckError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        ctx.exit(2)
    if as_json:
        mirror_node = node and {**node.to_json(), "scale_out": scaled and scaled.to_json()}
        click.echo(json.dumps({**result.to_json(), "mirror_node": mirror_node}, indent=2, ensure_ascii=False))
        return
    if not (result.intervals or result.tiers or result.capture):
        click.echo("nothing to evaluate: give --interval-min, --save-s or --iteration-s (see --help)", err=True)
    lines = [""] + render_capacity(node) if node is not None else []
    lines += render_scale_out(node, scaled) if scaled is not None else []
    click.echo("\n".join(_render(result) + lines))
