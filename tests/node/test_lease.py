"""One writer node per run: the lease in ``<local root>/<run>/.lease.json`` (flowcheck/node/lease.py)."""
from __future__ import annotations

import json
import os
import signal
import socket

import pytest

from flowcheck.config import ClusterConfig, Config, LocalConfig, ObjectConfig, ServeConfig, TiersConfig
from flowcheck.errors import LeaseHeldError
from flowcheck.node.lease import LEASE, RunLease
from tests.capture.conftest import NodeProcess, free_port


def _lease(node: NodeProcess) -> dict:
    with open(os.path.join(node.root, "local", node.run, LEASE)) as f:
        return json.load(f)


def test_a_second_node_on_the_same_run_fails_to_start_naming_the_first_and_a_killed_ones_lease_is_taken_over(tmp_path):
    first = NodeProcess(str(tmp_path), name="node-a").start()
    second = third = None
    try:
        held = _lease(first)
        assert held["node"] == "node-a" and held["pid"] == first.proc.pid and held["run"] == "gpt"
        assert {"host", "started", "refreshed_at"} <= set(held)
        second = NodeProcess(str(tmp_path), name="node-b", local=str(tmp_path / "local"))
        with pytest.raises(RuntimeError, match="exited 2"):
            second.start()
        message = second.tail()
        assert "error: run 'gpt'" in message and "already served by node 'node-a'" in message, message
        assert f"pid {first.proc.pid} on host" in message and "since" in message and "Stop that node" in message
        assert "Traceback" not in message
        assert first.get("/status")["lease"].endswith(f"gpt/{LEASE}")  # the first one is untouched
        first.kill(signal.SIGKILL)  # no goodbye: the kernel drops its flock
        third = NodeProcess(str(tmp_path), name="node-c", local=str(tmp_path / "local")).start()
        assert _lease(third)["node"] == "node-c" and _lease(third)["pid"] == third.proc.pid
        assert "took over the lease of run gpt from node node-a" in third.tail()
    finally:
        for node in (first, second, third):
            if node is not None:
                node.stop()
    assert _lease(third).get("released_at")  # a clean stop says so


def test_the_lease_is_held_by_one_holder_at_a_time_and_free_again_once_released(tmp_path):
    lease = RunLease(str(tmp_path), "r", "a").acquire()
    with pytest.raises(LeaseHeldError, match=r"already served by node 'a' \(pid \d+ on host"):
        RunLease(str(tmp_path), "r", "b").acquire()  # a second open file: flock refuses it even in this process
    RunLease(str(tmp_path), "other-run", "b").acquire().release()  # another run has its own lease
    lease.release()
    again = RunLease(str(tmp_path), "r", "b").acquire()
    assert json.loads((tmp_path / "r" / LEASE).read_text())["node"] == "b"
    again.release()


def test_cluster_nodes_each_hold_the_lease_of_their_own_local_tier(tmp_path):
    from flowcheck.node.service import Node

    def config(name: str) -> Config:
        return Config(run="gpt", node=name, cluster=ClusterConfig(nodes=["n0", "n1"]),
                      tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / name / "local")),
                                        object=ObjectConfig(url=f"file://{tmp_path}/object")),
                      serve=ServeConfig(push=f"127.0.0.1:{free_port()}", http=f"127.0.0.1:{free_port()}"))

    nodes = [Node(config("n0")).start(), Node(config("n1")).start()]  # one object tier, two local tiers
    try:
        with pytest.raises(LeaseHeldError, match="node 'n0'"):
            Node(config("n0"))  # a second n0 on n0's local tier is not
    finally:
        for node in nodes:
            node.stop()


def test_a_node_that_fails_to_start_frees_the_lease(tmp_path):
    from flowcheck.errors import FlowcheckError
    from flowcheck.node.service import Node

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = Config(run="gpt", tiers=TiersConfig(local=LocalConfig(root=str(tmp_path / "local")),
                                                  object=ObjectConfig(url=f"file://{tmp_path}/object")),
                     serve=ServeConfig(push=f"127.0.0.1:{free_port()}", http="127.0.0.1:%d" % taken.getsockname()[1]))
        with pytest.raises(FlowcheckError, match="control API cannot listen"):
            Node(cfg).start()
    RunLease(str(tmp_path / "local"), "gpt", "next").acquire().release()


def test_a_second_node_with_its_own_local_root_on_the_same_object_url_and_run_is_refused(tmp_path):
    """Separate local roots (so separate local leases), one object URL: the object-tier lease refuses the second."""
    first = NodeProcess(str(tmp_path), name="node-a", local=str(tmp_path / "local-a")).start()
    second = None
    try:
        second = NodeProcess(str(tmp_path), name="node-b", local=str(tmp_path / "local-b"))
        with pytest.raises(RuntimeError, match="exited 2"):
            second.start()
        message = second.tail()
        assert "in object tier" in message and "already served by node 'node-a'" in message, message
        assert str(tmp_path / "local-a") in message and "Traceback" not in message
        first.stop()  # a clean stop releases it: the next node takes the run at once
        second = NodeProcess(str(tmp_path), name="node-b", local=str(tmp_path / "local-b")).start()
        with open(tmp_path / "object" / "gpt" / LEASE) as f:
            assert json.load(f)["node"] == "node-b"
    finally:
        first.stop()
        if second is not None and second.proc is not None:
            second.stop()
