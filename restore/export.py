"""Export one step as a consolidated safetensors file (full tensors, HF-style) for evaluation."""
from __future__ import annotations

import os

from flowcheck.manifest import Manifest
from flowcheck.restore.assemble import assemble_tensor
from flowcheck.tiers import safetensors_io as st
from flowcheck.tiers.base import Tier


def export_safetensors(tier: Tier, manifest: Manifest, out: str, *, include_optimizer: bool = True) -> tuple[int, str]:
    """Write every (verified) tensor of a step to ``out`` atomically; return (bytes, xxh3 digest)."""
    names = [n for n in manifest.tensors if include_optimizer or not n.startswith("optimizer.")]
    entries = [
        st.Entry(n, manifest.tensors[n].dtype, manifest.tensors[n].global_shape, _loader(tier, manifest, n))
        for n in names
    ]
    meta = {"run": manifest.run, "step": str(manifest.step), "manifest_id": manifest.digest(), "format": "pt"}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.partial"
    try:
        size, digest = st.write(tmp, entries, meta)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return size, digest


def _loader(tier: Tier, manifest: Manifest, name: str):
    return lambda: assemble_tensor(tier, manifest, name)
