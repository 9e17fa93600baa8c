"""Configuration: one frozen dataclass per component, mapped one to one onto YAML.

The embedded defaults *are* the default policy (``configs/hourly.yaml`` spells
them out; a test keeps the two equal).  Every field is checked on
construction and errors name the file and the field.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from flowcheck.errors import ConfigError
from flowcheck.state import check_name

CODECS = ("none", "lz4", "zstd")


def _positive(owner: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{owner}.{name}: expected a positive number{' or null' if allow_none else ''}, found {value!r}")


# a TierPolicy does not know its tier: its errors name this section, which a config file's loader replaces with the
# section it read (policy.local, policy.object)
TIER_POLICY = "policy.<tier>"


@dataclass(frozen=True)
class TierPolicy:
    """When a tier takes a snapshot and which of its steps it keeps."""

    every_steps: int | None = None  # snapshot when step % every_steps == 0
    every_seconds: float | None = None  # and/or on a timer (APScheduler IntervalTrigger)
    keep_last: int = 3  # newest N committed steps always kept
    keep_hourly: int = 0  # plus the newest step of each of the last N hours that have one
    keep_daily: int = 0  # plus the newest step of each of the last N days that have one
    tmp_grace_seconds: float = 3600.0  # abandoned .tmp dirs / multipart uploads older than this are cleaned
    # states of a branch that is no longer current (a rollback left it) are kept this long after its last commit
    keep_abandoned_hours: float = 24.0

    def __post_init__(self) -> None:
        _positive(TIER_POLICY, "every_steps", self.every_steps, allow_none=True)
        _positive(TIER_POLICY, "every_seconds", self.every_seconds, allow_none=True)
        for name in ("keep_last", "keep_hourly", "keep_daily"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{TIER_POLICY}.{name}: expected an integer >= 0, found {v!r}")
        if self.keep_last < 1:
            raise ConfigError(f"{TIER_POLICY}.keep_last: expected >= 1 (the newest committed step is never deleted), "
                              f"found {self.keep_last}")
        _positive(TIER_POLICY, "tmp_grace_seconds", self.tmp_grace_seconds)
        v = self.keep_abandoned_hours
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{TIER_POLICY}.keep_abandoned_hours: expected a number of hours >= 0, found {v!r}")


@dataclass(frozen=True)
class PolicyConfig:
    local: TierPolicy = TierPolicy(every_steps=100, keep_last=3)
    object: TierPolicy = TierPolicy(every_seconds=3600.0, keep_last=1, keep_hourly=24, keep_daily=7)


@dataclass(frozen=True)
class MemoryConfig:
    enabled: bool = True
    copy_threads: int = 4  # threads for copy-on-write of a pinned shard
    # copy-on-write while a snapshot is in flight may hold at most this fraction of the state extra
    # (null: no limit); past it, an update waits until the snapshot has written the shard it needs
    cow_budget: float | None = 0.1
    cow_wait_s: float = 300.0  # longest such wait; then the shard is copied anyway (and it is logged)

    def __post_init__(self) -> None:
        _positive("tiers.memory", "copy_threads", self.copy_threads)
        if self.cow_budget is not None and (isinstance(self.cow_budget, bool) or not isinstance(self.cow_budget, (int, float))
                                            or self.cow_budget < 0):
            raise ConfigError(f"tiers.memory.cow_budget: expected a fraction of the state >= 0 (0.15 = 15%) or null, "
                              f"found {self.cow_budget!r}")
        _positive("tiers.memory", "cow_wait_s", self.cow_wait_s)


@dataclass(frozen=True)
class LocalConfig:
    """The NVMe tier: a zarr v3 group per step."""

    root: str = "./flowcheck-data/local"
    codec: str = "none"  # none | lz4 (blosc lz4 + bitshuffle) | zstd
    chunk_mib: int = 16  # inner chunk size of per-shard arrays (compressed codecs; packs use 64 KiB): the CRC32C unit
    workers: int = 4  # packs (shards, with a compressed codec) written in parallel
    fsync: bool = True  # make a step durable before its manifest commits it
    # fsync: the step's own files and folders, in parallel | syncfs: one flush of the whole filesystem
    sync_mode: str = "fsync"
    # > 0: uncompressed 2-D+ shards larger than this are stored as blocks of whole rows of about this many bytes,
    # so an incremental step rewrites only the blocks that changed (embeddings); 0: shards stay whole
    row_block_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.row_block_bytes, bool) or not isinstance(self.row_block_bytes, int) or self.row_block_bytes < 0:
            raise ConfigError(f"tiers.local.row_block_bytes: expected an integer >= 0 (0: off), "
                              f"found {self.row_block_bytes!r}")
        if self.sync_mode not in ("syncfs", "fsync"):
            raise ConfigError(f"tiers.local.sync_mode: expected 'syncfs' or 'fsync', found {self.sync_mode!r}")
        if self.codec not in CODECS:
            raise ConfigError(f"tiers.local.codec: expected one of {CODECS}, found {self.codec!r}")
        _positive("tiers.local", "chunk_mib", self.chunk_mib)
        _positive("tiers.local", "workers", self.workers)


@dataclass(frozen=True)
class ObjectConfig:
    """The object tier: safetensors files + manifest.json under any fsspec URL."""

    url: str = "file://./flowcheck-data/object"
    max_file_mib: int = 2048  # safetensors files are cut at about this size
    upload_workers: int = 8  # concurrent multipart parts of one write (its files share them)
    part_mib: int = 64
    # where safetensors are staged before upload (default: <local root>/.staging); S3 through boto3 stages nothing:
    # parts are sent from the step's arrays as they are read (at most upload_workers + 1 parts of part_mib held)
    staging_dir: str | None = None
    endpoint_url: str | None = None  # overrides AWS_ENDPOINT_URL
    region: str | None = None  # overrides AWS_REGION / AWS_DEFAULT_REGION
    storage_options: dict[str, Any] = field(default_factory=dict)  # passed to fsspec (never put secrets here)
    enabled: bool = True
    # transient failures (5xx, SlowDown, resets, timeouts, truncated bodies): each HTTP request is
    # retried by botocore (standard mode: exponential backoff with jitter) up to request_attempts
    # times; a whole operation (a file upload, the manifest commit, a verified read) is retried by
    # flowcheck up to `retries` more times, backing off, and no new attempt starts past retry_deadline_s
    retries: int = 4
    retry_deadline_s: float = 600.0
    request_attempts: int = 3
    connect_timeout_s: float = 5.0  # a refused or unreachable endpoint fails fast (it is not retried) ...
    # ... unless this tier reached it before (a gateway restarting, a load balancer failing over): then its
    # refused connections are retried, backing off, for up to reconnect_s (and never past retry_deadline_s);
    # 0: never retried
    reconnect_s: float = 60.0
    read_timeout_s: float = 60.0  # a request whose answer stalls this long fails (and is retried)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ConfigError(f"tiers.object.url: expected an fsspec URL like s3://bucket/prefix or file:///dir, found {self.url!r}")
        _positive("tiers.object", "max_file_mib", self.max_file_mib)
        _positive("tiers.object", "upload_workers", self.upload_workers)
        _positive("tiers.object", "part_mib", self.part_mib)
        if self.part_mib < 5:
            raise ConfigError("tiers.object.part_mib: S3 multipart parts must be >= 5 MiB")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"tiers.object.retries: expected an integer >= 0 (0: no retry), found {self.retries!r}")
        if isinstance(self.request_attempts, bool) or not isinstance(self.request_attempts, int) or self.request_attempts < 1:
            raise ConfigError(f"tiers.object.request_attempts: expected an integer >= 1, found {self.request_attempts!r}")
        for name in ("retry_deadline_s", "connect_timeout_s", "read_timeout_s"):
            _positive("tiers.object", name, getattr(self, name))
        if isinstance(self.reconnect_s, bool) or not isinstance(self.reconnect_s, (int, float)) or self.reconnect_s < 0:
            raise ConfigError(f"tiers.object.reconnect_s: expected seconds >= 0 (0: a refused connection is not "
                              f"retried), found {self.reconnect_s!r}")


@dataclass(frozen=True)
class TiersConfig:
    memory: MemoryConfig = MemoryConfig()
    local: LocalConfig = LocalConfig()
    object: ObjectConfig = ObjectConfig()


@dataclass(frozen=True)
class MirrorPartitionConfig:
    """A scaled-out mirror capture: this node decodes, updates and stores part ``index`` of ``of`` (by parameters,
    flowcheck/capture/mirror/partition.py); every node gets all the mirrored traffic and the cluster commit
    (``cluster:``) makes one step of the parts.  ``of: 1`` (the default) is one node holding everything."""

    index: int = 0  # this node's part, 0-based
    of: int = 1  # how many nodes share the job's state
    # jobs that clip gradients: a directory every node of the partition can write and read (a shared mount),
    # where each node leaves its parameters' gradient norms per step; relative: to the config file's folder
    exchange: str | None = None
    exchange_wait_s: float = 60.0  # a step whose other parts' norms do not arrive in this time goes stale

    def __post_init__(self) -> None:
        for name in ("index", "of"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"serve.mirror_partition.{name}: expected an integer, found {v!r}")
        if self.of < 1 or not 0 <= self.index < self.of:
            raise ConfigError(f"serve.mirror_partition: expected 0 <= index < of, found index {self.index}, of {self.of}")
        _positive("serve.mirror_partition", "exchange_wait_s", self.exchange_wait_s)


@dataclass(frozen=True)
class SigningConfig:
    key_env: str = "FLOWCHECK_HMAC_KEY"  # the HMAC-SHA256 key is read from this variable, never from a file
    required: bool = False  # refuse unsigned manifests on read / audit


@dataclass(frozen=True)
class ServeConfig:
    """The checkpoint node (``flowcheck serve``): where trainers push, where the control API listens."""

    push: str = "127.0.0.1:7377"  # HOST:PORT of the push listener (trainers: Checkpointer(node="tcp://HOST:PORT"))
    http: str = "127.0.0.1:7378"  # HOST:PORT of the HTTP control API; loopback unless you mean otherwise
    part_timeout_s: float = 60.0  # a step none of whose parts progressed this long is aborted (never half-applied)
    mirror_job: str | None = None  # mirror capture: the job description YAML (configs/mirror-job.yaml)
    mirror_pcaps: str | None = None  # mirror capture from files: a glob of pcap/pcapng files, replayed at start
    mirror_interface: str | None = None  # mirror capture live: the mirror port's interface (needs CAP_NET_RAW)
    mirror_settle_s: float = 0.1  # live: an allreduce is decoded once this much capture time passed since its last send
    mirror_decode_workers: int = 1  # native threads of the mirror decoder (reassembly and merge; `capture --decode-workers`)
    mirror_init: str | None = None  # the replica's initial state: a .safetensors file or a committed step (default: the job's)
    # several nodes share one mirror capture, each its part of the parameters (configs/mirror-node.yaml)
    mirror_partition: MirrorPartitionConfig = MirrorPartitionConfig()
    # the environment variable holding the node's shared token (never the token itself: it is not stored anywhere).
    # Set on the node, every push and every POST to the control API needs it; unset, the node is unauthenticated
    # and refuses to listen beyond loopback.  Trainers' Checkpointers read the same variable.
    auth_token_env: str = "FLOWCHECK_NODE_TOKEN"
    # bounds on every connection of both listeners (flowcheck/node/limits.py): a push frame header or an HTTP
    # request head must be complete this long after the connection (or its previous frame) started — also the
    # longest pause mid-payload and the HTTP keep-alive; half-sent requests and silent connections are closed
    header_timeout_s: float = 10.0
    # a trainer's push connection, once it pushed, may sit idle between saves this long (it reconnects after)
    idle_timeout_s: float = 900.0
    # connections each listener (push, HTTP) holds at once; one more is refused at once and counted.  Keep
    # 2 x max_connections + a few hundred under the node's file descriptor limit (ulimit -n)
    max_connections: int = 256
    # push frame headers the node reads and parses at once, over all connections (MiB); a connection that has not
    # proved it holds the token may send headers of 16 KiB at most, so unauthenticated clients cannot fill it
    header_memory_mib: float = 256.0

    def __post_init__(self) -> None:
        if not isinstance(self.auth_token_env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.auth_token_env):
            raise ConfigError(f"serve.auth_token_env: expected the name of an environment variable (the token itself "
                              f"never goes in a file), found {self.auth_token_env!r}")
        for name in ("push", "http"):
            value = getattr(self, name)
            host, _, port = str(value).rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ConfigError(f"serve.{name}: expected HOST:PORT, found {value!r}")
        for name in ("part_timeout_s", "header_timeout_s", "idle_timeout_s", "max_connections", "header_memory_mib"):
            _positive("serve", name, getattr(self, name))
        if isinstance(self.max_connections, float):
            raise ConfigError(f"serve.max_connections: expected a whole number, found {self.max_connections!r}")
        sources = [name for name in ("mirror_pcaps", "mirror_interface") if getattr(self, name) is not None]
        if (self.mirror_job is None) != (not sources) or len(sources) > 1:
            raise ConfigError("serve.mirror_job and serve.mirror_pcaps / serve.mirror_interface: expected a job and one "
                              f"source of its frames (captures or a live interface), or neither; found job="
                              f"{self.mirror_job!r}, sources {sources or 'none'}")
        if self.mirror_settle_s < 0:
            raise ConfigError(f"serve.mirror_settle_s: expected >= 0 seconds, found {self.mirror_settle_s!r}")
        w = self.mirror_decode_workers
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError(f"serve.mirror_decode_workers: expected a whole number >= 1, found {w!r}")

    @staticmethod
    def split(value: str) -> tuple[str, int]:
        host, _, port = value.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ClusterConfig:
    """Several checkpoint nodes (one per DP group / leaf switch) writing one step to a shared object store.

    Each node commits its own part (its shards' files and a part manifest); a step is committed
    when every listed node's part is, by whichever node first sees them all (tiers/cluster.py).
    """

    nodes: list[str] = field(default_factory=list)  # every node owning shards of a step; empty = one node writes whole steps
    name: str = "cluster"  # producer.node of the step manifests (each part manifest names its own node)
    commit_wait_s: float = 300.0  # how long a node that committed its part polls for the others' parts

    def __post_init__(self) -> None:
        for i, node in enumerate(self.nodes):
            try:
                check_name(node, "node name")
            except Exception as e:
                raise ConfigError(f"cluster.nodes[{i}]: {e}") from e
        dups = sorted({n for n in self.nodes if self.nodes.count(n) > 1})
        if dups:
            raise ConfigError(f"cluster.nodes: expected each node once, found {dups} more than once")
        try:
            check_name(self.name, "cluster name")
        except Exception as e:
            raise ConfigError(f"cluster.name: {e}") from e
        _positive("cluster", "commit_wait_s", self.commit_wait_s)


@dataclass(frozen=True)
class Config:
    run: str = "default"
    node: str = ""  # producer node name; empty = this host's name
    tiers: TiersConfig = TiersConfig()
    policy: PolicyConfig = PolicyConfig()
    signing: SigningConfig = SigningConfig()
    serve: ServeConfig = ServeConfig()
    cluster: ClusterConfig = ClusterConfig()

    def __post_init__(self) -> None:
        try:
            check_name(self.run, "run name")
        except Exception as e:
            raise ConfigError(f"run: {e}") from e
        if not self.node:
            object.__setattr__(self, "node", socket.gethostname())
        if self.cluster.nodes:
            self._check_cluster()
        part = self.serve.mirror_partition
        if part.of > 1 and len(self.cluster.nodes) < part.of:
            raise ConfigError(
                f"serve.mirror_partition: this node stores part {part.index} of {part.of}, so a step needs the other "
                f"parts: expected cluster.nodes to list at least {part.of} nodes, found {len(self.cluster.nodes)}")
        check_storage_apart(self.tiers)

    def _check_cluster(self) -> None:
        if self.node not in self.cluster.nodes:
            raise ConfigError(
                f"node: expected one of cluster.nodes {self.cluster.nodes}, found {self.node!r}; "
                "set `node:` to this node's name as the cluster lists it"
            )
        if not self.tiers.object.enabled:
            raise ConfigError("cluster.nodes: a multi-node step lives in the object tier, but tiers.object.enabled is false")

    def to_yaml(self) -> str:
        raw = dataclasses.asdict(self)
        return yaml.safe_dump(raw, sort_keys=False)


# ---- tiers that must not share storage ------------------------------------
def _file_folder(url: str) -> str | None:
    """The folder of a ``file://`` (or ``local://``) URL, symlinks resolved; None for any other URL."""
    for scheme in ("file://", "local://"):
        if url.startswith(scheme):
            return os.path.realpath(url[len(scheme):] or ".")
    return None


def _within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or inside it (both absolute, resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_storage_apart(tiers: TiersConfig) -> None:
    """ConfigError when two tiers (or the staging folder and a tier) would share files.

    One folder as the local root and the ``file://`` object URL makes every local step look promoted (promote
    writes nothing) and the object tier's GC delete local steps; nested roots put one tier's runs among the
    other's.  Staging in a run's folder puts upload files among its steps.  Relative paths are taken from the
    working directory here; ``load`` has anchored a file's paths at its folder already.
    """
    if not tiers.object.enabled:
        return
    local = os.path.realpath(tiers.local.root)
    obj = _file_folder(tiers.object.url)
    what = {"tiers.local.root": local}
    if obj is not None:
        what["tiers.object.url"] = obj
        if _within(local, obj) or _within(obj, local):
            how = "are the same folder" if local == obj else "are nested (one inside the other)"
            outer = obj if _within(local, obj) else local
            raise ConfigError(
                f"tiers.local.root ({local}) and tiers.object.url ({tiers.object.url}, folder {obj}) {how}: the tiers "
                f"would read and delete each other's steps.  Use two separate folders, neither inside the other "
                f"(e.g. {os.path.join(outer, 'local')} and file://{os.path.join(outer, 'object')})")
    if tiers.object.staging_dir:
        staging = os.path.realpath(tiers.object.staging_dir)
        for field_name, root in what.items():
            rel = os.path.relpath(staging, root)
            first = rel.split(os.sep, 1)[0]
            outside = rel == os.pardir or rel.startswith(os.pardir + os.sep)
            if staging == root or (not outside and not first.startswith(".")):
                where = "is that tier's root" if staging == root else \
                    f"lies in {os.path.join(root, first)}, a folder that tier would take for a run"
                raise ConfigError(
                    f"tiers.object.staging_dir ({staging}) {where} ({field_name} {root}): upload files would land "
                    f"among the tier's runs and steps.  Leave it unset (default <local root>/.staging), or use a "
                    f"folder outside the tiers or in a hidden one (e.g. {os.path.join(local, '.staging')})")


# ---- loading -------------------------------------------------------------
def _build(cls: type, raw: Any, where: str, path: str) -> Any:
    kwargs = _fields(cls, raw, where, path)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {str(e).replace(TIER_POLICY, path)}") from e


def _construct(cls: type, kwargs: dict[str, Any], where: str) -> Any:
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def _fields(cls: type, raw: Any, where: str, path: str) -> dict[str, Any]:
    """The checked keyword arguments of ``cls`` from its mapping in the file (its nested sections built)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{path or '<root>'}': expected a mapping, found {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: '{path + '.' if path else ''}{unknown[0]}': unknown field; expected one of {sorted(names)}")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        sub = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, where, sub)
        else:
            kwargs[name] = _check_type(hint, value, where, sub)
    return kwargs


def _check_type(hint: Any, value: Any, where: str, path: str) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    for opt in options:
        base = typing.get_origin(opt) or opt
        if opt is type(None) and value is None:
            return value
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is bool and isinstance(value, bool):
            return value
        if base in (int, str, dict) and isinstance(value, base) and not isinstance(value, bool):
            return value
        if base is list and isinstance(value, list):
            item = (typing.get_args(opt) or (object,))[0]
            if all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                return list(value)
    raise ConfigError(f"{where}: '{path}': expected {hint}, found {value!r}")


def from_dict(raw: Any, where: str = "<config>", base: str | None = None) -> Config:
    """The config a mapping describes; ``base``: the folder its relative paths are taken from (the config file's),
    None: the working directory.  Anchored before the Config is built, so its checks see the real paths."""
    kwargs = _fields(Config, raw, where, "")
    if base is not None:
        kwargs = _anchor(kwargs, base)
    return _construct(Config, kwargs, where)


def read_yaml(path: str, error: type[Exception], what: str, hint: str = "") -> Any:
    """A YAML (or JSON) file's content; the error says which file and why: missing, unreadable, not YAML."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except FileNotFoundError as e:
        raise error(f"{what} {path!r} does not exist{hint}") from e
    except OSError as e:
        raise error(f"{what} {path!r}: cannot read ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise error(f"{what} {path!r}: not valid YAML: {_yaml_problem(e)}") from e


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one line: the problem and where (1-based line and column), without PyYAML's excerpt lines."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def load(path: str | None = None) -> Config:
    """Load a config file (YAML); None means $FLOWCHECK_CONFIG, else the embedded defaults.

    Relative directories in the file are taken relative to the file's folder.
    """
    path = path or os.environ.get("FLOWCHECK_CONFIG")
    if not path:
        return Config()
    raw = read_yaml(path, ConfigError, "config file", "; pass --config FILE or unset FLOWCHECK_CONFIG")
    return from_dict(raw, path, base=os.path.dirname(os.path.abspath(path)))


def _anchor(kwargs: dict[str, Any], base: str) -> dict[str, Any]:
    """Config keyword arguments with relative folders (given or default) joined to ``base``: the local root, a
    ``file://`` object URL (``file://./x`` or ``file://x``), the staging folder, the mirror-capture files."""
    def join(path: str) -> str:
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))

    tiers, serve = kwargs.get("tiers", TiersConfig()), kwargs.get("serve", ServeConfig())
    local = dataclasses.replace(tiers.local, root=join(tiers.local.root))
    obj = tiers.object
    if obj.url.startswith("file://") and not obj.url.startswith("file:///"):
        obj = dataclasses.replace(obj, url="file://" + join(obj.url[len("file://"):]))
    if obj.staging_dir:
        obj = dataclasses.replace(obj, staging_dir=join(obj.staging_dir))
    for name in ("mirror_job", "mirror_pcaps", "mirror_init"):
        value = getattr(serve, name)
        if value and not value.isdigit():
            serve = dataclasses.replace(serve, **{name: join(value)})
    if serve.mirror_partition.exchange:
        serve = dataclasses.replace(serve, mirror_partition=dataclasses.replace(
            serve.mirror_partition, exchange=join(serve.mirror_partition.exchange)))
    return {**kwargs, "tiers": dataclasses.replace(tiers, local=local, object=obj), "serve": serve}
