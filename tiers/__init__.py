"""The storage tiers: memory (latest state in RAM), local (zarr on NVMe), object (safetensors on fsspec URLs)."""
from flowcheck.tiers.base import Problem, Tier

__all__ = ["Problem", "Tier", "MemoryTier", "LocalTier", "ObjectTier"]


def __getattr__(name):
    # tiers import zarr / fsspec lazily: `import flowcheck.tiers` stays cheap
    if name == "MemoryTier":
        from flowcheck.tiers.memory import MemoryTier

        return MemoryTier
    if name == "LocalTier":
        from flowcheck.tiers.local import LocalTier

        return LocalTier
    if name == "ObjectTier":
        from flowcheck.tiers.object import ObjectTier

        return ObjectTier
    raise AttributeError(name)
