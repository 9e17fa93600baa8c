"""flowcheck: multi-tier checkpoint storage for large-model training.

Importing flowcheck is cheap; zarr, fsspec and torch load when first used.
"""
from __future__ import annotations

from flowcheck.version import __version__
__all__ = ["__version__", "open_store"]


def open_store(config=None):
    """Open the store a config describes (a path, a Config, or None for $FLOWCHECK_CONFIG / defaults)."""
    from flowcheck.store import open_store as _open

    return _open(config)
