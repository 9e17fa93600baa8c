"""`flowcheck serve` with a mirror-capture file source: the node replays captures into RAM and snapshots by policy."""
from __future__ import annotations

import time

import numpy as np
import pytest

from flowcheck import config as config_mod
from flowcheck.errors import ConfigError
from flowcheck.node.service import Node
from flowcheck.simulate import SimOptions, simulate


def _config(tmp_path, sim_dir: str, mirror: str, extra: str = ""):
    path = tmp_path / "node.yaml"
    path.write_text(
        "run: mirror\n"
        "tiers: {local: {root: ./local}, object: {url: file://./object}}\n"
        "policy: {local: {every_steps: 2, keep_last: 10}, object: {every_seconds: 3600}}\n"
        "serve: {push: 127.0.0.1:0, http: 127.0.0.1:0, "
        f"mirror_job: {sim_dir}/job.yaml, mirror_pcaps: '{sim_dir}/{mirror}'{extra}}}\n"
    )
    return config_mod.load(str(path))


def _run_node(cfg) -> Node:
    node = Node(cfg).start()
    try:
        deadline = time.time() + 120
        while (node.mirror is None or node.mirror["state"] == "running") and time.time() < deadline:
            time.sleep(0.2)
        node.policy.drain()
        return node
    finally:
        node.stop()


def test_node_replays_mirror_captures_and_snapshots(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=6, seed=3))
    node = _run_node(_config(tmp_path, sim.out, "mirror-*.pcap"))
    assert node.mirror["state"] == "done" and node.mirror["iterations"] == 6, node.mirror
    assert node.store.memory.step == 6 and not node.store.memory.stale
    assert node.store.local.steps() and node.status()["resync"] is None


def test_a_node_decoding_on_two_workers_holds_the_same_state_bit_for_bit(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=4, loss=0.01, seed=5))
    states = []
    for workers in (1, 2):
        here = tmp_path / f"k{workers}"
        here.mkdir()
        cfg = _config(here, sim.out, "mirror-*.pcap", f", mirror_decode_workers: {workers}")
        assert cfg.serve.mirror_decode_workers == workers
        node = _run_node(cfg)
        assert node.mirror["state"] == "done" and node.mirror["iterations"] == 4, node.mirror
        snap = node.store.memory.pin()
        states.append({s: np.ascontiguousarray(snap.array(s)).reshape(-1) for s in snap.data})
        node.store.memory.release(snap)
    assert states[0].keys() == states[1].keys()
    assert all(np.array_equal(states[0][s].view(np.uint8), states[1][s].view(np.uint8)) for s in states[0])


@pytest.mark.parametrize("value", [0, -1, 1.5, "two", True])
def test_mirror_decode_workers_must_be_a_whole_number(tmp_path, value):
    sim_dir = tmp_path / "sim"
    with pytest.raises(ConfigError, match=r"serve.mirror_decode_workers.*expected"):
        _config(tmp_path, str(sim_dir), "mirror-*.pcap", f", mirror_decode_workers: {value!r}")


def test_node_asks_for_a_resync_when_an_iteration_is_unrecoverable(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=2, mirror="0:out", seed=3))
    (tmp_path / "sim" / "truth").rename(tmp_path / "sim" / "no-truth")  # no stand-in for the trainer's push
    (tmp_path / "sim" / "no-truth" / "step-0.safetensors").rename(tmp_path / "sim" / "step-0.safetensors")
    job = (tmp_path / "sim" / "job.yaml")
    job.write_text(job.read_text().replace("truth/step-0.safetensors", "step-0.safetensors"))
    node = _run_node(_config(tmp_path, sim.out, "mirror-*.pcap"))
    assert node.mirror["state"] == "done" and node.mirror["stale"] == 1
    assert node.store.memory.stale and "mirror capture, iteration 1" in node.status()["resync"]["reason"]
    assert node.store.local.steps() == []  # a stale state is never snapshotted


def test_mirror_source_needs_both_job_and_captures(tmp_path):
    with pytest.raises(ConfigError, match="mirror_job and serve.mirror_pcaps"):
        config_mod.ServeConfig(mirror_job="j.yaml")
