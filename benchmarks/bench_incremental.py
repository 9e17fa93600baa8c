"""Issue 20: incremental steps vs full steps, side by side in one run (ratios), every alternative written per step
in a rotated order so that what drifts during the run (page cache, other load) falls on all of them.

  (a) ``lora``: a frozen state (``--mib`` of fp32 tensors, 8 tensors) plus adapters of ``--trainable`` of its size
      and a step counter that change every step; ``--steps`` local snapshots, each with the previous as parent
      (incremental: unchanged shards are references) vs without a parent (every step written in full) vs DCP's
      full save of the same state (``torch.distributed.checkpoint.save``, FileSystemWriter, one process, fsync'd).
  (b) ``lora_promotion``: each step of (a) promoted to a ``file://`` object tier (``--s3``: also a moto S3 server)
      in order: incremental (the parent's object copy holds the frozen shards) vs full (no parent: all uploaded).
  (c) ``full_training``: every tensor changes every step: with a parent (the dedup check probes the large shards'
      first rows, hashes the rest, finds nothing to reuse, and the writer then skips hashing what it hashed) vs
      without.  The dedup check's cost = median of the per-step ratios (with / without) - 1; goal <= 3%.  Also the
      check alone, timed per step, with the probe digests the tier kept vs reading the parent's first rows.
  (d) ``row_blocks``: an fp32 embedding table (``--emb-mib``, 4 KiB rows) of which ``--rows-changed`` of the rows
      (uniformly at random: the worst case for blocks) change per step, and the same table with every row
      changing: incremental steps with ``tiers.local.row_block_bytes`` = each of ``--row-block-kib`` vs without
      row blocks (one shard per tensor).

Every write is durable (fsync) into fresh folders under ``--dir``; old steps are deleted as the run goes (disk).
Ratios: full / incremental (bytes, seconds), > 1 means incremental is smaller / faster.

  python benchmarks/bench_incremental.py --mib 256 --trainable 0.01 --steps 6
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from flowcheck.config import LocalConfig, ObjectConfig
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.tiers.local import LocalTier

ROW_COLS = 1024  # the embedding benchmark's row: 4 KiB of fp32


def state(step: int, mib: float, trainable: float, all_change: bool) -> Snapshot:
    rows = max(1, int(mib * 2**20 / 4 / 8 / 4096))
    rank = max(1, int(rows * trainable))
    specs, data = [], {}
    for i in range(8):
        name = f"decoder.layers.{i}.mlp.linear_fc1.weight"
        specs.append(TensorSpec(name, "float32", (rows, 4096), "column"))
        seed = step if all_change else 0
        data[Shard(name, (0, 0), (rows, 4096))] = np.random.default_rng(seed * 100 + i).standard_normal(
            (rows, 4096), dtype=np.float32)
        a = f"decoder.layers.{i}.lora_a.weight"
        specs.append(TensorSpec(a, "float32", (rank, 4096)))
        data[Shard(a, (0, 0), (rank, 4096))] = np.random.default_rng(step * 100 + i).standard_normal(
            (rank, 4096), dtype=np.float32)
    specs.append(TensorSpec("optimizer.step_count", "int64", ()))
    data[Shard("optimizer.step_count", (), ())] = np.array(step, np.int64)
    return Snapshot("bench", step, StateLayout(tuple(specs)), data, Scalars(optimizer_step=step))


class Chain:
    """One alternative: a local tier written step after step (with the previous step as parent, or without)."""

    def __init__(self, root: str, chained: bool, row_block_bytes: int = 0) -> None:
        self.tier = LocalTier(LocalConfig(root=root, row_block_bytes=row_block_bytes), "bench")
        self.chained, self.parent, self.times, self.sizes, self.manifest_bytes = chained, None, [], [], []

    def write(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        m = self.tier.write(snap, self.parent if self.chained else None)
        self.times.append(time.perf_counter() - t0)
        self.sizes.append(m.nbytes)
        self.manifest_bytes.append(len(m.to_bytes()))
        self.parent = m.parent_ref()
        if not self.chained and snap.step > 2:
            self.tier.delete(snap.step - 2)  # full steps reference nothing: keep the disk small


def rotated(step: int, work: dict[str, Callable[[], None]]) -> None:
    """Run every alternative once, the first one moving by one each step."""
    names = list(work)
    k = step % len(names)
    for name in names[k:] + names[:k]:
        work[name]()


def summary(times: list[float], sizes: list[int], skip: int = 1) -> dict:
    """Per-step means over the steps after ``skip`` (step 1 is a full write either way), and the median."""
    t, s = times[skip:], sizes[skip:]
    return {"bytes_per_step": sum(s) / len(s), "seconds_per_step": sum(t) / len(t),
            "seconds_median": statistics.median(t), "steps_measured": len(t)}


def paired(a: list[float], b: list[float], skip: int = 1) -> float:
    """Median of the per-step ratios a/b (what drifted during the run cancels)."""
    return statistics.median(x / y for x, y in zip(a[skip:], b[skip:]))


# ---- (a) + (b): LoRA, local snapshots, DCP, promotions ---------------------------------------------
def dcp_save(snap: Snapshot, folder: str) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    sd = {s.tensor: torch.from_numpy(np.asarray(snap.array(s))) for s in snap.data}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=True)
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _d, fs in os.walk(folder) for f in fs)


def lora(args, base: str, object_urls: list[tuple[str, str]]) -> dict:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from flowcheck.tiers.object import ObjectTier

    inc, full = Chain(f"{base}/inc", True), Chain(f"{base}/full", False)
    dcp_t, dcp_b = [], []
    promo: dict[str, dict[str, list]] = {}
    objects = {}
    for label, url in object_urls:
        for kind in ("incremental", "full"):
            cfg = ObjectConfig(url=f"{url}/{kind}")
            objects[(label, kind)] = ObjectTier(cfg, "bench", staging_dir=f"{base}/staging-{label}-{kind}")
            promo.setdefault(label, {}).update({f"{kind}_s": [], f"{kind}_b": []})

    def dcp_step(snap: Snapshot) -> None:
        folder = f"{base}/dcp-{snap.step}"
        t0 = time.perf_counter()
        dcp_b.append(dcp_save(snap, folder))
        dcp_t.append(time.perf_counter() - t0)
        shutil.rmtree(folder)

    def promote(label: str, kind: str, chain: Chain, step: int) -> None:
        src = chain.tier.load(step)
        t0 = time.perf_counter()
        m = objects[(label, kind)].write(src, src.origin.parent)
        promo[label][f"{kind}_s"].append(time.perf_counter() - t0)
        promo[label][f"{kind}_b"].append(m.nbytes)
        if kind == "full" and step > 2:
            objects[(label, kind)].delete(step - 2)

    for step in range(1, args.steps + 1):
        snap = state(step, args.mib, args.trainable, False)
        rotated(step, {"inc": lambda: inc.write(snap), "full": lambda: full.write(snap), "dcp": lambda: dcp_step(snap)})
        rotated(step, {f"{label}-{kind}": (lambda label=label, kind=kind:
                                           promote(label, kind, inc if kind == "incremental" else full, step))
                       for label, _u in object_urls for kind in ("incremental", "full")})
    res = {"incremental": summary(inc.times, inc.sizes), "full": summary(full.times, full.sizes),
           "dcp_full_save": summary(dcp_t, dcp_b), "data_bytes": state(1, args.mib, args.trainable, False).nbytes}
    for label in ("incremental", "full"):
        res[label]["data_bytes"] = res["data_bytes"]  # where earlier versions of this script put it
    res["bytes_ratio"] = res["full"]["bytes_per_step"] / res["incremental"]["bytes_per_step"]
    res["seconds_ratio"] = res["full"]["seconds_per_step"] / res["incremental"]["seconds_per_step"]
    res["seconds_ratio_paired"] = paired(full.times, inc.times)
    res["dcp_bytes_ratio"] = res["dcp_full_save"]["bytes_per_step"] / res["incremental"]["bytes_per_step"]
    res["dcp_seconds_ratio_paired"] = paired(dcp_t, inc.times)
    promotion = {}
    for label, p in promo.items():
        r = {"incremental": summary(p["incremental_s"], p["incremental_b"]), "full": summary(p["full_s"], p["full_b"])}
        r["bytes_ratio"] = r["full"]["bytes_per_step"] / r["incremental"]["bytes_per_step"]
        r["seconds_ratio_paired"] = paired(p["full_s"], p["incremental_s"])
        promotion[label] = r
    return {"lora": res, "lora_promotion": promotion}


# ---- (c): full training, the dedup check's cost ------------------------------------------------
def full_training(args, base: str) -> dict:
    with_, without = Chain(f"{base}/with", True), Chain(f"{base}/without", False)
    check: list[float] = []
    check_read: list[float] = []
    for step in range(1, args.dedup_steps + 1):
        snap = state(step, args.mib, args.trainable, True)
        if with_.parent is not None:
            # the check alone, as the write runs it (parent manifest, candidates, probes, a hash of the shards the
            # probes do not settle): an upper bound of its cost, since the write then skips hashing those shards.
            # Side by side, in rotated order: with the probe digests the tier kept when it wrote the parent (what
            # a node's tier does), and reading the parent's first rows from its packs (a tier that did not write
            # the parent: a restarted node; and every check before the digests were kept)
            def kept() -> None:
                t0 = time.perf_counter()
                with_.tier._reusable(snap, with_.parent)
                check.append(time.perf_counter() - t0)

            def read() -> None:
                probes = dict(with_.tier._probes)
                with_.tier._probes.clear()
                try:
                    t0 = time.perf_counter()
                    with_.tier._reusable(snap, with_.parent)
                    check_read.append(time.perf_counter() - t0)
                finally:
                    with_.tier._probes.update(probes)

            rotated(step, {"kept": kept, "read": read})
        rotated(step, {"with": lambda: with_.write(snap), "without": lambda: without.write(snap)})
        if step > 2:
            with_.tier.delete(step - 2)  # nothing references it (every shard changed)
    res = {"incremental": summary(with_.times, with_.sizes), "full": summary(without.times, without.sizes),
           "data_bytes": state(1, args.mib, args.trainable, True).nbytes}
    for label in ("incremental", "full"):
        res[label]["data_bytes"] = res["data_bytes"]  # where earlier versions of this script put it
    res["bytes_ratio"] = res["full"]["bytes_per_step"] / res["incremental"]["bytes_per_step"]
    res["seconds_ratio"] = res["full"]["seconds_per_step"] / res["incremental"]["seconds_per_step"]
    res["dedup_cost_paired"] = paired(with_.times, without.times) - 1
    res["dedup_cost_medians"] = res["incremental"]["seconds_median"] / res["full"]["seconds_median"] - 1
    res["dedup_check_seconds_median"] = statistics.median(check)
    res["dedup_check_share"] = statistics.median(check) / res["full"]["seconds_median"]
    res["dedup_check_read_seconds_median"] = statistics.median(check_read)
    res["dedup_check_read_share"] = statistics.median(check_read) / res["full"]["seconds_median"]
    # per step: the check's share of that step's snapshot without it (the snapshot's drift falls on both)
    res["dedup_check_share_paired"] = paired(check, without.times[1:], skip=0)
    res["dedup_check_read_share_paired"] = paired(check_read, without.times[1:], skip=0)
    res["dedup_check_shares"] = [c / w for c, w in zip(check, without.times[1:])]
    return res


# ---- (d): row blocks for an embedding ----------------------------------------------------------
def embeddings(mib: float, steps: int, frac: float):
    rows = max(1, int(mib * 2**20 / 4 / ROW_COLS))
    rng = np.random.default_rng(3)
    table = rng.standard_normal((rows, ROW_COLS), dtype=np.float32)
    spec = TensorSpec("embedding.word_embeddings.weight", "float32", (rows, ROW_COLS), "vocab")
    layout = StateLayout((spec,))
    for step in range(1, steps + 1):
        if step > 1:
            if frac >= 1:
                table += np.float32(1e-3)
            else:
                table[rng.choice(rows, max(1, int(rows * frac)), replace=False)] += np.float32(1e-3)
        yield Snapshot("bench", step, layout, {Shard(spec.name, (0, 0), (rows, ROW_COLS)): table.copy()})


def row_blocks(args, base: str) -> dict:
    """Per block size (KiB): per fraction of rows changed per step (and 1.0: every row), blocks vs whole."""
    out: dict = {"rows_changed_fraction": args.rows_changed, "emb_mib": args.emb_mib}
    for kib in (float(k) for k in str(args.row_block_kib).split(",")):
        block = int(kib * 1024)
        by_case: dict = {"row_block_bytes": block}
        for frac in [float(f) for f in str(args.rows_changed).split(",")] + [1.0]:
            case = "all_rows_change" if frac >= 1 else f"rows_changed_{frac:g}"
            blocked, whole = Chain(f"{base}/{case}-blocks", True, block), Chain(f"{base}/{case}-whole", True)
            for snap in embeddings(args.emb_mib, args.steps, frac):
                rotated(snap.step, {"blocks": lambda: blocked.write(snap), "whole": lambda: whole.write(snap)})
            r = {"blocks": summary(blocked.times, blocked.sizes), "whole": summary(whole.times, whole.sizes)}
            r["blocks"]["manifest_bytes"] = blocked.manifest_bytes[-1]
            r["whole"]["manifest_bytes"] = whole.manifest_bytes[-1]
            r["blocks"]["shards"] = len(blocked.tier.manifest(args.steps).tensors["embedding.word_embeddings.weight"].shards)
            r["bytes_ratio"] = r["whole"]["bytes_per_step"] / r["blocks"]["bytes_per_step"]
            r["seconds_ratio_paired"] = paired(whole.times, blocked.times)
            by_case[case] = r
            shutil.rmtree(f"{base}/{case}-blocks")
            shutil.rmtree(f"{base}/{case}-whole")
        out[f"{kib:g}KiB"] = by_case
    return out


def mib(b: float) -> str:
    return f"{b / 2**20:8.2f} MiB"


def report(out: dict) -> None:
    if "lora" in out:
        report_lora(out)
    if "full_training" in out:
        f = out["full_training"]
        print(f"full_training  s/step: with dedup check {f['incremental']['seconds_median']:.3f}, without "
              f"{f['full']['seconds_median']:.3f} (medians); dedup cost {100 * f['dedup_cost_paired']:+.1f}% paired, "
              f"{100 * f['dedup_cost_medians']:+.1f}% of medians; the check alone {f['dedup_check_seconds_median']:.4f} s = "
              f"{100 * f['dedup_check_share']:.1f}% of a snapshot without it (per-step median "
              f"{100 * f['dedup_check_share_paired']:.1f}%, max {100 * max(f['dedup_check_shares']):.1f}%); reading "
              f"the parent's packs instead of kept probe digests {f['dedup_check_read_seconds_median']:.4f} s = "
              f"{100 * f['dedup_check_read_share']:.1f}% (per-step {100 * f['dedup_check_read_share_paired']:.1f}%)")
    for kib, by_case in out.get("row_blocks", {}).items():
        if not isinstance(by_case, dict):
            continue
        for case, b in by_case.items():
            if not isinstance(b, dict):
                continue
            print(f"row blocks {kib:>8s} {case:20s} bytes/step: blocks {mib(b['blocks']['bytes_per_step'])}, whole "
                  f"{mib(b['whole']['bytes_per_step'])} ({b['bytes_ratio']:.2f}x); s/step: blocks "
                  f"{b['blocks']['seconds_per_step']:.3f}, whole {b['whole']['seconds_per_step']:.3f} (paired "
                  f"{b['seconds_ratio_paired']:.2f}x); {b['blocks']['shards']} blocks; manifest "
                  f"{b['blocks']['manifest_bytes']} vs {b['whole']['manifest_bytes']} B")


def report_lora(out: dict) -> None:
    r = out["lora"]
    print(f"lora           bytes/step: incremental {mib(r['incremental']['bytes_per_step'])}, full "
          f"{mib(r['full']['bytes_per_step'])} ({r['bytes_ratio']:.1f}x), dcp {mib(r['dcp_full_save']['bytes_per_step'])} "
          f"({r['dcp_bytes_ratio']:.1f}x); s/step: incremental {r['incremental']['seconds_per_step']:.3f}, full "
          f"{r['full']['seconds_per_step']:.3f} (paired {r['seconds_ratio_paired']:.2f}x), dcp "
          f"{r['dcp_full_save']['seconds_per_step']:.3f} (paired {r['dcp_seconds_ratio_paired']:.2f}x)")
    for label, p in out["lora_promotion"].items():
        print(f"promotion {label:5s} bytes/step: incremental {mib(p['incremental']['bytes_per_step'])}, full "
              f"{mib(p['full']['bytes_per_step'])} ({p['bytes_ratio']:.1f}x); s/step: incremental "
              f"{p['incremental']['seconds_per_step']:.3f}, full {p['full']['seconds_per_step']:.3f} "
              f"(paired {p['seconds_ratio_paired']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--trainable", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dedup-steps", type=int, default=12, help="steps of the full-training case (per-step pairs)")
    ap.add_argument("--row-block-kib", default="64", help="row block sizes in KiB, comma-separated (e.g. 64,1024)")
    ap.add_argument("--rows-changed", default="0.01",
                    help="fractions of embedding rows changed per step, comma-separated (1.0, every row, always runs)")
    ap.add_argument("--emb-mib", type=float, default=128, help="size of the row-block benchmark's embedding table")
    ap.add_argument("--s3", action="store_true", help="also promote to a moto S3 server (held in its RAM)")
    ap.add_argument("--only", default="lora,full_training,row_blocks")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    only = set(args.only.split(","))
    base = tempfile.mkdtemp(dir=args.dir, prefix="fc-inc-")
    out: dict = {}
    moto = None
    try:
        if "lora" in only:
            urls = [("file", f"file://{base}/object")]
            if args.s3:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                from _common import MotoServer

                moto = MotoServer()
                moto.client().create_bucket(Bucket="bench")
                urls.append(("s3", "s3://bench/p"))
            out.update(lora(args, f"{base}/lora", urls))
        if "full_training" in only:
            out["full_training"] = full_training(args, f"{base}/full")
        if "row_blocks" in only:
            out["row_blocks"] = row_blocks(args, f"{base}/rows")
    finally:
        if moto is not None:
            moto.close()
        shutil.rmtree(base, ignore_errors=True)
    if args.json:  # first: a reader that stops after the summary (`| head`) must not lose the file
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    report(out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
