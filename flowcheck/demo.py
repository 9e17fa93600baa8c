"""`flowcheck demo`: train a small GPT on CPU while the policy snapshots it, then list, audit and export.

Every step the trainer's state is pushed into the memory tier (an in-place
copy); the policy snapshots RAM to the local zarr tier every K steps and
promotes to the object tier on a timer (seconds instead of an hour).  At the
end the exported safetensors file is compared bit for bit with the live model.
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


def run_demo(workdir: str, *, steps: int = 300, object_url: str | None = None, local_every: int = 25,
             object_seconds: float = 2.0, echo: Callable[[str], None] = print) -> tuple[Config, dict]:
    """Train, snapshot per the policy, and return (config, results) for the CLI to list/audit/export."""
    import torch

    from flowcheck.policy import PolicyRunner
    from flowcheck.store import Store
    from flowcheck.torch import snapshot_from_torch

    prepare_workdir(workdir)
    cfg = demo_config(workdir, object_url, local_every, object_seconds)
    if cfg.tiers.object.url.startswith("s3://"):
        _ensure_bucket(cfg)
    with open(os.path.join(workdir, "flowcheck.yaml"), "w", encoding="utf-8") as f:
        f.write("# written by `flowcheck demo`: the store the demo used (every command takes --config this-file)\n")
        f.write(cfg.to_yaml())
    store = Store(cfg, progress=False)
    start = max([s for t in store.tiers(include_memory=False) for s in t.steps()], default=0)

    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT * 8])
    model = _model(len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=start + steps)
    runner = PolicyRunner(store).start()
    losses, push_s, train_s = [], 0.0, 0.0
    pushed = False
    echo(f"demo: training a {sum(p.numel() for p in model.parameters()):,}-parameter GPT for {steps} steps "
         f"(run 'demo', steps {start + 1}..{start + steps}); local snapshot every {local_every} steps, "
         f"object promotion every {object_seconds:g} s")
    for step in range(start + 1, start + steps + 1):
        t0 = time.perf_counter()
        ix = torch.randint(0, len(data) - 33, (16,))
        x = torch.stack([data[i:i + 32] for i in ix])
        y = torch.stack([data[i + 1:i + 33] for i in ix])
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        t1 = time.perf_counter()
        snap = snapshot_from_torch("demo", step, model, opt, lr_scheduler=sched, extra={"loss": loss.item()})
        if not pushed:
            store.push(snap)  # first push: the memory tier allocates its buffers once
            pushed = True
        else:
            with store.memory.update(step, snap.scalars) as u:
                for shard in snap.data:
                    np.copyto(u.array(shard), snap.array(shard))
        runner.on_step(step)
        push_s += time.perf_counter() - t1
        train_s += t1 - t0
        losses.append(loss.item())
        if step % max(1, steps // 6) == 0:
            echo(f"  step {step:5d}  loss {loss.item():.4f}  local {store.local.steps()[-3:]}  "
                 f"object {store.object.steps()[-3:] if store.object else []}")
    runner.stop()
    runner.flush()
    final = {s: np.array(a, copy=True) for s, a in snapshot_from_torch("demo", start + steps, model, opt).data.items()}
    results = {
        "first_step": start + 1, "last_step": start + steps, "losses": losses, "push_seconds": push_s,
        "train_seconds": train_s, "stats": runner.stats, "final_state": final,
        "cow_copies": store.memory.cow_copies,
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
