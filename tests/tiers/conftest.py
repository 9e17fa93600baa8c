"""The tier fixture every shared tier test runs against.

To add a tier (e.g. "memory"), add its param to TIER_KINDS and one branch to
``_tier_factory``; every test in test_tier_suite.py then runs against it.
"""
from __future__ import annotations

import pytest

from flowcheck.config import LocalConfig, ObjectConfig
from tests.conftest import bucket_on

TIER_KINDS = ["memory", "local", "object-file", pytest.param("object-s3", marks=pytest.mark.s3),
              pytest.param("object-seaweedfs", marks=pytest.mark.s3)]


def _tier_factory(kind: str, request, base):
    """A function run -> Tier over one storage location (calling it again reopens the same data)."""
    if kind == "memory":
        from flowcheck.config import MemoryConfig
        from flowcheck.tiers.memory import MemoryTier

        tiers = {}  # RAM cannot be reopened: the same run gives the same tier
        return lambda run: tiers.setdefault(run, MemoryTier(MemoryConfig(), run))
    if kind == "local":
        from flowcheck.tiers.local import LocalTier

        return lambda run: LocalTier(LocalConfig(root=str(base / "local")), run)
    if kind.startswith("object-"):
        from flowcheck.tiers.object import ObjectTier

        url = f"file://{base / 'object'}" if kind == "object-file" else \
            bucket_on(request, {"object-s3": "moto", "object-seaweedfs": "seaweedfs"}[kind])
        config = ObjectConfig(url=url, max_file_mib=1)  # 1 MiB files: a >1 MiB shard spans several
        return lambda run: ObjectTier(config, run, staging_dir=str(base / "staging"))
    raise ValueError(f"unknown tier kind {kind!r}")


@pytest.fixture(params=TIER_KINDS)
def tier_kind(request) -> str:
    return request.param


@pytest.fixture
def make_tier(tier_kind, request, tmp_path):
    """Open a tier of the parametrized kind: ``make_tier()`` twice gives two views of the same data."""
    factory = _tier_factory(tier_kind, request, tmp_path / "under-test")

    def make(run: str = "r1"):
        return factory(run)

    return make


@pytest.fixture
def tier(make_tier):
    return make_tier()


@pytest.fixture
def local_tier(tmp_path):
    """A second, local tier: the usual source and target of promotions."""
    from flowcheck.tiers.local import LocalTier

    return LocalTier(LocalConfig(root=str(tmp_path / "other-local")), "r1")


@pytest.fixture
def persistent(tier_kind) -> None:
    """For behaviour only a tier that keeps many steps has (RAM holds just the latest state)."""
    if tier_kind == "memory":
        pytest.skip("the memory tier holds only the latest state: no stored files, history, pruning records or step conflicts")
