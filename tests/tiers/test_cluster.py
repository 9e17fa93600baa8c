"""Multi-node steps in one process: the merge rules, the v2 manifest, refusals, and audit naming the node."""
from __future__ import annotations

import json

import pytest

from flowcheck.config import ClusterConfig, ObjectConfig
from flowcheck.errors import ClusterError, ManifestError, StepIncompleteError
from flowcheck.manifest import parse
from flowcheck.state import Shard, Snapshot
from flowcheck.tiers import cluster
from flowcheck.tiers.object import ObjectTier
from tests.integration.multinode_node import BIG, COUNT, ROWS, full_state, node_snapshot

NODES = ["n0", "n1", "n2"]


def node_tier(tmp_path, node: str, wait_s: float = 0.05) -> ObjectTier:
    return ObjectTier(ObjectConfig(url=f"file://{tmp_path / 'object'}", max_file_mib=1), "gpt",
                      staging_dir=str(tmp_path / node / "staging"), node=node,
                      cluster=ClusterConfig(nodes=NODES, commit_wait_s=wait_s))


def write_all(tmp_path, step: int = 10, snapshots=None):
    """n0 and n1 give up waiting (the step is incomplete until n2); n2, last, commits the step."""
    snapshots = snapshots or {n: node_snapshot(step, NODES, n) for n in NODES}
    for n in ("n0", "n1"):
        with pytest.raises(StepIncompleteError, match=r"still missing \['n1', 'n2'\]|still missing \['n2'\]"):
            node_tier(tmp_path, n).write(snapshots[n])
        assert step not in node_tier(tmp_path, n).steps()
    return node_tier(tmp_path, "n2").write(snapshots["n2"])


def test_the_last_node_commits_a_v2_step_manifest_listing_every_part(tmp_path):
    m = write_all(tmp_path)
    reader = node_tier(tmp_path, "n0")
    assert reader.steps() == [10] and reader.manifest(10) == m
    raw = json.loads((tmp_path / "object" / "gpt" / "step-000000010" / "manifest.json").read_bytes())
    assert raw["format_version"] == 2 and [n["node"] for n in raw["nodes"]] == NODES
    parts = {n: parse((tmp_path / "object" / "gpt" / cluster.part_manifest(10, n)).read_bytes(), n) for n in NODES}
    assert [r.manifest_digest for r in m.nodes] == [parts[n].digest() for n in NODES]
    for name, want in full_state(10).items():
        assert reader.read(10, name).tobytes() == want.tobytes()
    assert reader.verify(10) == []
    # a node writing again (a retry) gets the committed step back
    assert node_tier(tmp_path, "n1").write(node_snapshot(10, NODES, "n1")) == m


def test_parent_of_a_step_is_the_previous_step_manifest(tmp_path):
    m10 = write_all(tmp_path, 10)
    m20 = write_all(tmp_path, 20)
    assert m10.parent is None and m20.parent == m10.parent_ref()


def test_a_damaged_file_is_reported_with_the_node_that_wrote_it(tmp_path):
    write_all(tmp_path)
    victim = sorted((tmp_path / "object" / "gpt" / cluster.part_dir(10, "n1")).glob("attempt-*/*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    problems = node_tier(tmp_path, "n0").verify(10)
    assert problems and all("node n1:" in p.what for p in problems), [str(p) for p in problems]
    assert any(victim.name in p.path for p in problems)


def test_a_replaced_part_manifest_is_caught_by_its_listed_digest(tmp_path):
    write_all(tmp_path)
    path = tmp_path / "object" / "gpt" / cluster.part_manifest(10, "n2")
    other = parse(path.read_bytes(), "n2")
    forged = type(other)(**{**other.__dict__, "created_at": "2000-01-01T00:00:00.000000Z"})
    path.write_bytes(forged.to_bytes())
    problems = node_tier(tmp_path, "n0").verify(10, data=False)
    assert any("node n2: part manifest digest" in p.what for p in problems), [str(p) for p in problems]


def _with_shards(snapshot: Snapshot, shards: list[Shard]) -> Snapshot:
    state = full_state(snapshot.step)
    data = {s: state[s.tensor][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape))].copy() for s in shards}
    return Snapshot(snapshot.run, snapshot.step, snapshot.layout, data, snapshot.scalars)


def test_overlapping_parts_refuse_to_commit(tmp_path):
    snaps = {n: node_snapshot(10, NODES, n) for n in NODES}
    n2 = list(snaps["n2"].data) + [Shard(ROWS, (2, 0), (4, 8))]  # also claims half of n0's and n1's rows
    snaps["n2"] = _with_shards(snaps["n2"], n2)
    with pytest.raises(ClusterError, match=rf"tensor {ROWS}: node n\d's shard .* overlaps node n2's shard"):
        write_all(tmp_path, snapshots=snaps)
    assert node_tier(tmp_path, "n0").steps() == []
    assert (tmp_path / "object" / "gpt" / "step-000000010").exists()  # parts stay for GC to remove


def test_parts_that_leave_a_hole_refuse_to_commit(tmp_path):
    snaps = {n: node_snapshot(10, NODES, n) for n in NODES}
    snaps["n1"] = _with_shards(snaps["n1"], [s for s in snaps["n1"].data if s.tensor not in (BIG, COUNT)])
    with pytest.raises(ClusterError, match=rf"tensor {BIG}: expected the node parts to cover all 786432 elements .* found 524288"):
        write_all(tmp_path, snapshots=snaps)
    assert node_tier(tmp_path, "n2").steps() == []


def test_parts_of_different_states_refuse_to_commit(tmp_path):
    snaps = {n: node_snapshot(10, NODES, n) for n in NODES}
    s = snaps["n2"]
    snaps["n2"] = Snapshot(s.run, s.step, s.layout, s.data, type(s.scalars)(optimizer_step=11))
    with pytest.raises(ClusterError, match="disagree on 'scalars'"):
        write_all(tmp_path, snapshots=snaps)


def test_a_part_from_an_unlisted_node_refuses_to_commit(tmp_path):
    stray = ObjectTier(ObjectConfig(url=f"file://{tmp_path / 'object'}", max_file_mib=1), "gpt",
                       staging_dir=str(tmp_path / "x"), node="n9",
                       cluster=ClusterConfig(nodes=[*NODES, "n9"], commit_wait_s=0.05))
    with pytest.raises(StepIncompleteError):
        stray.write(node_snapshot(10, NODES, "n0"))
    with pytest.raises(ClusterError, match=r"parts of nodes \['n9'\] that cluster.nodes"):
        write_all(tmp_path)


def test_v1_manifests_cannot_carry_nodes_and_v2_must(tmp_path):
    m = write_all(tmp_path)
    raw = json.loads(m.to_bytes())
    for version, nodes, match in ((1, raw["nodes"], "no 'nodes' in a format_version 1"), (2, [], "non-empty list")):
        body = {k: v for k, v in raw.items() if k != "integrity"}
        body.update(format_version=version, nodes=nodes)
        from flowcheck.digest import sha256
        from flowcheck.manifest import canonical_json

        body["integrity"] = sha256(canonical_json(body))
        with pytest.raises(ManifestError, match=match):
            parse(canonical_json(body), "m.json")


def test_audit_of_a_node_treats_its_local_copy_as_its_part_of_the_step(tmp_path):
    from flowcheck.audit import audit
    from flowcheck.config import Config, LocalConfig, TiersConfig
    from flowcheck.store import Store

    for n in ("n0", "n1"):
        with pytest.raises(StepIncompleteError):
            node_tier(tmp_path, n).write(node_snapshot(10, NODES, n))
    store = Store(Config(run="gpt", node="n2", cluster=ClusterConfig(nodes=NODES), tiers=TiersConfig(
        local=LocalConfig(root=str(tmp_path / "n2-local")),
        object=ObjectConfig(url=f"file://{tmp_path / 'object'}", max_file_mib=1))))
    local = store.write(node_snapshot(10, NODES, "n2"), "local")
    step = store.promote(10)  # n2's part is its local step, digest kept; n2 is last: the step commits
    assert step.nodes[2].manifest_digest == local.digest() and store.object.steps() == [10]
    report = audit(store)
    assert report.ok and not report.problems, [str(p) for p in report.problems]
    assert [sorted(n.tiers) for n in report.nodes.values()] == [["local", "object"]]
