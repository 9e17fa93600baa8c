"""Crash harness, child side: run one store operation and SIGKILL the process at its k-th I/O event.

``python -m tests.reliability.crash_child`` is a zygote: it imports flowcheck once, then reads one
JSON request per line from stdin, forks a child per request (a real process, killed for real) and
answers one JSON line with how the child ended.  Forking a warm process instead of spawning a fresh
interpreter per kill point (~1.4 s of imports) is what keeps 200+ kill points inside a CI run.

An *event* is anything whose outcome a crash can leave half done: a file created, bytes written,
fsync/syncfs, rename/replace/link, unlink/rmdir/mkdir, and an S3 PUT/POST/DELETE request.  The child
wraps the real calls (the tier code runs unchanged) and dies *before* event k; a write event is torn
first: a seeded fraction of its bytes reaches the file, then the process is killed.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import traceback

import aiobotocore.endpoint
import botocore.endpoint
import numpy as np

from flowcheck import _native
from flowcheck.config import Config, LocalConfig, ObjectConfig, PolicyConfig, TierPolicy, TiersConfig
from flowcheck.state import Scalars, Shard, Snapshot, StateLayout, TensorSpec
from flowcheck.store import Store

# imported in the zygote, before it forks, so no child pays for them
PRELOAD = ("s3fs", "boto3.s3.transfer", "flowcheck.tiers.object", "flowcheck.tiers.s3_upload", "flowcheck.restore.export")

RUN = "crash"
GRACE_S = 1e-6  # GC treats any leftover as abandoned: nothing writes concurrently in the harness
CHILD_TIMEOUT_S = 120  # a hung child dies of SIGALRM and the test reports it

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"  # 3 shards along dim 0
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"  # the big one: several 1 MiB zarr chunks / S3 parts
NORM = "decoder.final_layernorm.weight"  # bf16, 2 shards
COUNT = "optimizer.step_count"  # 0-d
EMPTY = "embedding.padding"  # zero-size
FROZEN = "embedding.word_embeddings.weight"  # the same every step: later steps reference the first one's bytes


# ---- the states the harness writes (a pure function of the step) -------------------
def layout(big_mib: float) -> StateLayout:
    return StateLayout((
        TensorSpec(FC1, "float32", (48, 32), "column"),
        TensorSpec(QKV, "float32", (int(big_mib * 256), 1024), "qkv"),
        TensorSpec(NORM, "bfloat16", (64,)),
        TensorSpec(COUNT, "int64", ()),
        TensorSpec(EMPTY, "float32", (0, 4)),
        TensorSpec(FROZEN, "float32", (64, 256), "vocab"),
    ))


def arrays(step: int, big_mib: float) -> dict[Shard, np.ndarray]:
    rng = np.random.default_rng(step)
    fc1 = rng.standard_normal((48, 32), dtype=np.float32)
    rows = int(big_mib * 256)
    norm = rng.integers(0, 1 << 16, 64, dtype=np.uint16)
    return {
        **{Shard(FC1, (r, 0), (16, 32)): fc1[r:r + 16].copy() for r in (0, 16, 32)},
        Shard(QKV, (0, 0), (rows, 1024)): rng.standard_normal((rows, 1024), dtype=np.float32),
        Shard(NORM, (0,), (32,)): norm[:32].copy(),
        Shard(NORM, (32,), (32,)): norm[32:].copy(),
        Shard(COUNT, (), ()): np.array(step, dtype=np.int64),
        Shard(EMPTY, (0, 0), (0, 4)): np.zeros((0, 4), np.float32),
        Shard(FROZEN, (0, 0), (64, 256)): np.random.default_rng(1).standard_normal((64, 256), dtype=np.float32),
    }


def state(step: int, big_mib: float) -> Snapshot:
    return Snapshot(RUN, step, layout(big_mib), arrays(step, big_mib), Scalars(optimizer_step=step))


def collided(step: int, big_mib: float) -> Snapshot:
    """A second, different state at ``step`` (a rolled-back run reaching the same step number again)."""
    return Snapshot(RUN, step, layout(big_mib), arrays(step + 10_000, big_mib), Scalars(optimizer_step=step))


def config(root: str, object_url: str, *, keep_local: int = 3, keep_object: int = 3, max_file_mib: int = 1) -> Config:
    return Config(
        run=RUN,
        node="crash-node",
        tiers=TiersConfig(
            # one writer thread: event k is the same event from one run to the next
            local=LocalConfig(root=os.path.join(root, "local"), chunk_mib=1, workers=1),
            object=ObjectConfig(url=object_url, max_file_mib=max_file_mib, upload_workers=2,
                                staging_dir=os.path.join(root, "staging")),
        ),
        policy=PolicyConfig(local=TierPolicy(keep_last=keep_local, tmp_grace_seconds=GRACE_S),
                            object=TierPolicy(keep_last=keep_object, tmp_grace_seconds=GRACE_S)),
    )


def run_op(store: Store, req: dict) -> None:
    """The operation under test, exactly as a node runs it."""
    op = req["op"]
    if op == "snapshot":
        store.write(state(req["step"], req["big_mib"]), "local")
    elif op == "collide":
        store.write(collided(req["step"], req["big_mib"]), "local")
    elif op == "promote":
        store.promote(req["step"], "local", "object")
    elif op == "gc":
        store.gc(tiers=[req["tier"]])
    elif op == "export":
        from flowcheck.restore.export import export_file

        export_file(store.local, store.local.manifest(req["step"]), req["out"])
    else:
        raise ValueError(f"unknown op {op!r}")


# ---- the fault points ------------------------------------------------------------
class Faults:
    """Counts events; dies before event ``kill_at`` (0: count only)."""

    def __init__(self, kill_at: int, torn: float) -> None:
        self.kill_at = kill_at
        self.torn = torn
        self.events: list[str] = []
        self.enabled = True
        self._lock = threading.Lock()

    def hit(self, what: str) -> bool:
        if not self.enabled:
            return False
        with self._lock:
            self.events.append(what)
            return len(self.events) == self.kill_at

    def torn_bytes(self, n: int) -> int:
        return int(n * self.torn)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _name(path) -> str:
    return os.path.basename(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else "?"


def install(faults: Faults) -> None:
    """Wrap the real calls in this (child) process; the wrapped call still runs unless it is event k."""

    def plain(mod, attr: str, label) -> None:
        real = getattr(mod, attr)

        def wrapper(*a, **kw):
            if faults.hit(label(a)):
                die()
            return real(*a, **kw)

        setattr(mod, attr, wrapper)

    real_open = os.open

    def open_(path, flags, *a, **kw):
        if flags & os.O_CREAT and faults.hit(f"create {_name(path)}"):
            die()
        return real_open(path, flags, *a, **kw)

    os.open = open_
    plain(os, "fsync", lambda a: "fsync")
    for attr in ("rename", "replace", "link"):
        plain(os, attr, lambda a, attr=attr: f"{attr} {_name(a[0])} -> {_name(a[1])}")
    for attr in ("unlink", "remove", "rmdir", "mkdir"):
        plain(os, attr, lambda a, attr=attr: f"{attr} {_name(a[0])}")
    plain(_native, "sync_filesystem", lambda a: "syncfs")

    real_pwrite = _native.pwrite_all

    def pwrite_all(fd, buffer, offset=0, flush_every=0):
        if faults.hit("write"):
            view = memoryview(buffer).cast("B")
            real_pwrite(fd, view[:faults.torn_bytes(view.nbytes)], offset)  # a torn write, then the crash
            die()
        return real_pwrite(fd, buffer, offset, flush_every)

    _native.pwrite_all = pwrite_all

    class ChunkWriter(_native.ChunkWriter):  # the packed layout's native writer: each call is a write event
        def write(self, buffer, hash=True):
            if faults.hit("write (pack)"):
                view = memoryview(buffer).cast("B")
                super().write(view[:faults.torn_bytes(view.nbytes)], hash)  # a torn write, then the crash
                die()
            return super().write(buffer, hash)

        def finish(self):
            if faults.hit("write (pack index)"):
                die()
            return super().finish()

    _native.ChunkWriter = ChunkWriter

    real_sendfile = os.sendfile

    def sendfile(out_fd, in_fd, offset, count, *a, **kw):
        if faults.hit("write (sendfile)"):
            real_sendfile(out_fd, in_fd, offset, max(0, faults.torn_bytes(count)))
            die()
        return real_sendfile(out_fd, in_fd, offset, count, *a, **kw)

    os.sendfile = sendfile
    _install_http(faults)


def _s3_label(request) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(request.url)
    query = "".join(f"?{q.split('=')[0]}" for q in parts.query.split("&") if q)
    return f"s3 {request.method} {parts.path.rsplit('/', 1)[-1]}{query}"


def _install_http(faults: Faults) -> None:
    """S3 requests that change state (PUT, POST, DELETE) are events, counted before they are sent."""
    mutating = ("PUT", "POST", "DELETE")
    real_send = botocore.endpoint.Endpoint._send
    real_async = aiobotocore.endpoint.AioEndpoint._send

    def send(self, request):
        if request.method in mutating and faults.hit(_s3_label(request)):
            die()
        return real_send(self, request)

    async def send_async(self, request):
        if request.method in mutating and faults.hit(_s3_label(request)):
            die()
        return await real_async(self, request)

    botocore.endpoint.Endpoint._send = send
    aiobotocore.endpoint.AioEndpoint._send = send_async


# ---- zygote and child ------------------------------------------------------------
def child(req: dict) -> int:
    signal.alarm(CHILD_TIMEOUT_S)
    os.environ.update(req.get("env", {}))
    faults = Faults(req["kill_at"], req.get("torn", 0.5))
    store = Store(config(**req["config"]))
    install(faults)
    result: dict = {"error": None}
    try:
        run_op(store, req)
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        result["error"] = traceback.format_exc()
        code = 1
    faults.enabled = False
    result["events"] = faults.events
    with open(req["result"], "w") as f:
        json.dump(result, f)
    return code


def warm_up() -> None:
    """Run every operation once in the zygote, so each forked child starts with caches filled
    (zarr and fsspec reset their event loops in a forked child)."""
    import tempfile

    for name in PRELOAD:
        importlib.import_module(name)
    from flowcheck.restore.export import export_file

    with tempfile.TemporaryDirectory() as d:
        store = Store(config(d, f"file://{d}/object", keep_local=1, keep_object=1))
        for step in (1, 2):
            store.write(state(step, 0.01), "local")
            store.promote(step)
        export_file(store.local, store.local.manifest(2), os.path.join(d, "out.safetensors"))
        store.gc()


def main() -> None:
    warm_up()
    while line := sys.stdin.readline():
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(req)
            finally:
                os._exit(code)  # never run the zygote's cleanup or flush its pipes in the child
        _, status = os.waitpid(pid, 0)
        answer = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                  "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
