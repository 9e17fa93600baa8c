"""The node's /metrics: valid Prometheus text, and the values move with pushes, snapshots and uploads."""
from __future__ import annotations

import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from flowcheck.torch.checkpointer import Checkpointer

from ..capture.conftest import NodeProcess


def scrape(node: NodeProcess) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}, parsed by prometheus_client's own parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _train(model, opt, gen) -> None:
    model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_metrics_follow_pushes_snapshots_and_uploads(tmp_path):
    node = NodeProcess(str(tmp_path))
    with open(node.config) as f:  # uploads every 4 pushed steps; local snapshots on request only
        cfg = f.read().replace("  object:\n    every_seconds: null\n", "  object:\n    every_seconds: null\n    every_steps: 4\n")
    with open(node.config, "w") as f:
        f.write(cfg)
    node.start()
    try:
        before = scrape(node)
        assert value(before, "flowcheck_push_bytes_total") == 0
        assert value(before, "flowcheck_snapshot_transfer_seconds_count", tier="local") == 0
        assert value(before, "flowcheck_rss_bytes") > 0

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        with Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp", timeout_s=20) as ck:
            for step in (1, 2, 3):
                _train(model, opt, gen)
                assert ck.save(step)
            assert ck.flush(20), ck.stats.last_error
            node.wait_step(3)
            status, body = node.post("/snapshot")
            assert status == 200 and body["step"] == 3, body
            after = scrape(node)
            _train(model, opt, gen)
            assert ck.save(4)  # step 4: the policy uploads the newest local step (3) to the object tier
            assert ck.flush(20), ck.stats.last_error
        deadline = time.monotonic() + 60
        while (final := scrape(node)).get(("flowcheck_snapshot_transfer_seconds_count", (("tier", "object"),))) != 1:
            assert time.monotonic() < deadline, "no upload was recorded"
            time.sleep(0.2)
    finally:
        node.stop()

    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # params + two AdamW moments, fp32
    assert value(after, "flowcheck_push_steps_total") == 3 and value(after, "flowcheck_push_bytes_total") >= state_bytes
    assert value(after, "flowcheck_push_frames_total") >= 3
    assert value(after, "flowcheck_last_committed_step", tier="memory") == 3
    assert value(after, "flowcheck_last_committed_step", tier="local") == 3
    assert value(after, "flowcheck_last_committed_step", tier="object") is None  # nothing uploaded yet
    assert value(after, "flowcheck_tier_bytes", tier="memory") >= state_bytes
    written = value(after, "flowcheck_tier_written_bytes_total", tier="local")
    assert written >= state_bytes and value(after, "flowcheck_tier_bytes", tier="local") == written
    assert value(after, "flowcheck_tier_steps", tier="local") == 1
    for kind in ("queue", "transfer"):
        assert value(after, f"flowcheck_snapshot_{kind}_seconds_count", tier="local") == 1
        assert value(after, f"flowcheck_snapshot_{kind}_seconds_bucket", tier="local", le="+Inf") == 1
    assert value(after, "flowcheck_snapshot_transfer_seconds_sum", tier="local") > 0
    assert value(after, "flowcheck_policy_jobs_total", tier="local", outcome="committed") == 1

    assert value(final, "flowcheck_push_steps_total") == 4
    assert value(final, "flowcheck_last_committed_step", tier="object") == 3
    assert value(final, "flowcheck_tier_written_bytes_total", tier="object") > 0
    assert value(final, "flowcheck_snapshot_queue_seconds_count", tier="object") == 1
    assert value(final, "flowcheck_stale_iterations_total") == 0 and value(final, "flowcheck_memory_stale") == 0


def test_mirror_capture_metrics_count_recovered_and_lost_elements(tmp_path):
    from flowcheck import config as config_mod
    from flowcheck.node.service import Node
    from flowcheck.simulate import SimOptions, simulate

    # 2% loss at each of 3 mirror ports: most holes are filled from another port's copy, one is not
    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=3, loss=0.02, seed=3))
    (tmp_path / "node.yaml").write_text(
        "run: mirror\ntiers: {local: {root: ./local}, object: {url: file://./object}}\n"
        "policy: {local: {every_steps: 1, keep_last: 10}, object: {every_seconds: 3600}}\n"
        f"serve: {{push: 127.0.0.1:0, http: 127.0.0.1:0, mirror_job: {sim.out}/job.yaml, "
        f"mirror_pcaps: '{sim.out}/mirror-*.pcap'}}\n")
    node = Node(config_mod.load(str(tmp_path / "node.yaml"))).start()
    try:
        deadline = time.monotonic() + 120
        while node.mirror is None or node.mirror["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        node.policy.drain()
        with urllib.request.urlopen("http://%s:%d/metrics" % node.api.address, timeout=10) as r:
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    finally:
        node.stop()
    assert node.mirror["state"] == "done", node.mirror
    assert value(samples, "flowcheck_mirror_frames_total") > 0 and value(samples, "flowcheck_mirror_bytes_total") > 0
    assert value(samples, "flowcheck_mirror_packets_total", status="ok") == value(samples, "flowcheck_mirror_frames_total")
    assert value(samples, "flowcheck_mirror_packets_missing_total") > 0
    assert value(samples, "flowcheck_mirror_elements_recovered_total") > 0
    assert value(samples, "flowcheck_mirror_elements_lost_total") > 0
    assert value(samples, "flowcheck_mirror_allreduces_total", result="incomplete") == 1
    assert value(samples, "flowcheck_stale_iterations_total") == node.mirror["stale"] == 1
    assert value(samples, "flowcheck_resyncs_total") == len(node.mirror["resyncs"])
    assert value(samples, "flowcheck_resync_requests_total") == 1
    assert value(samples, "flowcheck_mirror_iterations_total") == node.mirror["iterations"]
    assert value(samples, "flowcheck_last_committed_step", tier="local") == node.store.local.steps()[-1]
