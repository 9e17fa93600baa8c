"""The checkpoint-interval planner's model: failure rate, checkpoint costs and capture in, intervals and ETTR out.

ETTR (effective training time ratio) is useful training time / wall time.  Failures hit the whole
job as a Poisson process with rate λ = N·r_f (N nodes, r_f failures per node-day) or λ = 1/MTBF.
Two estimates, both pure functions of seconds:

* first order (Kokolis et al., HPCA'25, "Revisiting Reliability in Large-Scale ML Research
  Clusters", the RSC-1/RSC-2 ETTR model): ``E[ETTR] ≈ 1 − λ·(u0 + Δt/2)`` — each failure costs the
  restart overhead u0 plus on average half an interval of lost work.  Here extended the way Young
  (1974) wrote it when a save blocks training for δ: ``1 − δ/Δt − λ·(u0 + Δt/2)``.
* exact (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3), the complete cost model): a segment of Δt useful seconds plus a blocking save δ, with
  failures also striking during the restart R, takes ``M·e^{R/M}·(e^{(Δt+δ)/M} − 1)`` on average, so
  ``ETTR = Δt / (M·e^{R/M}·(e^{(Δt+δ)/M} − 1))`` with M = 1/λ.  Its maximiser is what Daly's
  perturbation formula approximates; Young's ``τ* = sqrt(2·δ·M)`` is its first-order term.

A save that does not block training (the checkpoint node writes from its RAM copy: push or mirror
capture) costs no stall, but the step only becomes a recovery point once the save is done: that lag
is charged as extra lost work per failure.  Per-iteration capture (FlowCheck's argument) makes every
iteration a recovery point: lost work ≈ iteration time / 2, no stall.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from flowcheck.errors import ConfigError

CAPTURES = ("none", "push", "mirror")
SECONDS_PER_DAY = 86400.0
FIRST_ORDER_FORMULA = "E[ETTR] ≈ 1 − N·r_f·(u0 + Δt/2)"
EXACT_FORMULA = "ETTR = Δt / (M·e^(R/M)·(e^((Δt+δ)/M) − 1))"


def _number(owner: str, name: str, value, *, minimum: float = 0.0, strict: bool = True, integer: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a finite number above (or at, when not strict) ``minimum``."""
    kind = "an integer" if integer else "a number"
    relation = ">" if strict else "≥"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or (
            value <= minimum if strict else value < minimum):
        raise ConfigError(f"{owner}.{name}: expected {kind} {relation} {minimum:g}, found {value!r}")


@dataclass(frozen=True)
class TierCost:
    """What one storage tier costs: seconds to save one step there and to restore the job from it."""

    name: str
    save_s: float        # measured time to make one step durable in this tier (whole job, in parallel)
    restore_s: float = 0.0  # extra time to read the step back, on top of the job restart u0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("TierCost.name: expected a tier name of letters, digits, '-' or '_', "
                              f"found {self.name!r}")
        _number(f"TierCost({self.name})", "save_s", self.save_s)
        _number(f"TierCost({self.name})", "restore_s", self.restore_s, strict=False)


@dataclass(frozen=True)
class CostInputs:
    """Prices for the cost view: GPU servers lose money when ETTR < 1; checkpoint nodes cost money."""

    gpu_node_usd_h: float        # one GPU server (all its GPUs), $/h
    ckpt_node_usd_h: float = 0.0  # one CPU checkpoint node, $/h
    ckpt_nodes: int = 0

    def __post_init__(self) -> None:
        _number("CostInputs", "gpu_node_usd_h", self.gpu_node_usd_h, strict=False)
        _number("CostInputs", "ckpt_node_usd_h", self.ckpt_node_usd_h, strict=False)
        _number("CostInputs", "ckpt_nodes", self.ckpt_nodes, strict=False, integer=True)


@dataclass(frozen=True)
class PlanInputs:
    """One job to plan for.  Give exactly one of ``failures_per_node_day`` and ``mtbf_hours``."""

    gpus: int
    gpus_per_node: int = 8
    failures_per_node_day: float | None = None  # r_f, per node (HPCA'25 RSC-1: 6.50 per 1000 node-days)
    mtbf_hours: float | None = None             # the whole job's mean time between failures
    restart_s: float = 300.0                     # u0: detect, reschedule, re-init, reload
    iteration_s: float | None = None             # one training iteration; needed for per-iteration capture
    tiers: tuple[TierCost, ...] = ()
    capture: str = "none"                        # none: the trainer's own saves block it; push|mirror: they don't
    capture_restore_s: float = 0.0               # reading the RAM copy back after a failure (with capture)
    intervals_s: tuple[float, ...] = ()          # checkpoint intervals the user asks about
    cost: CostInputs | None = None

    def __post_init__(self) -> None:
        _number("PlanInputs", "gpus", self.gpus, integer=True)
        _number("PlanInputs", "gpus_per_node", self.gpus_per_node, integer=True)
        if (self.failures_per_node_day is None) == (self.mtbf_hours is None):
            raise ConfigError("PlanInputs: expected exactly one of failures_per_node_day and mtbf_hours, found "
                              f"failures_per_node_day={self.failures_per_node_day!r}, mtbf_hours={self.mtbf_hours!r}")
        for name in ("failures_per_node_day", "mtbf_hours"):
            if getattr(self, name) is not None:
                _number("PlanInputs", name, getattr(self, name))
        _number("PlanInputs", "restart_s", self.restart_s, strict=False)
        _number("PlanInputs", "capture_restore_s", self.capture_restore_s, strict=False)
        if self.iteration_s is not None:
            _number("PlanInputs", "iteration_s", self.iteration_s)
        if self.capture not in CAPTURES:
            raise ConfigError(f"PlanInputs.capture: expected one of {CAPTURES}, found {self.capture!r}")
        if self.capture != "none" and self.iteration_s is None:
            raise ConfigError(f"PlanInputs.iteration_s: capture={self.capture!r} makes every iteration a recovery "
                              "point, so the iteration time is needed; found None")
        for t in self.intervals_s:
            _number("PlanInputs", "intervals_s[]", t)
        names = [t.name if isinstance(t, TierCost) else t for t in self.tiers]
        if len(set(names)) != len(names) or not all(isinstance(t, TierCost) for t in self.tiers):
            raise ConfigError(f"PlanInputs.tiers: expected TierCosts with distinct names, found {names!r}")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def failures_per_day(self) -> float:
        """λ for the whole job: N·r_f, or 24 / MTBF[h]."""
        if self.failures_per_node_day is not None:
            return self.nodes * self.failures_per_node_day
        return 24.0 / self.mtbf_hours

    @property
    def mtbf_s(self) -> float:
        return SECONDS_PER_DAY / self.failures_per_day

    @property
    def blocking_saves(self) -> bool:
        """Without capture the trainer saves its own state and stalls for the whole save."""
        return self.capture == "none"


# ---- the formulas (seconds in, ratios out) ----

def ettr_first_order(mtbf_s: float, interval_s: float, restart_s: float, stall_s: float = 0.0,
                     lag_s: float = 0.0) -> float:
    """HPCA'25 RSC-1 estimate ``1 − λ·(u0 + Δt/2)``, plus Young's stall term δ/Δt and a save lag; ≥ 0."""
    lost = (restart_s + lag_s + interval_s / 2.0) / mtbf_s
    return max(0.0, 1.0 - stall_s / interval_s - lost)


def ettr_exact(mtbf_s: float, interval_s: float, restart_s: float, stall_s: float = 0.0, lag_s: float = 0.0) -> float:
    """Daly's complete model: ``Δt / (M·e^{R/M}·(e^{(Δt+δ)/M} − 1))``, the save lag counted into R."""
    m = mtbf_s
    try:
        return interval_s / (m * math.exp((restart_s + lag_s) / m) * math.expm1((interval_s + stall_s) / m))
    except OverflowError:  # restarts or segments hundreds of MTBFs long: the job never gets anywhere
        return 0.0


def young_interval(stall_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval minimising lost time to first order, ``τ* = sqrt(2·δ·M)``."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum: ``sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + ⅑·(δ/2M)] − δ`` for δ < 2M, else M."""
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = stall_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall_s


def optimal_interval_exact(mtbf_s: float, stall_s: float) -> float:
    """The interval that maximises :func:`ettr_exact`, by golden-section search on log Δt.

    The maximiser does not depend on R (it only scales the wall time).  With no stall the
    optimum is "as often as possible" and this returns the lower end of the search range.
    """
    lo, hi = math.log(mtbf_s * 1e-9), math.log(mtbf_s * 10.0)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if ettr_exact(mtbf_s, math.exp(a), 0.0, stall_s) > ettr_exact(mtbf_s, math.exp(b), 0.0, stall_s):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2.0)


def usd_per_day_lost(gpu_nodes: int, gpu_node_usd_h: float, ettr: float) -> float:
    """What failures cost: the share of every GPU server's day that produced no training."""
    return gpu_nodes * gpu_node_usd_h * 24.0 * (1.0 - ettr)


# ---- the plan ----

@dataclass(frozen=True)
class IntervalResult:
    """ETTR at one checkpoint interval with saves not charged (the HPCA'25 setting), and per tier."""

    interval_s: float
    ettr_first_order: float
    ettr_exact: float
    formula: str                               # the first-order formula with the numbers substituted
    tiers: tuple[tuple[str, float], ...] = ()  # (tier, exact ETTR with that tier's stall/lag/restore)


@dataclass(frozen=True)
class TierPlan:
    """One tier's recommendation: the Young/Daly interval for its save cost and the ETTR restoring from it."""

    name: str
    save_s: float
    restore_s: float
    blocking: bool           # True when the save stalls training (no capture)
    interval_s: float        # recommended: Young/Daly τ* = sqrt(2·save_s·M)
    daly_interval_s: float   # Daly's higher-order optimum (matters when save_s is not ≪ M)
    lost_work_s: float       # per failure: interval/2, plus the save time when the save does not block
    recovery_s: float        # per failure: u0 + this tier's restore time
    ettr_first_order: float
    ettr_exact: float


@dataclass(frozen=True)
class CapturePlan:
    """Per-iteration recovery points (push or mirror capture): lost work ≈ iteration/2, no stall."""

    iteration_s: float
    lost_work_s: float
    recovery_s: float
    ettr_first_order: float
    ettr_exact: float


@dataclass(frozen=True)
class CostView:
    """$/day lost to failures without and with per-iteration capture, against the checkpoint nodes' $/day."""

    gpu_nodes: int
    baseline: str                 # what the capture is compared with
    baseline_ettr: float
    capture_ettr: float
    baseline_usd_day: float       # lost to failures with the baseline
    capture_usd_day: float        # lost to failures with per-iteration capture
    ckpt_nodes_usd_day: float
    net_saving_usd_day: float     # baseline − capture − checkpoint nodes


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    intervals: tuple[IntervalResult, ...]
    tiers: tuple[TierPlan, ...]
    capture: CapturePlan | None
    cost: CostView | None

    def to_json(self) -> dict:
        """The ``--json`` document (field meanings: :mod:`flowcheck.cli.plan`)."""
        i = self.inputs
        return {
            "nodes": i.nodes, "gpus": i.gpus, "failures_per_day": i.failures_per_day,
            "mtbf_hours": i.mtbf_s / 3600.0, "restart_min": i.restart_s / 60.0, "capture": i.capture,
            "formula": {"first_order": FIRST_ORDER_FORMULA, "exact": EXACT_FORMULA},
            "intervals": [{"interval_min": r.interval_s / 60.0, "ettr_first_order": r.ettr_first_order,
                           "ettr_exact": r.ettr_exact, "formula": r.formula, "tiers": dict(r.tiers)}
                          for r in self.intervals],
            "tiers": [{"tier": t.name, "save_s": t.save_s, "restore_s": t.restore_s, "blocking": t.blocking,
                       "interval_min": t.interval_s / 60.0, "daly_interval_min": t.daly_interval_s / 60.0,
                       "lost_work_min": t.lost_work_s / 60.0, "recovery_min": t.recovery_s / 60.0,
                       "ettr_first_order": t.ettr_first_order, "ettr_exact": t.ettr_exact} for t in self.tiers],
            "per_iteration": None if self.capture is None else {
                "iteration_s": self.capture.iteration_s, "lost_work_s": self.capture.lost_work_s,
                "recovery_min": self.capture.recovery_s / 60.0,
                "ettr_first_order": self.capture.ettr_first_order, "ettr_exact": self.capture.ettr_exact},
            "cost": None if self.cost is None else {
                "gpu_nodes": self.cost.gpu_nodes, "baseline": self.cost.baseline,
                "baseline_ettr": self.cost.baseline_ettr, "capture_ettr": self.cost.capture_ettr,
                "baseline_usd_day": self.cost.baseline_usd_day, "capture_usd_day": self.cost.capture_usd_day,
                "ckpt_nodes_usd_day": self.cost.ckpt_nodes_usd_day,
                "net_saving_usd_day": self.cost.net_saving_usd_day},
        }


def first_order_formula(inputs: PlanInputs, interval_s: float) -> str:
    """``E[ETTR] ≈ 1 − N·r_f·(u0 + Δt/2)`` with this job's numbers in it."""
    if inputs.failures_per_node_day is not None:
        rate = f"{inputs.nodes} × {inputs.failures_per_node_day:g}/node-day"
    else:
        rate = f"1/({inputs.mtbf_hours:g} h)"
    u0, dt = inputs.restart_s / 60.0, interval_s / 60.0
    lost = (inputs.restart_s + interval_s / 2.0) / inputs.mtbf_s
    return (f"1 − {rate} × ({u0:g} min + {dt:g} min/2) = 1 − {inputs.failures_per_day:.3g}/day × "
            f"{u0 + dt / 2:g} min = 1 − {lost:.3f} = {1.0 - lost:.3f}" + (" → 0: no progress" if lost > 1 else ""))


def _tier_terms(inputs: PlanInputs, tier: TierCost) -> tuple[float, float, float]:
    """(stall, lag, recovery) seconds for restoring from ``tier``."""
    stall, lag = (tier.save_s, 0.0) if inputs.blocking_saves else (0.0, tier.save_s)
    return stall, lag, inputs.restart_s + tier.restore_s


def plan_tier(inputs: PlanInputs, tier: TierCost) -> TierPlan:
    m = inputs.mtbf_s
    stall, lag, recovery = _tier_terms(inputs, tier)
    tau = young_interval(tier.save_s, m)
    return TierPlan(
        name=tier.name, save_s=tier.save_s, restore_s=tier.restore_s, blocking=inputs.blocking_saves,
        interval_s=tau, daly_interval_s=daly_interval(tier.save_s, m), lost_work_s=tau / 2.0 + lag,
        recovery_s=recovery, ettr_first_order=ettr_first_order(m, tau, recovery, stall, lag),
        ettr_exact=ettr_exact(m, tau, recovery, stall, lag))


def plan_capture(inputs: PlanInputs) -> CapturePlan | None:
    """Every iteration a recovery point; ``None`` without an iteration time."""
    if inputs.iteration_s is None:
        return None
    t, m, recovery = inputs.iteration_s, inputs.mtbf_s, inputs.restart_s + inputs.capture_restore_s
    return CapturePlan(iteration_s=t, lost_work_s=t / 2.0, recovery_s=recovery,
                       ettr_first_order=ettr_first_order(m, t, recovery), ettr_exact=ettr_exact(m, t, recovery))


def plan_interval(inputs: PlanInputs, interval_s: float) -> IntervalResult:
    m = inputs.mtbf_s
    per_tier = []
    for tier in inputs.tiers:
        stall, lag, recovery = _tier_terms(inputs, tier)
        per_tier.append((tier.name, ettr_exact(m, interval_s, recovery, stall, lag)))
    return IntervalResult(interval_s=interval_s, ettr_first_order=ettr_first_order(m, interval_s, inputs.restart_s),
                          ettr_exact=ettr_exact(m, interval_s, inputs.restart_s), tiers=tuple(per_tier),
                          formula=first_order_formula(inputs, interval_s))


def cost_view(gpu_nodes: int, cost: CostInputs, baseline: str, baseline_ettr: float, capture_ettr: float) -> CostView:
    """Net saving/day = (lost with the baseline) − (lost with capture) − (checkpoint nodes)."""
    base = usd_per_day_lost(gpu_nodes, cost.gpu_node_usd_h, baseline_ettr)
    cap = usd_per_day_lost(gpu_nodes, cost.gpu_node_usd_h, capture_ettr)
    nodes = cost.ckpt_nodes * cost.ckpt_node_usd_h * 24.0
    return CostView(gpu_nodes=gpu_nodes, baseline=baseline, baseline_ettr=baseline_ettr, capture_ettr=capture_ettr,
                    baseline_usd_day=base, capture_usd_day=cap, ckpt_nodes_usd_day=nodes,
                    net_saving_usd_day=base - cap - nodes)


def _baseline(inputs: PlanInputs, tiers: tuple[TierPlan, ...],
              intervals: tuple[IntervalResult, ...]) -> tuple[str, float] | None:
    """Without checkpoint nodes: the trainer's own blocking saves at the best tier's Young/Daly interval,
    else the first interval asked about (saves not charged)."""
    if tiers:
        m = inputs.mtbf_s
        options = []
        for t in tiers:
            recovery = inputs.restart_s + t.restore_s
            options.append((ettr_exact(m, t.interval_s, recovery, t.save_s),
                            f"blocking saves to {t.name} every {t.interval_s / 60:.1f} min"))
        ettr, label = max(options)
        return label, ettr
    if intervals:
        return f"checkpoints every {intervals[0].interval_s / 60:g} min", intervals[0].ettr_exact
    return None


def plan(inputs: PlanInputs) -> Plan:
    """Everything the ``plan`` command prints, from one validated input."""
    tiers = tuple(plan_tier(inputs, t) for t in inputs.tiers)
    intervals = tuple(plan_interval(inputs, s) for s in inputs.intervals_s)
    capture = plan_capture(inputs)
    cost = None
    baseline = _baseline(inputs, tiers, intervals)
    if inputs.cost is not None and capture is not None and baseline is not None:
        cost = cost_view(inputs.nodes, inputs.cost, baseline[0], baseline[1], capture.ettr_exact)
    return Plan(inputs=inputs, intervals=intervals, tiers=tiers, capture=capture, cost=cost)
