"""`flowcheck demo`: a trainer process pushes to a node process, is killed, restored, and resumes exactly.

The node (`flowcheck serve`) holds the pushed state in RAM, snapshots it to the
local zarr tier every K steps and promotes to the object tier on a timer
(seconds instead of an hour).  The demo kills the trainer mid-run (SIGKILL);
a new trainer restores the newest committed step and finishes; its losses are
compared bit for bit with an uninterrupted run, and the exported final step
with the trainer's final state.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from flowcheck.config import Config, LocalConfig, ObjectConfig, PolicyConfig, TierPolicy, TiersConfig
from flowcheck.errors import ConfigError

TEXT = (
    "A checkpoint that looked fine and was not is the worst day of a training run. "
    "flowcheck keeps the latest state in memory, writes zarr shards to local disks, "
    "uploads safetensors with manifests to object storage, and audits the lineage of every step. "
)


def demo_config(workdir: str, object_url: str | None, local_every: int, object_seconds: float) -> Config:
    workdir = os.path.abspath(workdir)
    return Config(
        run="demo",
        tiers=TiersConfig(
            local=LocalConfig(root=os.path.join(workdir, "local")),
            object=ObjectConfig(url=object_url or "file://" + os.path.join(workdir, "object")),
        ),
        policy=PolicyConfig(
            local=TierPolicy(every_steps=local_every, keep_last=3),
            object=TierPolicy(every_seconds=object_seconds, keep_last=2, keep_hourly=24, keep_daily=7),
        ),
    )


def prepare_workdir(workdir: str) -> None:
    """A new folder, an empty one, or one a previous demo made (then its data is reused)."""
    if os.path.isdir(workdir):
        entries = set(os.listdir(workdir))
        if entries and "flowcheck.yaml" not in entries:
            raise ConfigError(
                f"demo --workdir {workdir}: expected a new or empty folder, found {len(entries)} entries; "
                "pass another folder"
            )
    os.makedirs(workdir, exist_ok=True)


def _model(vocab: int):
    import torch
    from torch import nn

    class TinyGPT(nn.Module):
        def __init__(self, vocab: int, d: int = 64, layers: int = 2, ctx: int = 32) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(ctx, d)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t))
            x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.norm(x))

    return TinyGPT(vocab)


def _batches(data, n: int):
    import torch

    ix = torch.randint(0, len(data) - 33, (n,))
    return torch.stack([data[i:i + 32] for i in ix]), torch.stack([data[i + 1:i + 33] for i in ix])


def _trainer_setup(total_steps: int):
    """Model, optimizer, scheduler and data of the demo trainer (deterministic on CPU)."""
    import torch

    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT * 8])
    model = _model(len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    return model, opt, sched, data, len(chars)


def _train_step(model, opt, sched, data, vocab: int) -> float:
    import torch

    x, y = _batches(data, 16)
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def trainer_main(argv: list[str] | None = None) -> int:
    """The demo's trainer process: train, push every step to the node, print ``step N loss L`` per step."""
    import argparse
    import json

    from flowcheck import config as config_mod
    from flowcheck.capture.auth import read_token
    from flowcheck.torch.checkpointer import Checkpointer

    p = argparse.ArgumentParser(prog="python -m flowcheck.demo")
    p.add_argument("--config", required=True)
    p.add_argument("--first", type=int, required=True, help="first step to train (ignored with --resume)")
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--resume", action="store_true", help="continue from the newest committed step")
    p.add_argument("--final", help="write the final state here (safetensors) for the demo's check")
    args = p.parse_args(argv)
    cfg = config_mod.load(args.config)
    model, opt, sched, data, vocab = _trainer_setup(args.last)
    ck = Checkpointer(model, opt, sched, node=f"tcp://{cfg.serve.push}", run=cfg.run, timeout_s=10,
                      token=read_token(cfg.serve.auth_token_env))
    first = args.first
    if args.resume:
        first = ck.load("latest", config=args.config) + 1
        print(f"resumed {first - 1}", flush=True)
    for step in range(first, args.last + 1):
        loss = _train_step(model, opt, sched, data, vocab)
        ck.save(step)
        print(f"step {step} loss {loss!r}", flush=True)
    ck.flush()
    ck.close()
    if args.final:
        from safetensors.torch import save_file

        from flowcheck.torch.state import _flatten_optimizer, param_names_of

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        state.update(_flatten_optimizer(opt.state_dict(), param_names_of(model))[0])
        save_file(state, args.final)
    print(json.dumps({"pushed": ck.stats.sent, "failures": ck.stats.failures, "blocked_s": ck.stats.blocked_s}), flush=True)
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], log_path: str | None = None):
    import subprocess
    import sys

    out = open(log_path, "ab") if log_path else subprocess.PIPE
    return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT if log_path else None,
                            text=log_path is None)


def _api(cfg: Config, path: str, method: str = "GET") -> dict:
    import json
    import urllib.request

    from flowcheck.capture.auth import read_token
    from flowcheck.node.client import control_request

    req = control_request(f"http://{cfg.serve.http}{path}", method, token=read_token(cfg.serve.auth_token_env))
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _wait_node(cfg: Config, node, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise ConfigError(f"demo: the node exited with status {node.returncode}; see its log")
        try:
            _api(cfg, "/status")
            return
        except OSError:
            time.sleep(0.2)
    raise ConfigError("demo: the node did not answer its control API within 60 s")


def _run_trainer(args: list[str], on_line: Callable[[str], bool]) -> int:
    """Run a trainer process, hand each output line to on_line; on_line returning True kills it (SIGKILL)."""
    import signal

    proc = _spawn(["-m", "flowcheck.demo", *args])
    for line in proc.stdout:
        if on_line(line.rstrip("\n")):
            proc.send_signal(signal.SIGKILL)
            break
    return proc.wait()


def run_demo(workdir: str, *, steps: int = 300, object_url: str | None = None, local_every: int = 25,
             object_seconds: float = 2.0, echo: Callable[[str], None] = print) -> tuple[Config, dict]:
    """A trainer process pushes every step to a node process (`flowcheck serve`); the trainer is killed
    mid-run, a new one restores the newest committed step and finishes; its losses must equal an
    uninterrupted run's bit for bit.  Returns (config, results) for the CLI to list/audit/export."""
    import dataclasses
    import signal

    from flowcheck.config import ServeConfig
    from flowcheck.store import Store

    prepare_workdir(workdir)
    cfg = demo_config(workdir, object_url, local_every, object_seconds)
    cfg = dataclasses.replace(cfg, serve=ServeConfig(push=f"127.0.0.1:{_free_port()}", http=f"127.0.0.1:{_free_port()}"))
    if cfg.tiers.object.url.startswith("s3://"):
        _ensure_bucket(cfg)
    cfg_path = os.path.join(os.path.abspath(workdir), "flowcheck.yaml")
    with open(cfg_path, "w", encoding="utf-8") as f:
        f.write("# written by `flowcheck demo`: the store the demo used (every command takes --config this-file)\n")
        f.write(cfg.to_yaml())
    store = Store(cfg, progress=False)
    hist = store.history()
    start = max(hist.path(hist.current()), default=0)  # a re-run continues the current branch
    first, last = start + 1, start + steps
    kill_at = first + max(1, (steps * 3) // 5)

    t0 = time.perf_counter()
    model, opt, sched, data, vocab = _trainer_setup(last)
    reference = {s: _train_step(model, opt, sched, data, vocab) for s in range(first, last + 1)}
    train_s = time.perf_counter() - t0
    echo(f"demo: a {sum(p.numel() for p in model.parameters()):,}-parameter GPT, steps {first}..{last}; "
         f"uninterrupted reference run: {train_s:.1f} s")

    node = _spawn(["-m", "flowcheck", "serve", "--config", cfg_path], os.path.join(workdir, "node.log"))
    try:
        _wait_node(cfg, node)
        echo(f"node: `flowcheck serve` (pid {node.pid}) takes pushes on tcp://{cfg.serve.push}, control API "
             f"http://{cfg.serve.http}; local snapshot every {local_every} steps, object promotion every {object_seconds:g} s")
        losses: dict[int, float] = {}

        def seen(line: str) -> bool:
            if line.startswith("step "):
                _, step, _, loss = line.split()
                losses[int(step)] = float(loss)
                return int(step) >= kill_at
            return False

        t1 = time.perf_counter()
        _run_trainer(["--config", cfg_path, "--first", str(first), "--last", str(last)], seen)
        echo(f"trainer 1: trained steps {first}..{max(losses)} pushing every step, then killed (SIGKILL)")
        time.sleep(0.5)
        status = _api(cfg, "/status")
        echo(f"node: RAM at step {status['memory']['step']}, newest local snapshot {status['tiers'].get('local')}")
        final = os.path.join(workdir, "trainer-final.safetensors")
        resumed_from: list[int] = []

        def seen2(line: str) -> bool:
            if line.startswith("resumed "):
                resumed_from.append(int(line.split()[1]))
            return seen(line)

        kill_at = last + 1
        _run_trainer(["--config", cfg_path, "--first", str(first), "--last", str(last), "--resume", "--final", final], seen2)
        push_s = time.perf_counter() - t1
        resumed = resumed_from[0] if resumed_from else None
        identical = resumed is not None and all(losses[s] == reference[s] for s in range(resumed + 1, last + 1))
        echo(f"trainer 2: restored step {resumed} from the store, trained {resumed + 1 if resumed is not None else '?'}..{last}; "
             f"losses identical to the uninterrupted run bit for bit: {identical}")
        deadline = time.monotonic() + 30
        while _api(cfg, "/status")["memory"]["step"] != last and time.monotonic() < deadline:
            time.sleep(0.1)
        _api(cfg, "/snapshot", "POST")
        time.sleep(object_seconds + 0.5)  # let the timer promote the newest local step
        status = _api(cfg, "/status")
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(60)
    from safetensors.numpy import load_file

    from flowcheck.state import Shard, TensorSpec

    final_arrays = load_file(final) if os.path.exists(final) else {}
    final_state = {Shard.whole(TensorSpec(n, "float32" if a.dtype.kind == "f" else "int64", a.shape)): a
                   for n, a in final_arrays.items()}
    results = {
        "first_step": first, "last_step": last, "losses": [losses[s] for s in sorted(losses)],
        "reference": [reference[s] for s in sorted(reference)], "resumed_from": resumed, "identical": identical,
        "train_seconds": train_s, "push_seconds": push_s, "status": status, "final_state": final_state,
    }
    return cfg, results


def _ensure_bucket(cfg: Config) -> None:
    """The demo creates its bucket when missing (a real deployment's bucket is made by its owner)."""
    from flowcheck.errors import TierError
    from flowcheck.tiers.object import aws_endpoint_region, filesystem
    from flowcheck.tiers.s3_upload import s3_client

    fs, root = filesystem(cfg.tiers.object)
    bucket = root.split("/", 1)[0]
    endpoint, region = aws_endpoint_region(cfg.tiers.object)
    try:
        client = s3_client(endpoint, region, cfg.tiers.object.storage_options)
    except ImportError:  # s3fs without boto3
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        return
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - missing bucket, or an endpoint problem the create reports
        try:
            extra = {} if region in (None, "us-east-1") else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            client.create_bucket(Bucket=bucket, **extra)
        except Exception as e:  # noqa: BLE001 - botocore's own error tree
            raise TierError(f"demo: cannot create bucket {bucket!r} at {endpoint or 'AWS'}: {e}") from e


def loss_summary(losses: list[float]) -> str:
    n = max(1, len(losses) // 10)
    first, last = np.mean(losses[:n]), np.mean(losses[-n:])
    return f"loss {first:.3f} -> {last:.3f} (mean of the first/last {n} steps)"


if __name__ == "__main__":
    raise SystemExit(trainer_main())
