"""The error tree: every error flowcheck raises on purpose is a FlowcheckError.

Each class also subclasses the builtin that fits, so callers that only know
builtins (``except FileNotFoundError``) still work.  Messages say what was
expected, what was found, and what to do.
"""
from __future__ import annotations


class FlowcheckError(Exception):
    """Base of every error flowcheck raises on purpose."""


class ConfigError(FlowcheckError, ValueError):
    """A config or policy file (or dataclass field) is invalid."""


class ManifestError(FlowcheckError, ValueError):
    """A manifest is malformed, of an unknown version, or fails its digest/signature."""


class IntegrityError(FlowcheckError, ValueError):
    """Stored bytes do not match the digest the manifest records for them."""


class StepNotFoundError(FlowcheckError, FileNotFoundError):
    """No committed step with that number in the tier(s) asked.

    Example::

        try:
            store.manifest(1200)
        except StepNotFoundError:
            print("step 1200 is not committed anywhere; see `flowcheck ls`")
    """


class StepPrunedError(StepNotFoundError):
    """The step asked for was deleted on purpose (by GC or ``Store.delete``): ``record`` is its pruning record
    (a ``flowcheck.tiers.records.PrunedRecord``), so a caller can say when and by whom."""

    def __init__(self, message: str, record: object = None) -> None:
        super().__init__(message)
        self.record = record

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AmbiguousStepError(StepNotFoundError):
    """A step reference matches several states (a digest prefix on two branches); the message lists them."""


class TensorNotFoundError(FlowcheckError, KeyError):
    """A step has no tensor of that name."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class RegionError(FlowcheckError, IndexError):
    """A region asked of a tensor that does not fit it: more dimensions than the tensor, or not contiguous slices."""


class StepExistsError(FlowcheckError, FileExistsError):
    """A committed step with that number already exists and differs."""


class UnsafeNameError(FlowcheckError, ValueError):
    """A tensor name or path from a manifest/config would escape its root."""


class FormatError(FlowcheckError, ValueError):
    """A stored file (safetensors header, zarr metadata) is malformed."""


class TierError(FlowcheckError, OSError):
    """A tier cannot be reached or written (unreachable endpoint, read-only dir, ...)."""


class TierMissingError(TierError):
    """A configured tier does not exist: no such S3 bucket, a ``file://`` folder whose parent folder is missing too.

    Not a FileNotFoundError on purpose: listings read "not found" as "nothing stored", and this error must never
    be taken for an empty store.  The message names the bucket or folder, the URL and the config field."""


class TierAccessError(TierError, PermissionError):
    """A tier refuses this process: no credentials, an invalid access key, access denied (403).  Permanent: never
    retried; the message carries the standard AWS hint (or the folder's permissions for ``file://``)."""


class OutputError(FlowcheckError, OSError):
    """An output (an exported file, a restored checkpoint directory) cannot be written: a full disk, no permission,
    a read-only filesystem.  Keeps the ``errno`` and ``filename`` of the OSError it wraps; the message says what
    was left behind (nothing half-written) and what to do."""

    def __init__(self, message: str, errno: int | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.errno, self.filename = errno, filename

    def __str__(self) -> str:  # OSError would print "[Errno 28] None: 'path'"
        return str(self.args[0]) if self.args else ""


class TooLargeError(FlowcheckError, MemoryError):
    """A tensor a step describes is more than this machine can allocate (a genuine giant, or a forged manifest):
    raised instead of a bare MemoryError, naming the tensor, its shape and its size."""


class StaleStateError(FlowcheckError, RuntimeError):
    """The in-memory state is stale (an update failed) and must not be snapshotted."""


class CaptureError(FlowcheckError, ValueError):
    """A capture (pcap/pcapng file, live interface, RoCE frame) is malformed or cannot be read."""


class JobError(FlowcheckError, ValueError):
    """A mirror-capture job description does not fit the traffic or is invalid."""


class ClusterError(FlowcheckError, ValueError):
    """The node parts of a multi-node step do not fit together (overlapping or missing shards, disagreeing fields)."""


class StepIncompleteError(FlowcheckError, TimeoutError):
    """A multi-node step stays uncommitted: some nodes' parts did not arrive in time (GC removes its prefix)."""


class LeaseHeldError(FlowcheckError, RuntimeError):
    """Another node holds the run's lease (``<local root>/<run>/.lease.json``): it serves the run now, and a run
    has one writer node at a time.  The message names the holder (node, pid, host, since) and what to do."""


class AuthError(FlowcheckError, PermissionError):
    """A push or control request without the node's token, with a wrong one, or a replayed frame; or a node
    that cannot prove it holds the token the trainer has (set the same FLOWCHECK_NODE_TOKEN on both)."""
