"""flowcheck.dcp in one process (``no_dist``): lineage of saves after a resume, DCP's non-tensor items and where they
are (never) unpickled, ``flowcheck import`` of a plain DCP directory, and the errors a user meets."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import flowcheck.dcp
from flowcheck import dtypes
from flowcheck.errors import ConfigError, FlowcheckError, StepNotFoundError
from flowcheck.manifest import ParentRef
from flowcheck.store import open_store
from tests.dcp.test_dcp_fsdp import config, flat

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16),
                      "odd key/with slash": torch.arange(5)},
            "sched": {"last_epoch": seed, "lrs": [0.1, 0.2], "betas": (0.9, 0.95)}, "step": seed}


def zeros_like(s: dict) -> dict:
    return {k: zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in s.items()}


def save(cfg: str, s: dict, step: int, **kw) -> flowcheck.dcp.Writer:
    w = flowcheck.dcp.Writer(cfg, step=step, **kw)
    dcp.save(s, storage_writer=w, no_dist=True)
    return w


def load(cfg_or_reader, s: dict, **kw) -> dict:
    reader = cfg_or_reader if isinstance(cfg_or_reader, flowcheck.dcp.Reader) else flowcheck.dcp.Reader(cfg_or_reader, **kw)
    dcp.load(s, storage_reader=reader, no_dist=True)
    return s


def same(a: dict, b: dict) -> bool:
    fa, fb = flat(a), flat(b)
    return sorted(fa) == sorted(fb) and all(
        torch.equal(fa[k], v) if isinstance(v, torch.Tensor) else fa[k] == v and type(fa[k]) is type(v) for k, v in fb.items())


@pytest.mark.parametrize("tier", ["local", "object"])
def test_a_state_with_tensors_and_python_values_round_trips_exactly_in_either_tier(tmp_path, tier):
    cfg = config(str(tmp_path))
    save(cfg, state(3), 3, tier=tier)
    assert same(load(cfg, zeros_like(state(3)), step=3), state(3))
    assert getattr(open_store(cfg), tier).steps() == [3]


def test_saves_after_a_resume_are_a_branch_of_the_resumed_step_and_then_continue_it(tmp_path):
    cfg = config(str(tmp_path))
    save(cfg, state(5), 5)
    first = save(cfg, state(10), 10).committed
    assert first.parent.step == 5  # "auto": the current branch's newest step before this one
    reader = flowcheck.dcp.Reader(cfg, step=5)
    load(reader, zeros_like(state(5)))
    assert reader.resumed.step == 5
    resumed = save(cfg, state(8), 8, parent=reader).committed
    assert resumed.parent == reader_ref(cfg, 5) and reader.resumed is None  # consumed: later saves continue
    later = save(cfg, state(12), 12, parent=reader).committed
    assert later.parent == resumed.parent_ref()
    store = open_store(cfg)
    assert store.local.steps() == [5, 10]  # main keeps the first lineage, whole
    branch = store.local.branch_names()
    assert len(branch) == 1 and store.tier("local", branch[0]).steps() == [8, 12]
    assert same(load(cfg, zeros_like(state(12)), step="latest"), state(12))  # latest follows the new branch


def reader_ref(cfg: str, step: int) -> ParentRef:
    return open_store(cfg).local.manifest(step).parent_ref()


class Payload:
    """A pickle that runs a command when unpickled (the attack a stored non-tensor item could carry)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_stored_pickle_payload_is_never_run_and_loading_it_is_refused_naming_the_item(tmp_path):
    cfg = config(str(tmp_path))
    marker = tmp_path / "pwned"
    save(cfg, {"w": torch.ones(3), "evil": Payload(str(marker))}, 1)
    assert not marker.exists()
    with pytest.raises(CheckpointException, match=r"DCP item 'evil': refused to unpickle global posix.system"):
        load(cfg, {"w": torch.zeros(3), "evil": None}, step=1)
    assert not marker.exists()
    got = load(cfg, {"w": torch.zeros(3)}, step=1)  # the tensors load without it
    assert torch.equal(got["w"], torch.ones(3))


def test_flowcheck_import_takes_a_dcp_directory_tensors_only_unless_trusted(tmp_path):
    src = tmp_path / "dcp"
    dcp.save(state(4), checkpoint_id=str(src), no_dist=True)
    cfg = config(str(tmp_path))
    run = [sys.executable, "-m", "flowcheck", "--config", cfg, "import"]
    done = subprocess.run([*run, "--step", "4", str(src)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "4 non-tensor item(s) not imported" in done.stderr and "--trust-pickle" in done.stderr
    tensors_only = {"model": zeros_like(state(4))["model"]}
    assert same(load(cfg, tensors_only, step=4), {"model": state(4)["model"]})
    done = subprocess.run([*run, "--step", "5", "--trust-pickle", str(src)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert same(load(cfg, zeros_like(state(4)), step=5), state(4))
    m = open_store(cfg).manifest(5)  # a second import is a lineage of its own: a branch (docs/format.md, "Branches")
    assert m.producer.source == "import" and "_dcp_bytes.sched.lrs" in m.tensors


def test_importing_a_pickle_payload_with_trust_stores_it_without_running_it(tmp_path):
    src, marker = tmp_path / "dcp", tmp_path / "pwned"
    dcp.save({"w": torch.ones(2), "evil": Payload(str(marker))}, checkpoint_id=str(src), no_dist=True)
    cfg = config(str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, "import", "--step", "1",
                           "--trust-pickle", str(src)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    with pytest.raises(CheckpointException, match="refused to unpickle"):
        load(cfg, {"w": torch.zeros(2), "evil": None}, step=1)
    assert not marker.exists()


def test_writer_and_reader_arguments_are_checked_with_what_to_do(tmp_path):
    cfg = config(str(tmp_path))
    with pytest.raises(ConfigError, match="step: expected a non-negative integer"):
        flowcheck.dcp.Writer(cfg, step=-1)
    with pytest.raises(ConfigError, match="tier: expected one of"):
        flowcheck.dcp.Writer(cfg, step=1, tier="memory")
    with pytest.raises(ConfigError, match="prefer: expected"):
        flowcheck.dcp.Reader(cfg, prefer="memory")
    with pytest.raises(ConfigError, match="use_collectives=True"):
        dcp.save({"w": torch.ones(1)}, storage_writer=flowcheck.dcp.Writer(cfg, step=1), use_collectives=False,
                 no_dist=True)
    with pytest.raises(StepNotFoundError, match="no committed step"):
        load(cfg, {"w": torch.zeros(1)}, step="latest")


def test_a_reader_of_nothing_loadable_is_refused_in_its_constructor_with_one_flowcheck_error(tmp_path):
    """Not DCP's CheckpointException (a BaseException) after two logged tracebacks inside ``dcp.load``."""
    cfg = config(str(tmp_path))
    save(cfg, state(3), 3)
    cases = [({"step": 9}, "step 9 is not committed on branch 'main'"),
             ({"step": "nine"}, "step: expected a step number, 'latest' or a manifest digest prefix"),
             ({"step": True}, "step: expected a step number"),
             ({"step": "sha256:00000000"}, "has a manifest digest starting 'sha256:00000000'"),
             ({"run": "other"}, "run 'other' has no committed step"),
             ({"run": "../up"}, "run name '../up' is not allowed"),
             ({"branch": "nope"}, "has no branch 'nope'")]
    for kw, said in cases:
        with pytest.raises(FlowcheckError, match=re.escape(said)):
            flowcheck.dcp.Reader(cfg, **kw)
    missing = str(tmp_path / "no-such-folder")
    with pytest.raises(StepNotFoundError, match=f"local folder {re.escape(missing)} does not exist"):
        flowcheck.dcp.Reader(missing, run="gpt")


def test_a_url_or_a_folder_is_a_store_of_its_own(tmp_path):
    save(f"file://{tmp_path}/obj", state(2), 2, run="gpt")
    assert same(load(f"file://{tmp_path}/obj", zeros_like(state(2)), run="gpt"), state(2))
    save(str(tmp_path / "nvme"), state(6), 6, run="gpt")
    assert os.path.isdir(tmp_path / "nvme" / "gpt" / "step-000000006")
    assert same(load(str(tmp_path / "nvme"), zeros_like(state(6)), run="gpt"), state(6))


def test_a_rank_reads_its_shards_from_a_pack_in_one_pass_and_a_damaged_pack_is_read_from_an_intact_copy(tmp_path):
    """The local tier's shards lie back to back in a pack: one run, one read, every shard still checked against its
    own digest; a flipped byte fails the run, and then each shard is read alone (falling back to the object copy)."""
    import dataclasses

    from flowcheck.errors import IntegrityError
    from flowcheck.tiers.local import packed_runs

    cfg = config(str(tmp_path))
    save(cfg, state(3), 3)
    store = open_store(cfg)
    m = store.local.manifest(3)
    items = [(n, e) for n, t in m.tensors.items() for e in t.shards]
    runs, rest = packed_runs(items, 1 << 24)
    assert not rest and len(runs) < len(items)
    run = max(runs, key=len)
    assert [a.size for a in store.local.read_packed_run(m, run)] == [math.prod(e.shape) for _, e in run]
    name, entry = run[-1]
    wrong = dataclasses.replace(entry, digest="xxh3-128:" + "0" * 32)
    with pytest.raises(IntegrityError, match="data digest"):
        store.local.read_packed_run(m, [*run[:-1], (name, wrong)])
    # into a caller's buffers (dcp.Reader: DCP's destination tensors): the same bytes, in those buffers, still checked
    import numpy as np

    into = [np.zeros(math.prod(e.shape), dtypes.dtype(m.tensors[n].dtype).storage).view(np.uint8) for n, e in run]
    got = store.local.read_packed_run(m, run, 1, into)
    assert all(np.shares_memory(g, d) for g, d in zip(got, into))
    assert all(np.array_equal(g, a) for g, a in zip(got, store.local.read_packed_run(m, run)))
    with pytest.raises(IntegrityError, match="data digest"):
        store.local.read_packed_run(m, [*run[:-1], (name, wrong)], 1, into)
    with pytest.raises(ValueError, match="destination of"):
        store.local.read_packed_run(m, run, 1, [d[:-1] for d in into])

    store.promote(3)
    pack = next(f.path for f in m.files if f.path.endswith("/c/0") and "rank-" in f.path)
    path = tmp_path / "local" / "gpt" / pack
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x01
    path.write_bytes(bytes(raw))
    assert same(load(cfg, zeros_like(state(3)), step=3), state(3))  # auto: the object tier's intact copy
    with pytest.raises(CheckpointException, match="CRC32C|digest"):
        load(cfg, zeros_like(state(3)), step=3, prefer="local")


def test_the_prefetch_asks_the_kernel_for_a_parts_packs_in_the_order_the_reads_take_them_up_to_its_budget(tmp_path):
    """``LocalTier.will_need`` (what a ``dcp.Reader`` rank starts before it parses the manifest): the pack files under
    the folder asked for, in ``packed_runs`` order, from their first byte, stopping at the budget; a load with it on
    reads the same state."""
    from unittest import mock

    from flowcheck.tiers.local import packed_runs

    g = torch.Generator().manual_seed(5)
    big = {"model": {"a": torch.randn(40_000, generator=g), "c": torch.randn(30_000, generator=g),
                     "b": torch.randn(3_000, generator=g).to(torch.bfloat16)}}  # two packs
    cfg = config(str(tmp_path))
    save(cfg, big, 3)
    store = open_store(cfg)
    m = store.local.manifest(3)
    runs, _ = packed_runs([(n, e) for n, t in m.tensors.items() for e in t.shards], 1 << 62)
    packs = [run[0][1].location[0].path + "/c/0" for run in runs]  # the order the reads take
    asked: list[tuple[str, int, int]] = []

    def fadvise(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        asked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))

    def size(rel: str) -> int:
        return os.path.getsize(os.path.join(store.local.root, rel))

    with mock.patch.object(os, "posix_fadvise", fadvise):
        store.local.will_need(3, "", 1 << 40)
    assert len(packs) >= 2 and [(p.removeprefix(store.local.root + "/"), o, n) for p, o, n in asked] == \
        [(rel, 0, size(rel)) for rel in packs]
    asked.clear()
    with mock.patch.object(os, "posix_fadvise", fadvise):
        store.local.will_need(3, "", size(packs[0]) + 1000)  # the budget ends 1000 bytes into the second pack
    assert [(o, n) for _, o, n in asked] == [(0, size(packs[0])), (0, 1000)]
    asked.clear()
    with mock.patch.object(os, "posix_fadvise", fadvise):
        store.local.will_need(3, "nodes/rank-00009", 1 << 40)  # a rank with no part of its own: nothing
        store.local.will_need(99, "", 1 << 40)  # no such step: nothing (the read says what is wrong)
    assert asked == []
    assert same(load(cfg, zeros_like(big), step=3), big)


def async_save(cfg: str, s: dict, step: int, **kw) -> flowcheck.dcp.Writer:
    w = flowcheck.dcp.Writer(cfg, step=step, **kw)
    dcp.async_save(s, storage_writer=w, no_dist=True).result()
    return w


def test_async_saves_stage_into_the_last_copy_once_it_is_stored_and_never_while_a_save_still_writes_it(tmp_path):
    """``dcp.async_save`` blocks on the copy into CPU memory: the Writer stages into the copy the previous save used
    (no fresh pages to fault in), but only once that save stored it; an async save started while the previous one
    still writes gets a copy of its own, and every step holds exactly the state it was given."""
    import threading
    from unittest import mock

    from flowcheck.dcp import parts, staging

    cfg = config(str(tmp_path))
    key = (flowcheck.dcp.Writer(cfg, step=0).config.run, "local")
    staging.forget(key)
    async_save(cfg, state(1), 1)
    first = staging._LATEST[key]
    assert not first.busy
    async_save(cfg, state(2), 2)
    assert staging._LATEST[key] is first and not first.busy  # reused, and free again once stored

    gate, real = threading.Event(), parts.write_part

    def slow(store, target, snap, node):  # step 3's upload waits until step 4 has been staged
        if target.step == 3:
            assert gate.wait(30)
        return real(store, target, snap, node)

    with mock.patch.object(parts, "write_part", slow):
        w3 = flowcheck.dcp.Writer(cfg, step=3)
        f3 = dcp.async_save(state(3), storage_writer=w3, no_dist=True)  # returns once staged; the write waits
        assert staging._LATEST[key] is first and first.busy
        f4 = dcp.async_save(state(4), storage_writer=flowcheck.dcp.Writer(cfg, step=4), no_dist=True)
        second = staging._LATEST[key]
        assert second is not first  # step 3 still writes from `first`: step 4 got a copy of its own
        gate.set()
        f3.result(), f4.result()
    for step in (1, 2, 3, 4):
        assert same(load(cfg, zeros_like(state(step)), step=step), state(step)), step
    other = {**state(5), "model": {**state(5)["model"], "w": torch.randn(3, 4)}}  # a shape changed: a new copy
    async_save(cfg, other, 5)
    assert staging._LATEST[key] not in (first, second)
    assert same(load(cfg, zeros_like(other), step=5), other)
    staging.forget(key)
    async_save(cfg, state(6), 6, reuse_staging=False)
    assert key not in staging._LATEST


def test_async_saves_after_a_resume_descend_from_the_step_the_reader_loaded(tmp_path):
    """The resume lineage through ``dcp.async_save`` (the save runs on DCP's thread, from its staged copy): the
    first save after loading step 5 names step 5 as its parent even at step 11, where "the newest smaller step"
    (``parent="auto"``) would be 10; later saves continue the new branch."""
    cfg = config(str(tmp_path))
    save(cfg, state(5), 5)
    save(cfg, state(10), 10)
    reader = flowcheck.dcp.Reader(cfg, step=5)
    load(reader, zeros_like(state(5)))
    first = async_save(cfg, state(11), 11, parent=reader).committed
    assert first.parent == reader_ref(cfg, 5) and reader.resumed is None
    later = async_save(cfg, state(12), 12, parent=reader).committed
    assert later.parent == first.parent_ref()
    store = open_store(cfg)
    assert store.local.steps() == [5, 10]  # main keeps the first lineage, whole
    [branch] = store.local.branch_names()
    assert store.tier("local", branch).steps() == [11, 12]
    assert store.manifest(12).digest() == later.digest()  # latest follows the resumed branch
    assert same(load(cfg, zeros_like(state(11)), step=11), state(11))


@pytest.mark.parametrize("tier", ["local", "object"])
def test_an_identical_resave_is_a_no_op_and_another_state_at_that_step_is_a_new_branch(tmp_path, tier):
    """docs/format.md, "Branches": the same state committed twice at one step is a no-op; a different state at a
    step the run holds is kept beside it on a branch of its own, never over it — both stay addressable."""
    cfg = config(str(tmp_path))
    save(cfg, state(3), 3, tier=tier)
    first = save(cfg, state(4), 4, tier=tier).committed
    again = save(cfg, state(4), 4, tier=tier).committed
    store = open_store(cfg)
    held = getattr(store, tier)
    assert again.digest() == first.digest() and held.steps() == [3, 4]
    assert all(store.tier(tier, b).steps() == [] for b in held.branch_names())  # nothing stored twice
    left = [p for p in (tmp_path / tier).rglob("*") if ".tmp" in str(p) or "branches" in str(p) and p.is_file()
            and p.name != "branch.json"]
    assert left == []  # the discarded save's parts are gone, not left for GC

    other = save(cfg, state(99), 4, tier=tier).committed
    store = open_store(cfg)
    held = getattr(store, tier)
    assert other.digest() != first.digest() and other.parent == first.parent
    assert held.steps() == [3, 4] and held.manifest(4).digest() == first.digest()  # main's step 4 untouched
    assert [b for b in held.branch_names() if store.tier(tier, b).steps() == [4]] != []
    assert same(load(cfg, zeros_like(state(4)), step=first.digest()[:20]), state(4))
    assert same(load(cfg, zeros_like(state(99)), step=other.digest()[:20]), state(99))
    assert same(load(cfg, zeros_like(state(99)), step="latest"), state(99))  # the newest commit is current
    done = subprocess.run([sys.executable, "-m", "flowcheck", "--config", cfg, "audit"], check=False,
                          capture_output=True, text=True)
    assert done.returncode == 0 and " 0 errors" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("path", [[10**12], [["nested"]], [], ["x"] * 100, "model"])
def test_a_forged_planner_data_path_in_a_stored_step_is_a_manifest_error_before_dcp_rebuilds_anything(tmp_path, path):
    """DCP's ``_load_state_dict_from_keys`` rebuilds the nested state dict from the metadata's planner_data: a huge
    list index there was a MemoryError, a nested list a TypeError.  The stored index is checked when it is read."""
    import json

    from flowcheck.digest import sha256
    from flowcheck.manifest import canonical_json
    from flowcheck.errors import ManifestError

    cfg = config(str(tmp_path))
    save(cfg, state(1), 3)
    manifest = tmp_path / "local" / "gpt" / "step-000000003" / "manifest.json"
    body = json.loads(manifest.read_text())
    body["scalars"]["extra"]["dcp"]["planner_data"]["model.w"] = path
    body.pop("integrity")
    body["integrity"] = sha256(canonical_json(body))  # the attacker re-seals it (no signing key set)
    manifest.write_bytes(canonical_json(body))
    with pytest.raises(ManifestError, match=r"planner_data\['model.w'\]: expected a path of up to 64 names"):
        flowcheck.dcp.Reader(cfg, step=3).read_metadata()
