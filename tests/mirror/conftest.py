"""Fixtures of the mirror suites: the shared real captures with their job files."""
from __future__ import annotations

import glob
import os

import pytest

PCAPS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "pcaps")
JOBS = os.path.join(os.path.dirname(__file__), "..", "data", "jobs")


@pytest.fixture
def real_captures() -> list[tuple[str, str, str]]:
    """(name, pcap, job file) of every shared real capture that has a job file here; skips when there are none."""
    found = []
    for pcap in sorted(glob.glob(os.path.join(PCAPS, "*.pcapng"))):
        name = os.path.basename(pcap).rsplit(".", 1)[0]
        job = os.path.join(JOBS, name + ".yaml")
        if os.path.exists(job):
            found.append((name, pcap, job))
    if not found:
        pytest.skip(f"the shared real captures are missing ({PCAPS})")
    return found
