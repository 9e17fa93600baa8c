"""flowcheck as DCP's storage backend for an FSDP2 trainer (flowcheck/dcp): 4 CPU ranks (gloo) train a tiny GPT and
``dcp.save`` step 3 through ``flowcheck.dcp.Writer`` (and through DCP's FileSystemWriter, the reference); the step
is one committed flowcheck step that audits clean, reloads through ``flowcheck.dcp.Reader`` bit for bit, and
resumes at 4 ranks (losses bit for bit), 2 and 8 ranks (DCP's own resharding; losses to float tolerance)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import flowcheck.dcp
from flowcheck.manifest import ParentRef
from flowcheck.store import open_store
from tests.dcp import fsdp

K, N = 3, 6  # save after step K, train to N


def config(root: str, object_url: str | None = None) -> str:
    path = os.path.join(root, "flowcheck.yaml")
    with open(path, "w") as f:
        f.write(f"run: gpt\ntiers:\n  local:\n    root: {root}/local\n  object:\n    url: {object_url or f'file://{root}/object'}\n"
                "policy:\n  object:\n    tmp_grace_seconds: 0.01\n  local:\n    tmp_grace_seconds: 0.01\n")
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """4 ranks trained to N, step K saved through flowcheck (local tier) and through FileSystemWriter."""
    root = str(tmp_path_factory.mktemp("dcp4"))
    cfg = config(root)
    fsdp.spawn(fsdp.train_and_save, 4, cfg, K, N, f"{root}/fs", f"{root}/losses.json")
    with open(f"{root}/losses.json") as f:
        losses = {int(k): v for k, v in json.load(f).items()}
    return {"root": root, "cfg": cfg, "fs": f"{root}/fs", "losses": losses}


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(flat(x, f"{key}.{i}."))
        else:
            out[key] = v
    return out


def cli(cfg: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, *args], check=False, capture_output=True, text=True,
                          timeout=120)


def test_a_4_rank_save_is_one_committed_step_of_every_rank_part_that_audits_clean(saved):
    store = open_store(saved["cfg"])
    assert store.local.steps() == [K]
    m = store.local.manifest(K)
    # one part per rank, and one of DCP's non-tensor items, each under the step's nodes/<part>/ (tiers/cluster.py)
    assert {f.path.split("/")[2] for f in m.files if f.path.count("/") > 2} == {
        "objects", "rank-00000", "rank-00001", "rank-00002", "rank-00003"}
    # FSDP2 shards dim 0 over the 4 ranks: DCP's chunks are the shards, in the global index space
    w = m.tensors["model.blocks.0.fc1.weight"]
    assert w.global_shape == (4 * fsdp.DIM, fsdp.DIM) and sorted(s.offsets for s in w.shards) == [
        (0, 0), (32, 0), (64, 0), (96, 0)]
    assert "_dcp_bytes.sched.last_epoch" in m.tensors  # a non-tensor item: its raw bytes, digest-checked
    assert not [n for n in os.listdir(store.local.root) if n.endswith(".tmp")]
    done = cli(saved["cfg"], "audit")
    assert done.returncode == 0 and "0 errors, 0 warnings" in done.stdout, done.stdout + done.stderr


def test_the_flowcheck_round_trip_equals_dcps_file_system_writer_bit_for_bit(saved):
    ours = flat(fsdp.full_state(flowcheck.dcp.Reader(saved["cfg"], step=K)))
    theirs = flat(fsdp.full_state(FileSystemReader(saved["fs"])))
    assert sorted(ours) == sorted(theirs)
    for key, want in theirs.items():
        got = ours[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), key
        else:
            assert got == want and type(got) is type(want), key


def test_resuming_at_the_same_world_size_continues_bit_for_bit(saved, tmp_path):
    fsdp.spawn(fsdp.resume, 4, saved["cfg"], K, N, str(tmp_path / "r4.json"))
    got = json.loads((tmp_path / "r4.json").read_text())
    assert got["start"] == K
    assert {int(s): v for s, v in got["losses"].items()} == {s: saved["losses"][s] for s in range(K + 1, N + 1)}


@pytest.mark.parametrize("world", [2, 8])
def test_resuming_at_another_world_size_reshards_through_dcps_planner(saved, tmp_path, world):
    fsdp.spawn(fsdp.resume, world, saved["cfg"], "latest", N, str(tmp_path / "r.json"))
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["start"] == K
    for s in range(K + 1, N + 1):
        assert math.isclose(got["losses"][str(s)], saved["losses"][s], rel_tol=1e-5), (s, got, saved["losses"])


def test_an_async_save_after_resuming_at_2_ranks_descends_from_the_loaded_step(saved, tmp_path):
    """4-rank step K resumed at 2 ranks (DCP reshards), trained one step and saved with ``dcp.async_save`` as step
    N + 1 while main also holds a newer step N: the parent is step K (what was loaded), on a branch of its own."""
    import shutil

    shutil.copytree(f"{saved['root']}/local", tmp_path / "local")  # the module's store stays as the others expect
    cfg = config(str(tmp_path))
    fsdp.spawn(fsdp.resume_async_save, 2, cfg, K, N, str(tmp_path / "r.json"))
    got = json.loads((tmp_path / "r.json").read_text())
    store = open_store(cfg)
    assert got["start"] == K and got["consumed"]  # the Writer consumed the resume point
    assert ParentRef(*got["parent"]) == store.local.manifest(K).parent_ref()
    assert store.local.steps() == [K, N]
    [branch] = store.local.branch_names()
    assert store.tier("local", branch).steps() == [N + 1]
    assert store.manifest(N + 1).parent == store.local.manifest(K).parent_ref()


def test_export_of_a_dcp_step_gives_the_full_tensors(saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "step.safetensors"
    done = cli(saved["cfg"], "export", "--step", str(K), "--out", str(out))
    assert done.returncode == 0, done.stderr
    exported = load_file(str(out))
    reference = flat(fsdp.full_state(FileSystemReader(saved["fs"])))
    tensors = {k: v for k, v in reference.items() if isinstance(v, torch.Tensor)}
    assert tensors and all(torch.equal(exported[k], v) for k, v in tensors.items())


def test_a_flipped_byte_in_a_dcp_written_step_is_found_by_audit(saved, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(saved["root"], root)
    cfg = config(str(root))
    m = open_store(cfg).local.manifest(K)
    victim = next(f.path for f in m.files if "rank-00002" in f.path and "/c/" in f.path)
    path = root / "local" / "gpt" / victim
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    done = cli(cfg, "audit")
    assert done.returncode == 1 and victim in done.stdout + done.stderr, done.stdout + done.stderr


def test_a_2d_fsdp_x_tp_save_round_trips_bit_for_bit_and_resumes_at_2_ranks_of_plain_fsdp(tmp_path):
    """4 ranks as a (dp=2, tp=2) mesh: TP cuts the MLP's columns/rows, FSDP shards what TP left (DCP's chunks are
    boxes of both); the step equals DCP's own copy, and a 1-D FSDP job of 2 ranks resumes it."""
    cfg = config(str(tmp_path))
    fsdp.spawn(fsdp.train_and_save, 4, cfg, K, N, str(tmp_path / "fs"), str(tmp_path / "l.json"), (2, 2))
    ours = flat(fsdp.full_state(flowcheck.dcp.Reader(cfg, step=K)))
    theirs = flat(fsdp.full_state(FileSystemReader(str(tmp_path / "fs"))))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], v) if isinstance(v, torch.Tensor) else ours[k] == v for k, v in theirs.items())
    fc1 = open_store(cfg).local.manifest(K).tensors["model.blocks.0.fc1.weight"]
    assert len(fc1.shards) == 4  # column-parallel, then FSDP: four boxes of the global weight
    losses = {int(k): v for k, v in json.loads((tmp_path / "l.json").read_text()).items()}
    fsdp.spawn(fsdp.resume, 2, cfg, K, N, str(tmp_path / "r.json"))
    got = json.loads((tmp_path / "r.json").read_text())
    for s in range(K + 1, N + 1):
        assert math.isclose(got["losses"][str(s)], losses[s], rel_tol=1e-5), (s, got, losses)


def test_a_rank_killed_mid_save_to_the_local_tier_leaves_nothing_committed_and_gc_removes_its_part(tmp_path):
    """Each rank writes its part straight into the save's ``step-….dcp-<id>.tmp`` folder (no part manifest, no rename):
    a rank killed after its part is in leaves that folder, never a step; GC removes it."""
    cfg = config(str(tmp_path))
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        fsdp.spawn(fsdp.async_save, 4, cfg, K, N, str(tmp_path / "fs"), str(tmp_path / "gate"),
                   str(tmp_path / "log.json"), 1, "local")
    store = open_store(cfg)
    assert store.local.steps() == [] and store.object.steps() == []
    run = tmp_path / "local" / "gpt"
    left = [p for p in run.iterdir() if p.name.startswith(f"step-{K:09d}.dcp-") and p.name.endswith(".tmp")]
    assert left and (left[0] / "nodes" / "rank-00001" / "zarr.json").exists()  # the killed rank had stored its part
    done = subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, "gc"], check=False, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    done = subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, "audit"], check=False,
                          capture_output=True, text=True)
    assert "0 errors" in done.stdout, done.stdout + done.stderr
