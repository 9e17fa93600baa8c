"""Issue 33: a CUDA trainer pushing to a `flowcheck serve` node, side by side with DCP async_save and torch.save.

Trainer (as ../shared/bench/gpu_push.py): --layers blocks of LayerNorm + Linear(h, 4h) + GELU + Linear(4h, h) at width
--hidden, fp32, fused AdamW, TF32 matmuls, one fixed --batch x --seq input. A `flowcheck serve` node runs on this
host in a child process (bench_push.py's NodeProc). For each cadence of --every (a save every k iterations), in one
run: no checkpoint (the baseline, measured before and after the others), flowcheck Checkpointer(transport="shm") and
(transport="tcp") with gpu_staging=--gpu-staging, DCP async_save (each save first waits for the previous future) and
torch.save to one file; --iters timed iterations each (DCP and torch.save: at most --max-saves saves).
Reported per alternative: blocked per save = training-thread seconds inside checkpoint calls ÷ saves asked
(flowcheck: the save() calls, the optimizer hook's wait() from ckpt.stats.blocked_s, and a wait() for the last save;
DCP: the previous future's result() + the async_save() call; torch.save: the call); wall slowdown = seconds per
iteration ÷ the baseline's − 1; saves asked / pushed / coalesced (ckpt.stats); checkpoint throughput = state bytes ÷
blocked per save, and its ratio to the pinned device-to-host bound.
Limits, same run, same bytes (params + exp_avg + exp_avg_sq): a device-to-device copy into one preallocated CUDA
buffer and a device-to-host copy into one preallocated pinned buffer, timed with CUDA events (median of
--limit-repeats). Fidelity: training on a non-default CUDA stream, a step is pushed right after optimizer.step()
with the next iterations queued at once; the node snapshots it (POST /snapshot) and every stored tensor must equal
a clone taken on that stream at that step, bit for bit.
Needs CUDA: without it, says so and exits with status 2. --smoke: tiny sizes, still on CUDA. Results: the markdown
table on stdout, JSON in --out (rewritten after every phase, so a run cut short keeps what it measured).

  python benchmarks/bench_push_gpu.py                       # 6 blocks of width 4096, batch 8 x 2048: ~9.7 GB of state
  python benchmarks/bench_push_gpu.py --smoke --out /tmp/push_gpu.json
  python benchmarks/bench_push_gpu.py --every 5 --alts shm,tcp --gpu-staging off
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import math
import os
import shutil
import statistics
import sys
import time
import urllib.error
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common as c
from bench_push import NodeProc

SCRIPT = "bench_push_gpu.py"
NO_CUDA = ("bench_push_gpu: needs a CUDA device (torch.cuda.is_available() is False); run it on a GPU machine — "
           "see BENCHMARKS.md")
ALTS = ("shm", "tcp", "dcp", "torch.save")
METHOD = {"shm": "flowcheck Checkpointer (shm)", "tcp": "flowcheck Checkpointer (tcp)", "dcp": "DCP async_save",
          "torch.save": "torch.save"}
SMOKE = {"layers": 2, "hidden": 64, "batch": 2, "seq": 16, "iters": 10, "warmup": 2}
QUEUED_AFTER_PUSH = 3  # iterations queued right behind the fidelity push, before anything waits for it


# ---- command line ---------------------------------------------------------------------------
def staging_arg(text: str) -> str | int:
    """--gpu-staging: "auto", "off" (0) or a byte budget."""
    if text in ("auto", "off"):
        return "auto" if text == "auto" else 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number of bytes, found {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of bytes >= 0, found {value}")
    return value


def cadences_arg(text: str) -> list[int]:
    """--every: comma-separated positive iteration counts."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas (1,5), found {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, what in (
            ("--layers", 6, "blocks"), ("--hidden", 4096, "width"), ("--batch", 8, "sequences per batch"),
            ("--seq", 2048, "tokens per sequence"), ("--iters", 20, "timed iterations per alternative and cadence"),
            ("--warmup", 3, "untimed iterations before the first measurement"),
            ("--max-saves", 3, "saves per cadence for DCP async_save and torch.save (seconds each)"),
            ("--limit-repeats", 5, "timed copies per limit; the median is reported")):
        p.add_argument(name, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--every", type=cadences_arg, default=[1, 5], help="save cadences in iterations (default 1,5)")
    p.add_argument("--gpu-staging", type=staging_arg, default="auto",
                   help="Checkpointer(gpu_staging=): auto (stage device-to-device when free device memory allows), "
                        "off, or a byte budget (default auto)")
    p.add_argument("--alts", default=",".join(ALTS),
                   help=f"alternatives besides the baseline (default {','.join(ALTS)})")
    p.add_argument("--on-busy", default=None, help="Checkpointer(on_busy=) (default: the Checkpointer's own)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="Checkpointer(timeout_s=) and flush timeouts (default 600)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "push_gpu.json"),
                   help="results as JSON (default benchmarks/results/push_gpu.json)")
    p.add_argument("--dir", help="work directory base (default $FLOWCHECK_BENCH_DIR or /tmp)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (overrides --layers/--hidden/--batch/--seq/--iters/--warmup)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    args.alts = [a for a in args.alts.split(",") if a]
    unknown = sorted(set(args.alts) - set(ALTS))
    if unknown:
        p.error(f"--alts: unknown {', '.join(unknown)}; expected some of {','.join(ALTS)}")
    if max(args.every) > args.iters or args.max_saves < 1:
        p.error(f"expected --every <= --iters ({args.iters}) and --max-saves >= 1: every alternative saves at least "
                "once")
    return args


# ---- the trainer --------------------------------------------------------------------------
@dataclass(frozen=True)
class Trainer:
    """The model, its optimizer and the input, on CUDA; ``step()`` is one training iteration."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor

    def step(self) -> None:
        loss = self.model(self.x).float().pow(2).mean()
        loss.backward()
        self.opt.step()  # a Checkpointer's pre-step hook runs its wait() first
        self.opt.zero_grad(set_to_none=False)

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor a push carries, under the node's names: state-dict entries and optimizer.<slot>.<param>."""
        out = dict(self.model.state_dict())
        for name, prm in self.model.named_parameters():
            out.update({f"optimizer.{slot}.{name}": t for slot, t in self.opt.state[prm].items()
                        if isinstance(t, torch.Tensor)})
        return out

    def limit_sources(self) -> list[torch.Tensor]:
        """The bytes the limits copy: every parameter, exp_avg and exp_avg_sq, as flat uint8 views."""
        prms = list(self.model.parameters())
        tensors = prms + [self.opt.state[q][slot] for slot in ("exp_avg", "exp_avg_sq") for q in prms]
        return [t.detach().reshape(-1).view(torch.uint8) for t in tensors]

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}


def build_trainer(args: argparse.Namespace) -> Trainer:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    h = args.hidden
    with torch.device("cuda"):
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h),
                                                          torch.nn.GELU(), torch.nn.Linear(4 * h, h))
                                      for _ in range(args.layers)])
        x = torch.randn(args.batch, args.seq, h)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), x)
    for _ in range(max(1, args.warmup)):  # at least one: the optimizer's moments exist from then on
        trainer.step()
    torch.cuda.synchronize()
    return trainer


def timed(trainer: Trainer, iters: int, every: int, save: Callable[[int], Any] | None = None,
          finish: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(wall seconds of ``iters`` iterations, seconds inside ``save(i)`` after every ``every``-th and ``finish()``)."""
    torch.cuda.synchronize()
    t0, inside = time.perf_counter(), 0.0
    for i in range(1, iters + 1):
        trainer.step()
        if save is not None and i % every == 0:
            t = time.perf_counter()
            save(i)
            inside += time.perf_counter() - t
    if finish is not None:
        t = time.perf_counter()
        finish()
        inside += time.perf_counter() - t
    torch.cuda.synchronize()
    return time.perf_counter() - t0, inside


# ---- the limits -----------------------------------------------------------------------------
def copy_seconds(srcs: list[torch.Tensor], dst: torch.Tensor, repeats: int) -> list[float]:
    """Seconds (CUDA events) to copy each of ``srcs`` into its slice of ``dst``, ``repeats`` times after one untimed."""
    times = []
    for r in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # the device idles while every copy is queued: launch gaps are not timed
        start.record()
        at = 0
        for s in srcs:
            dst[at:at + s.numel()].copy_(s, non_blocking=True)
            at += s.numel()
        end.record()
        end.synchronize()
        if r:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def measure_limits(trainer: Trainer, repeats: int) -> dict[str, dict]:
    srcs = trainer.limit_sources()
    nbytes = sum(s.numel() for s in srcs)
    out = {}
    for key, label, pinned in (("d2d", "device-to-device copy (one preallocated CUDA buffer)", False),
                               ("d2h", "pinned device-to-host copy (one preallocated pinned buffer)", True)):
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pinned else \
            torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        times = copy_seconds(srcs, dst, max(1, repeats))
        dst = None
        med = statistics.median(times)
        out[key] = {"method": label, "bytes": nbytes, "times_s": times, "median_s": med, "min_s": min(times),
                    "gbps": nbytes / 1e9 / med}
        print(f"  limit {label}: {med * 1e3:.2f} ms, {nbytes / 1e9 / med:.1f} GB/s", flush=True)
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # the pinned buffer goes back to the OS, not to torch's cache
        torch._C._host_emptyCache()
    return out


# ---- the alternatives ---------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One alternative at one cadence: iterations timed, wall seconds, saves asked, training-thread seconds blocked."""

    method: str
    every: int
    iters: int
    wall_s: float = float("nan")
    saves: int = 0
    blocked_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class Bench:
    """One run: the trainer, the node, the work folder, and the step numbers pushed (increasing across phases)."""

    def __init__(self, args: argparse.Namespace, trainer: Trainer, node: NodeProc, work: str) -> None:
        self.args, self.trainer, self.node, self.work = args, trainer, node, work
        self.steps = itertools.count(1)
        self.phases: list[Phase] = []

    def checkpointer(self, transport: str):
        from flowcheck.torch import Checkpointer

        return Checkpointer(self.trainer.model, self.trainer.opt, node=self.node.push, run="bench",
                            transport=transport, timeout_s=self.args.timeout_s, gpu_staging=self.args.gpu_staging,
                            on_busy=self.args.on_busy)

    def baseline(self, every: int) -> Phase:
        wall, _ = timed(self.trainer, self.args.iters, every)
        return Phase("no checkpoint", every, self.args.iters, wall)

    def flowcheck(self, transport: str, every: int) -> Phase:
        ck = self.checkpointer(transport)
        try:
            ck.save(next(self.steps))
            ck.flush(self.args.timeout_s)  # the first push allocates the buffers (here and on the node): not timed
            keys = ("saves", "sent", "coalesced", "failures", "blocked_s")
            before, in_calls = {k: getattr(ck.stats, k) for k in keys}, [0.0]

            def counted(call: Callable[[], Any]) -> None:  # the stats' blocked time inside a call timed from outside
                b = ck.stats.blocked_s
                call()
                in_calls[0] += ck.stats.blocked_s - b

            wall, outside = timed(self.trainer, self.args.iters, every,
                                  lambda i: counted(lambda: ck.save(next(self.steps))),
                                  lambda: counted(ck.wait))  # the last save's wait(), which the next step would do
            t = time.perf_counter()
            flushed = ck.flush(self.args.timeout_s)
            tail = time.perf_counter() - t
            d = {k: getattr(ck.stats, k) - v for k, v in before.items()}
            hook = d["blocked_s"] - in_calls[0]  # what remains: the optimizer hook's wait() inside opt.step()
            extra = {"pushed": d["sent"], "coalesced": d["coalesced"], "failures": d["failures"],
                     "gpu_staging": ck.config.gpu_staging, "staged": ck.stats.staged, "on_busy": ck.config.on_busy,
                     "stats_blocked_s": d["blocked_s"], "hook_wait_s": hook, "flushed": flushed, "tail_s": tail,
                     "last_copy_s": ck.stats.last_copy_s, "last_send_s": ck.stats.last_send_s,
                     "buffer_bytes": ck.stats.buffer_bytes, "last_error": ck.stats.last_error}
            return Phase(METHOD[transport], every, self.args.iters, wall, d["saves"], outside + hook, extra)
        finally:
            ck.close()

    def dcp(self, every: int) -> Phase:
        import torch.distributed.checkpoint as dcp

        pending, waited, n = [None], [0.0], min(self.args.iters, self.args.max_saves * every)

        def save(i: int) -> None:
            if pending[0] is not None:
                t = time.perf_counter()
                pending[0].result()
                waited[0] += time.perf_counter() - t
            writer = dcp.FileSystemWriter(os.path.join(self.work, f"dcp-{every}-{i}"))
            pending[0] = dcp.async_save(self.trainer.state_dicts(), storage_writer=writer, no_dist=True)

        save(0)
        pending[0].result()  # the first call sets DCP up: not timed
        pending[0] = None
        shutil.rmtree(os.path.join(self.work, f"dcp-{every}-0"), ignore_errors=True)
        wall, blocked = timed(self.trainer, n, every, save)
        t = time.perf_counter()
        pending[0].result()
        extra = {"tail_s": time.perf_counter() - t, "wait_previous_s": waited[0],
                 "async_save_call_s": blocked - waited[0]}
        for d in os.listdir(self.work):
            if d.startswith("dcp-"):
                shutil.rmtree(os.path.join(self.work, d), ignore_errors=True)
        return Phase(METHOD["dcp"], every, n, wall, n // every, blocked, extra)

    def torch_save(self, every: int) -> Phase:
        path, n = os.path.join(self.work, "state.pt"), min(self.args.iters, self.args.max_saves * every)
        wall, blocked = timed(self.trainer, n, every, lambda i: torch.save(self.trainer.state_dicts(), path))
        with contextlib.suppress(OSError):
            os.remove(path)
        note = {"note": "one file, overwritten, no fsync"}
        return Phase(METHOD["torch.save"], every, n, wall, n // every, blocked, note)

    def alternative(self, alt: str, every: int) -> Phase:
        run = {"shm": lambda: self.flowcheck("shm", every), "tcp": lambda: self.flowcheck("tcp", every),
               "dcp": lambda: self.dcp(every), "torch.save": lambda: self.torch_save(every)}[alt]
        try:
            phase = run()
        except Exception as e:  # noqa: BLE001 - a failing alternative is reported, the others still run
            phase = Phase(METHOD[alt], every, 0, error=f"{type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.synchronize()
        print(f"  every {every}: {phase.method}: " + (f"FAILED {phase.error}" if phase.error else
              f"{phase.wall_s / phase.iters:.4f} s/iteration, blocked {per_save(phase) * 1e3:.1f} ms/save over "
              f"{phase.saves} saves; " + ", ".join(f"{k} {v}" for k, v in phase.extra.items())), flush=True)
        return phase

    def cadence(self, every: int, on_phase: Callable[[], None]) -> None:
        """The baseline, every alternative, the baseline again (a drifting machine shows; the two make the baseline),
        each appended to ``self.phases``; ``on_phase()`` after each."""
        first, at = self.baseline(every), len(self.phases)
        self.phases.append(first)
        for alt in self.args.alts:
            self.phases.append(self.alternative(alt, every))
            on_phase()
        again = self.baseline(every)
        self.phases[at] = Phase(
            "no checkpoint", every, first.iters + again.iters, first.wall_s + again.wall_s,
            extra={"before_s_per_iter": first.wall_s / first.iters, "after_s_per_iter": again.wall_s / again.iters})
        on_phase()

    def fidelity(self) -> dict[str, Any]:
        """Push a step right after optimizer.step() on a non-default stream, keep training, compare what is stored."""
        ck, side = self.checkpointer("shm"), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                self.trainer.step()
                ck.save(next(self.steps))
                ck.flush(self.args.timeout_s)  # allocation: not part of the check
                self.trainer.step()
                want = {k: t.detach().clone() for k, t in self.trainer.state().items()}  # queued on ``side`` too
                step = next(self.steps)
                ck.save(step)
                for _ in range(QUEUED_AFTER_PUSH):
                    self.trainer.step()
            flushed, staged = ck.flush(self.args.timeout_s), ck.stats.staged
        finally:
            ck.close()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            snap = self.node.get("/snapshot", "POST")
        except urllib.error.HTTPError as e:
            return {"step": step, "flushed": flushed, "error": f"POST /snapshot: {e.code} {e.read().decode()[:300]}"}
        found = compare(self.node.cfg, snap["step"], want)
        ok = found["snapshot_step"] == step and found["bit_exact"] == found["tensors"]
        return {"step": step, "flushed": flushed, "staged": staged, "ok": ok, **found}


def compare(cfg: str, step: int, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every tensor of the local tier's ``step`` against ``want``, byte for byte."""
    import numpy as np

    from flowcheck.store import open_store

    local = open_store(cfg).local
    manifest = local.manifest(step)
    stored, bad = set(manifest.tensors), []
    for name in sorted(stored & want.keys()):
        got = np.ascontiguousarray(local.read(step, name, manifest=manifest)).reshape(-1).view(np.uint8)
        ref = want[name].cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if not np.array_equal(got, ref):
            bad.append(name)
    missing, unexpected = sorted(want.keys() - stored), sorted(stored - want.keys())
    return {"snapshot_step": step, "tensors": len(want), "bit_exact": len(stored & want.keys()) - len(bad),
            "mismatch": bad[:8], "missing": missing[:8], "unexpected": unexpected[:8]}


# ---- results ------------------------------------------------------------------------------
def per_save(p: Phase) -> float:
    return p.blocked_s / p.saves if p.saves else float("nan")


def row_json(p: Phase, base: Phase | None, state_bytes: int, d2h_gbps: float | None) -> dict[str, Any]:
    it = p.wall_s / p.iters if p.iters else None
    slowdown = it / (base.wall_s / base.iters) - 1 if base is not None and p is not base and it is not None else None
    blk = per_save(p)
    gbps = state_bytes / 1e9 / blk if p.saves and blk > 0 else None
    return {"method": p.method, "every": p.every, "iterations": p.iters, "wall_s": p.wall_s, "iter_s": it,
            "slowdown": slowdown, "saves": p.saves, "blocked_s": p.blocked_s,
            "blocked_per_save_s": blk if p.saves else None,
            "throughput_gbps": gbps, "throughput_vs_d2h": gbps / d2h_gbps if gbps and d2h_gbps else None,
            "pushed_share": p.extra["pushed"] / p.saves if "pushed" in p.extra and p.saves else None,
            **p.extra, "error": p.error}


def rows_json(phases: list[Phase], state_bytes: int, limits: dict[str, dict]) -> list[dict[str, Any]]:
    d2h = limits.get("d2h", {}).get("gbps")
    bases = {p.every: p for p in phases if p.method == "no checkpoint"}
    return [row_json(p, bases.get(p.every), state_bytes, d2h) for p in phases]


def fmt(v: float | None, unit: str) -> str:
    if v is None or math.isnan(v):
        return "–"
    shown = {"ms": f"{1e3 * v:.1f} ms", "%": f"{100 * v:+.1f}%", "GB/s": f"{v:.1f} GB/s", "x": f"{v:.2f}x"}
    return shown.get(unit, f"{v:g}")


def goal_text(op: str, bound: float, unit: str) -> str:
    scaled = {"ms": 1e3 * bound, "%": 100 * bound}.get(unit, bound)
    return f"{op} {scaled:g}{'' if unit in ('%', 'x', '') else ' '}{unit}"


def table(rows: list[dict[str, Any]]) -> str:
    out = [("| save every | method | iterations | s/iteration | wall slowdown | blocked per save | saves asked / "
            "pushed / coalesced | checkpoint throughput | ÷ pinned D2H | notes |"),
           "|---:|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        if r["error"]:
            out.append(f"| {r['every']} | {r['method']} |" + " – |" * 7 + f" FAILED: {r['error']} |")
            continue
        counts = f"{r['saves']} / {r.get('pushed', '–')} / {r.get('coalesced', '–')}" if r["saves"] else "–"
        out.append(f"| {r['every']} | {r['method']} | {r['iterations']} | {r['iter_s']:.4f} | "
                   f"{'**baseline**' if r['method'] == 'no checkpoint' else fmt(r['slowdown'], '%')} | "
                   f"{fmt(r['blocked_per_save_s'], 'ms')} | {counts} | {fmt(r['throughput_gbps'], 'GB/s')} | "
                   f"{fmt(r['throughput_vs_d2h'], 'x')} | {notes(r)} |")
    return "\n".join(out)


def notes(r: dict[str, Any]) -> str:
    if "before_s_per_iter" in r:
        return (f"measured before and after the others: {r['before_s_per_iter']:.4f} / "
                f"{r['after_s_per_iter']:.4f} s/iteration")
    if "gpu_staging" in r:
        return (f"gpu_staging={r['gpu_staging']}, staged={r['staged']}, on_busy={r['on_busy']}; hook wait "
                f"{fmt(r['hook_wait_s'] / max(1, r['saves']), 'ms')}/save; last copy {r['last_copy_s']:.3f} s, send "
                f"{r['last_send_s']:.3f} s; flush after the loop {r['tail_s']:.2f} s; failures {r['failures']}"
                + (f"; last error: {r['last_error']}" if r["last_error"] else ""))
    if "wait_previous_s" in r:
        return (f"previous future {fmt(r['wait_previous_s'] / max(1, r['saves']), 'ms')}/save, async_save call "
                f"{fmt(r['async_save_call_s'] / max(1, r['saves']), 'ms')}/save; last future {r['tail_s']:.2f} s "
                "after the loop")
    return r.get("note", "")


def goals(rows: list[dict[str, Any]], fidelity: dict[str, Any]) -> list[tuple[str, float | None, str, float, str]]:
    """(comparison, value, op, bound, unit) for issue 33's goals."""
    out = []
    for r in (r for r in rows if "gpu_staging" in r and not r["error"]):
        name = f"every {r['every']}, {r['method']}"
        if r["every"] == 5:
            out += [(f"{name}: blocked per save", r["blocked_per_save_s"], "<=", 0.05, "ms"),
                    (f"{name}: wall slowdown", r["slowdown"], "<=", 0.03, "%"),
                    (f"{name}: saves coalesced", r["coalesced"], "=", 0, "")]
        if r["every"] == 1:
            out += [(f"{name}: wall slowdown", r["slowdown"], "<=", 0.10, "%"),
                    (f"{name}: saves pushed ÷ asked", r["pushed_share"], ">=", 0.5, "x")]
        if r["staged"]:
            out.append((f"{name}: checkpoint throughput (staged)", r["throughput_gbps"], ">=", 100.0, "GB/s"))
        else:
            out.append((f"{name}: checkpoint throughput ÷ pinned D2H (not staged)", r["throughput_vs_d2h"], ">=", 0.8,
                        "x"))
    if "tensors" in fidelity:
        out.append(("fidelity: stored tensors not bit-exact (non-default stream, training queued behind the push)",
                    fidelity["tensors"] - fidelity["bit_exact"], "=", 0, ""))
    return out


def met(value: float | None, op: str, bound: float) -> bool | None:
    if value is None or math.isnan(value):
        return None
    return value <= bound if op == "<=" else value >= bound if op == ">=" else value == bound


def goal_table(rows: list[tuple[str, float | None, str, float, str]]) -> str:
    out = ["| comparison | value | goal | met? |", "|---|---:|---|---|"]
    for name, value, op, bound, unit in rows:
        ok = met(value, op, bound)
        verdict = "–" if ok is None else "yes" if ok else "no"
        out.append(f"| {name} | {fmt(value, unit)} | {goal_text(op, bound, unit)} | {verdict} |")
    return "\n".join(out)


def limits_table(limits: dict[str, dict]) -> str:
    out = ["| limit (the same bytes: params + exp_avg + exp_avg_sq) | median s | min s | GB/s |",
           "|---|---:|---:|---:|"]
    out += [f"| {x['method']} | {x['median_s']:.4f} | {x['min_s']:.4f} | {x['gbps']:.1f} |" for x in limits.values()]
    return "\n".join(out)


def fidelity_line(f: dict[str, Any]) -> str:
    if "error" in f:
        return f"- fidelity: FAILED: {f['error']}"
    return (f"- fidelity: step {f.get('step')} pushed right after optimizer.step() on a non-default stream, "
            f"{QUEUED_AFTER_PUSH} iterations queued behind it; node snapshot of step {f.get('snapshot_step')}: "
            f"{f.get('bit_exact')}/{f.get('tensors')} tensors bit-exact (staged={f.get('staged')}, flushed="
            f"{f.get('flushed')}); mismatched {f.get('mismatch')}, missing {f.get('missing')}, unexpected "
            f"{f.get('unexpected')}")


# ---- the run --------------------------------------------------------------------------------
def describe(args: argparse.Namespace, trainer: Trainer, state_bytes: int) -> str:
    n = sum(q.numel() for q in trainer.model.parameters())
    return (f"{args.layers} blocks (LayerNorm + Linear {args.hidden}->{4 * args.hidden} + GELU + Linear back), "
            f"{n / 1e6:.1f}M params, fp32, fused AdamW, TF32; state (params + exp_avg + exp_avg_sq) "
            f"{state_bytes / 1e9:.3f} GB; batch {args.batch} x seq {args.seq}; {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}")


def report(args: argparse.Namespace, cmd: str, description: str, result: dict[str, Any],
           goal_rows: list[tuple[str, float | None, str, float, str]]) -> str:
    extra = (f"- model: {description}\n- cadences {args.every}; {args.iters} timed iterations per alternative (DCP, "
             f"torch.save: at most {args.max_saves} saves); --gpu-staging {args.gpu_staging}; node: `flowcheck serve` "
             f"on this host\n" + fidelity_line(result["fidelity"]))
    title = ("Issue 33: GPU push — blocked per save, wall slowdown and checkpoint throughput vs DCP, torch.save and "
             "the copy limits")
    return "\n\n".join([c.header(title, None, args, cmd, extra), table(result["rows"]),
                        limits_table(result["limits"]), goal_table(goal_rows)])


def save(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    c.save_json(path, result)


def measure(args: argparse.Namespace, trainer: Trainer, result: dict[str, Any]) -> None:
    """The alternatives at every cadence, then the fidelity check, against a node started here; into ``result``."""
    work = c.workdir("fc-bench-push-gpu-", args.dir)
    c.check_disk(work, int(1.1 * args.max_saves * result["state_bytes"]))  # DCP's saves of one cadence
    node = NodeProc(work)
    bench = Bench(args, trainer, node, work)

    def on_phase() -> None:  # the JSON so far: a run cut short keeps what it measured
        result["rows"] = rows_json(bench.phases, result["state_bytes"], result["limits"])
        save(args.out, result)

    try:
        for every in args.every:
            bench.cadence(every, on_phase)
        try:
            result["fidelity"] = bench.fidelity()
        except Exception as e:  # noqa: BLE001 - reported; the tables still print
            result["fidelity"] = {"error": f"{type(e).__name__}: {e}"}
        with contextlib.suppress(Exception):
            result["node_status"] = node.get("/status")
    finally:
        node.stop()
        c.rmtree(work)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        raise SystemExit(2)
    cmd = c.command(SCRIPT, argv)
    warnings.filterwarnings("ignore", message="(torch.distributed is disabled|Detected an existing checkpoint)")
    trainer = build_trainer(args)
    state_bytes = sum(s.numel() for s in trainer.limit_sources())
    description = describe(args, trainer, state_bytes)
    print(f"push_gpu: {description}", flush=True)
    limits = measure_limits(trainer, args.limit_repeats)
    result = {"benchmark": "push_gpu", "command": cmd, "machine": c.machine(), "model": description,
              "state_bytes": state_bytes, "gpu_staging": args.gpu_staging, "limits": limits, "rows": [],
              "fidelity": {}, "goals": []}
    measure(args, trainer, result)
    goal_rows = goals(result["rows"], result["fidelity"])
    result["goals"] = [{"comparison": n, "value": v, "goal": goal_text(op, b, u), "met": met(v, op, b)}
                       for n, v, op, b, u in goal_rows]
    result["markdown"] = report(args, cmd, description, result, goal_rows)
    print("\n" + result["markdown"], flush=True)
    save(args.out, result)
    return result


if __name__ == "__main__":
    main()
