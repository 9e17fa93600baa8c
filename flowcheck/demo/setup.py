"""What a demo run is given (DemoOptions) and the store config it writes: a given --config, the demo's defaults.

Precedence, field by field: an option given on the command line (``--local-every``,
``--object-seconds``, ``--object-url``), then the ``--config`` file, then the
demo's defaults (run ``demo``, tiers in the workdir, a policy in seconds instead
of hours).  Relative folders in the ``--config`` file are taken from the workdir, not from the file's folder: the
demo's store is always under ``--workdir`` (``configs/hourly.yaml`` names ``./flowcheck-data``, which would be
inside the checkout).  The merged config is written to ``WORKDIR/flowcheck.yaml`` with
absolute paths; the node, the trainers and every command the demo prints use it.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Any

from flowcheck.config import Config, from_dict, read_yaml
from flowcheck.errors import ConfigError

CONFIG_NAME = "flowcheck.yaml"
DEFAULT_LOCAL_EVERY = 25
DEFAULT_OBJECT_SECONDS = 2.0


@dataclass(frozen=True)
class DemoOptions:
    """One demo run.  ``None`` for a policy option: the config's value, else the demo's default."""

    workdir: str
    steps: int = 300
    config: str | None = None  # a store/policy YAML whose run, tiers and policy the demo honours
    local_every: int | None = None  # local snapshot every N steps (default 25)
    object_seconds: float | None = None  # object promotion period (default 2 s: the hourly policy, compressed)
    object_url: str | None = None  # default file://WORKDIR/object

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"demo: steps: expected an integer >= 1, found {self.steps!r}")
        if self.local_every is not None and (not isinstance(self.local_every, int) or self.local_every < 1):
            raise ConfigError(f"demo: local_every: expected an integer >= 1, found {self.local_every!r}")
        if self.object_seconds is not None and not self.object_seconds > 0:
            raise ConfigError(f"demo: object_seconds: expected a positive number, found {self.object_seconds!r}")

    @property
    def root(self) -> str:
        return os.path.abspath(self.workdir)

    @property
    def config_path(self) -> str:
        """The config the demo writes (and every printed command names)."""
        return os.path.join(self.root, CONFIG_NAME)


def prepare_workdir(workdir: str) -> None:
    """A new folder, an empty one, or one a previous demo made (then its data is reused)."""
    if os.path.isdir(workdir):
        entries = set(os.listdir(workdir))
        if entries and CONFIG_NAME not in entries:
            raise ConfigError(
                f"demo --workdir {workdir}: expected a new or empty folder, found {len(entries)} entries; "
                "pass another folder"
            )
    os.makedirs(workdir, exist_ok=True)


def _defaults(root: str) -> dict[str, Any]:
    return {
        "run": "demo",
        "tiers": {"local": {"root": os.path.join(root, "local")},
                  "object": {"url": "file://" + os.path.join(root, "object")}},
        "policy": {"local": {"every_steps": DEFAULT_LOCAL_EVERY, "keep_last": 3},
                   "object": {"every_seconds": DEFAULT_OBJECT_SECONDS, "keep_last": 2, "keep_hourly": 24,
                              "keep_daily": 7}},
    }


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s values wherever ``over`` has the key (nested mappings merged key by key)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def demo_config(opts: DemoOptions) -> Config:
    """The store config of a demo run (see the module docstring for which value wins)."""
    raw: dict[str, Any] = {}
    if opts.config:
        loaded = read_yaml(opts.config, ConfigError, "demo --config")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"demo --config {opts.config}: expected a mapping, found {type(loaded).__name__}")
        raw = loaded or {}
    merged = _merge(_defaults(opts.root), raw)
    given = {"policy": {"local": {"every_steps": opts.local_every}, "object": {"every_seconds": opts.object_seconds}},
             "tiers": {"object": {"url": opts.object_url}}}
    merged = _merge(merged, _drop_none(given))
    where = opts.config or "demo"
    base = opts.root  # the demo's store lives under --workdir: a config's relative folders are taken from there
    cfg = from_dict(merged, where, base=base)
    serve = raw.get("serve") or {}
    push = serve.get("push") or f"127.0.0.1:{free_port()}"
    http = serve.get("http") or f"127.0.0.1:{free_port()}"
    return dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, push=push, http=http))


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        v = _drop_none(v) if isinstance(v, dict) else v
        if v is not None and v != {}:
            out[k] = v
    return out


def write_config(cfg: Config, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("# written by `flowcheck demo`: the store the demo used (every command takes --config this-file)\n")
        f.write(cfg.to_yaml())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_bucket(cfg: Config) -> None:
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
        except Exception as e:
            raise TierError(f"demo: cannot create bucket {bucket!r} at {endpoint or 'AWS'}: {e}") from e

