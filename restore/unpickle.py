"""The pickled files of a foreign checkpoint (``.pt``, DCP ``.metadata``), loaded through allow-lists only.

A checkpoint handed to ``flowcheck import`` is untrusted input: a pickle runs
any callable its author names.  ``.pt`` files go through torch's
``weights_only`` loader (tensors, containers, dtypes) with ``argparse.Namespace``
added for Megatron's ``args``; a DCP ``.metadata`` goes through an Unpickler
that resolves only the classes torch's DCP writer (and Megatron's save
planner) put there.  Anything else is refused, naming the file and the global,
unless the user passes ``--trust-pickle``.
"""
from __future__ import annotations

import argparse
import importlib
import io
import pathlib
import pickle
import re
from typing import IO, Any

from flowcheck.errors import FormatError

TRUST_HINT = "if you trust this checkpoint, pass --trust-pickle"
_PT_GLOBALS = (argparse.Namespace,)  # Megatron's args; torch's weights_only list covers tensors and containers

# Exactly what `pickle.dump(Metadata)` references in torch 2.13's DCP FileSystemWriter output, read back
# with a logging Unpickler from checkpoints written by restore's DistWriter and by megatron-core 0.16.1
# (whose save planner also keeps every rank's SavePlan in Metadata.all_local_plans).
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a dict lookup of a layout by its name
}
# StorageMeta.checkpoint_id, when the writer was given a Path (pathlib._local: how Python 3.13 names it);
# read as a pure path, which touches no file
_PATH_GLOBALS = frozenset({("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")})


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"global {module}.{name}")


def _torch_value_names() -> frozenset[str]:
    """Names of torch's dtypes, layouts and memory formats (``vars``: no lazy import is triggered)."""
    import torch

    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return frozenset(n for n, v in vars(torch).items() if isinstance(v, kinds))


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Resolves only the DCP metadata classes, torch.Size and torch's dtypes/layouts/memory formats."""

    def __init__(self, f: IO[bytes], trust: bool) -> None:
        super().__init__(f)
        self._trust = trust
        self._torch_values = _torch_value_names()

    def find_class(self, module: str, name: str) -> Any:
        if self._trust:
            return super().find_class(module, name)
        if name in _DCP_GLOBALS.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and name in self._torch_values:
            return getattr(importlib.import_module("torch"), name)
        if (module, name) in _PATH_GLOBALS:
            return pathlib.PurePosixPath
        raise _Refused(module, name)


def load_dcp_metadata(path: str, trust_pickle: bool = False) -> Any:
    """The object a DCP ``.metadata`` file pickles, resolving only the allow-listed classes."""
    import torch.distributed.checkpoint.metadata  # noqa: F401 - the classes find_class hands out

    try:
        with open(path, "rb") as f:
            return _DcpMetadataUnpickler(f, trust_pickle).load()
    except FileNotFoundError:
        raise FormatError(f"{path}: missing; a torch_dist checkpoint keeps its DCP index there") from None
    except _Refused as e:
        raise FormatError(f"{path}: refused to unpickle {e} (not a DCP metadata class); {TRUST_HINT}") from e
    except Exception as e:  # noqa: BLE001 - truncated or malformed pickles raise anything from EOFError to TypeError
        raise FormatError(f"{path}: not a readable DCP metadata file ({_one_line(e)})") from e


def load_pt(source: str | bytes, where: str, trust_pickle: bool = False, *, hint: str = TRUST_HINT) -> Any:
    """A ``torch.save`` file (a path, or its bytes) through torch's ``weights_only`` loader.

    Only ``--trust-pickle`` lifts the allow-list (``weights_only=False``); ``hint`` ends a refusal (a command
    without that option says what to do instead).
    """
    import torch

    f = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with torch.serialization.safe_globals(list(_PT_GLOBALS)):
            return torch.load(f, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as e:  # weights_only met a global outside the allow-list
        raise FormatError(f"{where}: refused to unpickle {_refused_global(e)} (flowcheck loads only tensors, "
                          f"containers and argparse.Namespace from a checkpoint: torch's weights_only loader); {hint}") from e
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/EOFError/OSError/... for damaged files
        raise FormatError(f"{where}: cannot read as a torch file ({_one_line(e)})") from e


def _refused_global(e: Exception) -> str:
    text = str(e)
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"global {m.group(1)}"
    # "Unsupported operand 149" and the like: the first line after torch's own "WeightsUnpickler error:" label
    m = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text) or re.search(r"(Unsupported[^\n]*)", text)
    return f"a pickle ({m.group(1).strip()[:200]})" if m else _one_line(e)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]
