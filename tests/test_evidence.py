"""A lineage edge needs evidence: a save's default parent is what its process loaded or last saved, never the newest
step some other process left in the store (flowcheck/evidence.py, through flowcheck.dcp's Writer and Reader)."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowcheck.dcp
from flowcheck import evidence
from flowcheck.store import open_store
from tests.dcp.test_dcp_fsdp import config

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SAVE = """
import sys, warnings, torch, torch.distributed.checkpoint as dcp, flowcheck.dcp
warnings.filterwarnings("ignore")
cfg, steps = sys.argv[1], [int(s) for s in sys.argv[2:]]
for step in steps:
    dcp.save({"w": torch.full((4,), float(step))}, storage_writer=flowcheck.dcp.Writer(cfg, step=step), no_dist=True)
"""


def _save(cfg: str, step: int, seed: int, **kw) -> flowcheck.dcp.Writer:
    w = flowcheck.dcp.Writer(cfg, step=step, **kw)
    dcp.save({"w": torch.full((4,), float(seed))}, storage_writer=w, no_dist=True)
    return w


def _load(cfg: str, step) -> flowcheck.dcp.Reader:
    reader = flowcheck.dcp.Reader(cfg, step=step)
    dcp.load({"w": torch.zeros(4)}, storage_reader=reader, no_dist=True)
    return reader


def _lineage(cfg: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "flowcheck", "lineage", "--format", "json", "--config", cfg],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def test_two_fresh_processes_saving_one_run_are_two_roots_in_lineage(tmp_path):
    cfg = config(str(tmp_path))
    for steps in (["100", "200"], ["300", "400"]):  # the second job trains afresh: it loaded nothing
        subprocess.run([sys.executable, "-c", SAVE, cfg, *steps], check=True, capture_output=True, text=True)
    view = _lineage(cfg)
    assert len(view["roots"]) == 2, view["roots"]
    parents = {n["step"]: n["parent"] and n["parent"]["step"] for n in view["nodes"]}
    assert parents == {100: None, 200: 100, 300: None, 400: 300}, parents


def test_a_job_saving_every_n_steps_in_one_process_is_one_chain(tmp_path):
    cfg = config(str(tmp_path))
    for step in range(10, 60, 10):
        _save(cfg, step, step)
    store = open_store(cfg)
    assert store.local.branch_names() == []
    parents = {n: store.local.manifest(n).parent for n in store.local.steps()}
    assert parents[10] is None
    assert all(parents[n] == store.local.manifest(n - 10).parent_ref() for n in range(20, 60, 10)), parents


def test_a_fresh_start_says_it_starts_a_root_and_how_to_name_the_parent(tmp_path, caplog):
    cfg = config(str(tmp_path))
    _save(cfg, 5, 5)
    evidence.forget()  # a new process
    with caplog.at_level(logging.WARNING, logger="flowcheck"):
        m = _save(cfg, 10, 10).committed
    assert m.parent is None
    said = [r.getMessage() for r in caplog.records if "new root" in r.getMessage()]
    assert len(said) == 1 and "parent=N" in said[0] and "parent=reader" in said[0], said


def test_an_explicit_parent_step_is_taken_from_the_store(tmp_path):
    cfg = config(str(tmp_path))
    _save(cfg, 5, 5)
    evidence.forget()  # a job that resumed from step 5 by other means, and says so
    m = _save(cfg, 6, 6, parent=5).committed
    assert m.parent == open_store(cfg).local.manifest(5).parent_ref()
    assert open_store(cfg).local.branch_names() == []  # it continues main


def test_a_parent_that_names_nothing_is_refused_when_the_writer_is_made(tmp_path):
    import pytest

    from flowcheck.errors import ConfigError

    cfg = config(str(tmp_path))
    for bad in ("latest", -1, True, 2.5):
        with pytest.raises(ConfigError, match="parent: expected 'auto', None, a step number"):
            flowcheck.dcp.Writer(cfg, step=3, parent=bad)


# ---- random jobs: fresh starts, loads and rollbacks ---------------------------------------------------------------

_action = st.one_of(
    st.tuples(st.just("fresh"), st.integers(1, 3)),  # a new process that loads nothing, then saves n steps
    st.tuples(st.just("load"), st.integers(0, 20), st.integers(1, 3)),  # loads the k-th stored state, saves n steps
    st.tuples(st.just("more"), st.integers(1, 2)),  # the same process saves n more steps
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(jobs=st.lists(_action, min_size=1, max_size=5))
def test_every_parent_link_is_what_the_trainer_loaded_or_last_saved(tmp_path_factory, jobs):
    """Each committed state's parent is exactly what its process loaded (a rollback when older than the newest) or
    saved just before; a process that did neither has no parent."""
    cfg = config(str(tmp_path_factory.mktemp("jobs")))
    saved: list = []  # every committed manifest, in order
    expect: dict[str, object] = {}  # manifest digest -> the parent it must name (None: a root)
    last, step, seed = None, 0, 0
    for job in jobs:
        if job[0] != "more":
            evidence.forget()  # a new process
        if job[0] == "load" and saved:
            m = saved[job[1] % len(saved)]
            reader = _load(cfg, m.digest()[:24])
            last, step = reader.resumed, m.step
        elif job[0] != "more":
            last, step = None, 0  # trains from scratch
        for _ in range(job[-1]):
            step, seed = step + 1, seed + 1
            m = _save(cfg, step, seed).committed
            expect[m.digest()] = last
            saved.append(m)
            last = m.parent_ref()
    store = open_store(cfg)
    for bt in store.branch_tiers("local"):
        for n in bt.steps():
            m = bt.manifest(n)
            assert m.parent == expect[m.digest()], (n, bt.branch, jobs)
