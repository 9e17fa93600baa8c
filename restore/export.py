"""Export one step as a consolidated single-layout file (full tensors, canonical names) for evaluation."""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable

import torch

from flowcheck import dtypes
from flowcheck.manifest import Manifest
from flowcheck.progress import Progress, counter
from flowcheck.restore.assemble import assemble_tensor
from flowcheck.restore.outputs import failed_write, remove
from flowcheck.tiers import safetensors_io as st
from flowcheck.tiers.base import Tier
from flowcheck.tiers.durable import fsync_dir, fsync_file

EXPORT_FORMATS = ("safetensors", "torch")


def export_file(tier: Tier, manifest: Manifest, out: str, *, fmt: str = "safetensors",
                include_optimizer: bool = True, progress: Progress | None = None) -> tuple[int, str]:
    """Write every (verified) tensor of a step to ``out`` atomically; return (bytes, digest note).

    ``progress`` counts tensor bytes as each tensor is read, verified and assembled."""
    if fmt == "safetensors":
        return export_safetensors(tier, manifest, out, include_optimizer=include_optimizer, progress=progress)
    if fmt != "torch":
        from flowcheck.errors import ConfigError

        raise ConfigError(f"--format: expected one of {EXPORT_FORMATS}, found {fmt!r}")
    from flowcheck.torch.state import from_numpy

    names = _names(manifest, include_optimizer)
    need = _bytes(manifest, names)
    done = counter(progress, need)
    state = {n: from_numpy(_loader(tier, manifest, n, done)(), manifest.tensors[n].dtype) for n in names}

    def save(tmp: str) -> None:
        # through a Python file: a failed write then surfaces as its OSError (ENOSPC...), not only as the
        # "unexpected pos" RuntimeError torch's own file writer reports
        with open(tmp, "wb") as f:
            torch.save(state, f)

    return _atomic(out, save, need), f"manifest {manifest.digest()}"


def export_safetensors(tier: Tier, manifest: Manifest, out: str, *, include_optimizer: bool = True,
                       progress: Progress | None = None) -> tuple[int, str]:
    names = _names(manifest, include_optimizer)
    need = _bytes(manifest, names)
    done = counter(progress, need)
    entries = [
        st.Entry(n, manifest.tensors[n].dtype, manifest.tensors[n].global_shape, _loader(tier, manifest, n, done))
        for n in names
    ]
    meta = {"run": manifest.run, "step": str(manifest.step), "manifest_id": manifest.digest(), "format": "pt"}
    if manifest.scalars.get("optimizer_step") is not None:
        meta["optimizer_step"] = str(manifest.scalars["optimizer_step"])
    model = (manifest.scalars.get("extra") or {}).get("model")
    if isinstance(model, dict):  # Megatron argument names, values JSON-encoded (specs/megatron.md)
        meta.update({k: json.dumps(v) for k, v in model.items()})
    digest = []
    size = _atomic(out, lambda tmp: digest.append(st.write(tmp, entries, meta)[1]), need)
    return size, digest[0]


def _names(manifest: Manifest, include_optimizer: bool) -> list[str]:
    return [n for n in manifest.tensors if include_optimizer or not n.startswith("optimizer.")]


def _atomic(out: str, write, need: int) -> int:
    """Write ``out`` through ``write(tmp)`` into a temporary file renamed into place; a disk that refuses it (or
    memory running out) is one OutputError/TooLargeError, and the temporary file is gone."""
    folder = os.path.dirname(os.path.abspath(out))
    tmp, existed, placed = None, os.path.exists(out), False
    try:
        os.makedirs(folder, exist_ok=True)
        # a fresh name created O_EXCL in the target folder: a planted `<out>.partial` symlink is never followed
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(out)}.", suffix=".partial")
        os.close(fd)
        write(tmp)
        fsync_file(tmp)  # the bytes are durable before the final name points at them
        os.replace(tmp, out)
        placed = True
        fsync_dir(folder)
    except BaseException as e:
        stuck = None if placed else remove(tmp)
        if placed:
            left = f"{out} is complete but its folder entry may not be durable"
        elif stuck:
            left = f"the temporary file {stuck}"
        else:
            left = f"nothing was left half-written ({out} was {'not replaced' if existed else 'not created'})"
        error = failed_write(e, out, what="the exported file", need=need, left=left)
        if error is None:
            raise
        raise error from e
    return os.path.getsize(out)


def _bytes(manifest: Manifest, names: list[str]) -> int:
    return sum(math.prod(manifest.tensors[n].global_shape) * dtypes.dtype(manifest.tensors[n].dtype).itemsize for n in names)


def _loader(tier: Tier, manifest: Manifest, name: str, done: Callable[[int], None]):
    def load():
        arr = assemble_tensor(tier, manifest, name)
        done(arr.nbytes)
        return arr

    return load
