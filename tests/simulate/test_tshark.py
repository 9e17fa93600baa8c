"""Wireshark's dissectors read the simulator's pcaps as InfiniBand over UDP (RoCEv2), none malformed."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from flowcheck.capture.mirror.pcap import read_capture
from flowcheck.simulate import SimOptions, simulate

pytestmark = pytest.mark.skipif(shutil.which("tshark") is None,
                                reason="tshark is not installed (Debian: apt-get install -y tshark)")

# Like the real ConnectX captures, frames carry UDP checksum 0 over IPv6 (allowed for RoCEv2, flagged by
# default); and RDMA payload is gradient bytes, which Wireshark's EoIB heuristics would try to read as Ethernet.
OPTS = ["-o", "udp.ignore_ipv6_zero_checksum:TRUE", "--disable-heuristic", "eth_over_ib",
        "--disable-heuristic", "mellanox_eoib"]


def _tshark(path: str, *args: str) -> list[str]:
    out = subprocess.run(["tshark", *OPTS, "-r", path, *args], capture_output=True, text=True, timeout=120, check=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("kw", [{"proto": "ll"}, {"proto": "simple", "ipv4": True, "vlan": 42, "mtu": 4096}],
                         ids=["ll-ipv6", "simple-ipv4-vlan"])
def test_tshark_decodes_every_frame_as_infiniband_without_errors(tmp_path, kw):
    result = simulate(SimOptions(out=str(tmp_path), dp=3, iters=5, channels=2, mirror="0:both", **kw))
    path = result.pcaps["0:both"]
    assert _tshark(path, "-Y", "_ws.malformed || _ws.expert.severity >= error", "-T", "fields", "-e", "frame.number") == []
    assert len(_tshark(path, "-Y", "infiniband", "-T", "fields", "-e", "frame.number")) == len(read_capture(path))
    opcodes = set(_tshark(path, "-Y", "infiniband", "-T", "fields", "-e", "infiniband.bth.opcode"))
    assert {"6", "7", "9", "10", "11", "17", "100"} <= opcodes
