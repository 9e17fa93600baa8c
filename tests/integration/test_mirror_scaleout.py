"""Mirror capture scaled out: two real node processes, each fed the same simulated capture, each decoding and
updating half of the parameters; the cluster commit makes one step of their parts, equal bit for bit to what
one node (and the trainer) computes, with about half the placement work on each node."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from flowcheck.capture.mirror.decode import Decoded, decode, read_all
from flowcheck.capture.mirror.job import load_job
from flowcheck.capture.mirror.pipeline import load_state_file
from flowcheck.config import ClusterConfig, ObjectConfig
from flowcheck.simulate import SimOptions, simulate
from flowcheck.tiers.object import ObjectTier
from tests.mirror.test_live import veth  # noqa: F401 - the namespaces-and-veth fixture

NODES = ["m0", "m1"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp_path, sim_dir: str, node: str, *, wait_s: float = 120.0, exchange_wait_s: float = 120.0) -> str:
    i = NODES.index(node)
    path = tmp_path / f"{node}.yaml"
    path.write_text(
        f"run: mirror\nnode: {node}\n"
        f"cluster: {{nodes: [{', '.join(NODES)}], commit_wait_s: {wait_s}}}\n"
        f"tiers: {{local: {{root: ./{node}/local}}, object: {{url: 'file://{tmp_path / 'object'}'}}}}\n"
        "policy: {local: {every_steps: 2, keep_last: 10}, object: {every_seconds: 3600}}\n"
        f"serve: {{push: 127.0.0.1:0, http: 127.0.0.1:0, mirror_job: {sim_dir}/job.yaml, "
        f"mirror_pcaps: '{sim_dir}/mirror-*.pcap', mirror_partition: {{index: {i}, of: {len(NODES)}, "
        f"exchange: ./exchange, exchange_wait_s: {exchange_wait_s}}}}}\n"
    )
    return str(path)


def _run(configs: list[str]) -> list[tuple[int, dict]]:
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.mirror_node", "--config", c], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for c in configs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        lines = stdout.decode().strip().splitlines()
        out.append((p.returncode, json.loads(lines[-1]) if lines else {"stderr": stderr.decode()[-4000:]}))
    return out


def _reader(tmp_path) -> ObjectTier:
    return ObjectTier(ObjectConfig(url=f"file://{tmp_path / 'object'}"), "mirror", node="reader",
                      staging_dir=str(tmp_path / "reader-staging"), cluster=ClusterConfig(nodes=NODES))


def _single_node_placed(sim_dir: str) -> int:
    info = Decoded()
    for _ in decode(load_job(f"{sim_dir}/job.yaml"), read_all(sorted(
            os.path.join(sim_dir, f) for f in os.listdir(sim_dir) if f.startswith("mirror-"))), info):
        pass
    return info.placed_bytes


@pytest.mark.parametrize("clip", [0.1, None], ids=["clipped", "unclipped"])  # 0.1: the gradients here (norm ~0.7) are clipped
def test_two_nodes_each_update_half_and_commit_one_step_equal_to_the_trainers(tmp_path, clip):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=4, seed=5, clip=clip))
    results = _run([_config(tmp_path, sim.out, n) for n in NODES])
    for code, out in results:
        assert code == 0, out
        assert out["step"] == 4 and out["nodes"] == NODES and out["mirror"]["iterations"] == 4, out
    tier = _reader(tmp_path)
    truth = load_state_file(os.path.join(sim.out, "truth", "step-4.safetensors"))
    m = tier.manifest(4)
    assert set(m.tensors) == set(truth)  # the merged step covers the whole state
    for name, want in truth.items():
        got = tier.read(4, name)
        assert got.tobytes() == want.numpy().tobytes(), name
    assert tier.verify(4) == []
    # each node placed about half of what one node places: whole parameters, and a send that straddles the two
    # parts is placed by both (the sum exceeds one node's by those sends)
    placed = [out["mirror"]["placed_bytes"] for _, out in results]
    single = _single_node_placed(sim.out)
    assert single <= sum(placed) < 1.25 * single
    assert all(0.4 * single < p < 0.65 * single for p in placed), (placed, single)


def test_a_missing_node_leaves_the_step_uncommitted(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=2, iters=2, seed=1, clip=None))
    [(code, out)] = _run([_config(tmp_path, sim.out, "m0", wait_s=0.5)])
    assert code == 3 and "m1" in out["incomplete"], out
    tier = _reader(tmp_path)
    assert tier.steps() == []


def test_a_clipping_node_whose_peer_never_reports_goes_stale_never_wrong(tmp_path):
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=2, iters=2, seed=1))
    os.rename(os.path.join(sim.out, "truth"), os.path.join(sim.out, "no-truth"))  # no resync stand-in
    os.makedirs(os.path.join(sim.out, "truth"))
    os.rename(os.path.join(sim.out, "no-truth", "step-0.safetensors"), os.path.join(sim.out, "truth", "step-0.safetensors"))
    [(code, out)] = _run([_config(tmp_path, sim.out, "m0", wait_s=0.5, exchange_wait_s=0.5)])
    assert code == 5 and out["mirror"]["stale"] == 1 and out["mirror"]["iterations"] == 0, out


def test_two_nodes_capture_one_veth_live_each_its_part(veth, tmp_path):  # noqa: F811 - the imported fixture
    """Both node processes listen on the same mirror interface (as with switch multicast: every node gets every
    frame) inside the receiving namespace; a simulated training's frames are sent once; each node updates its part
    and the cluster commit makes the step, equal to the trainer's bit for bit."""
    from tests.mirror.test_live import InNetns, send_one, send_paced, simulated_frames

    rx, tx = veth
    sim, frames = simulated_frames(tmp_path, iters=3, seed=12)
    configs = []
    for n in NODES:
        path = _config(tmp_path, sim.out, n)
        text = open(path).read().replace(f"mirror_pcaps: '{sim.out}/mirror-*.pcap'",
                                         "mirror_interface: fcrx0, mirror_settle_s: 0.2")
        open(path, "w").write(text)
        configs.append(path)
    procs = [subprocess.Popen(["ip", "netns", "exec", rx, sys.executable, "-m", "tests.integration.mirror_node",
                               "--config", c, "--until-step", "3", "--ready", f"{c}.ready", "--deadline", "90"],
                              cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for c in configs]
    try:
        deadline = time.time() + 60
        while not all(os.path.exists(f"{c}.ready") for c in configs):  # both sockets are up once frames are counted
            assert time.time() < deadline and all(p.poll() is None for p in procs), "the nodes never counted a frame"
            InNetns(tx, send_one, "fctx0").result()
            time.sleep(0.1)
        InNetns(tx, send_paced, "fctx0", frames).result(60)
        results = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            lines = stdout.decode().strip().splitlines()
            results.append((p.returncode, json.loads(lines[-1]) if lines else {"stderr": stderr.decode()[-4000:]}))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [code for code, _ in results] == [0, 0], json.dumps(results)
    for code, out in results:
        assert out["step"] == 3 and out["nodes"] == NODES and out["mirror"]["stale"] == 0, out
    tier = _reader(tmp_path)
    truth = load_state_file(os.path.join(sim.out, "truth", "step-3.safetensors"))
    assert set(tier.manifest(3).tensors) == set(truth)
    for name, want in truth.items():
        assert tier.read(3, name).tobytes() == want.numpy().tobytes(), name
    placed = [out["mirror"]["placed_bytes"] for _, out in results]
    single = _single_node_placed(sim.out)
    assert all(0.4 * single < p < 0.65 * single for p in placed), (placed, single)
