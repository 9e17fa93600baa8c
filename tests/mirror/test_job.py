"""Job description: the example config loads; bad jobs fail with the file, the field, expected and found."""
from __future__ import annotations

from pathlib import Path

import pytest

from flowcheck.capture.mirror.job import job_from_dict, job_to_dict, load_job
from flowcheck.errors import JobError

ROOT = Path(__file__).resolve().parents[2]
RING = [{"mac": "02:00:00:00:00:01"}, {"mac": "02:00:00:00:00:02", "ip": ["10.0.0.2", "fe80::1"]}]


def test_example_job_loads_and_round_trips():
    job = load_job(str(ROOT / "configs" / "mirror-job.yaml"))
    assert job.nranks == 4 and job.trains and job.plan(1) != job.plan(2)
    assert job.plan(1)[0].elements == 64 * 32 + 32 + 32
    assert job_from_dict(job_to_dict(job)) == job
    assert job.position_of("02:fc:5e:00:00:03", "") == 2 and job.position_of("", "fe80::fc:5eff:fe00:4") == 3


@pytest.mark.parametrize("patch,match", [
    ({"ring": [{"mac": "02:00:00:00:00:01"}]}, "at least 2 members"),
    ({"ring": [{"mac": "zz"}, {"mac": "02:00:00:00:00:02"}]}, r"ring\[0\].mac: expected aa:bb"),
    ({"ring": [{"ip": "300.1.1.1"}, {"mac": "02:00:00:00:00:02"}]}, "expected an IPv4 or IPv6 address"),
    ({"dtype": "float16"}, "dtype: expected one of"),
    ({"protocol": "ll64"}, "protocol: expected one of"),
    ({"reduction": "mean"}, "reduction: expected one of"),
    ({"buckets": {}}, "at least one bucket"),
    ({"buckets": {"steady": [["nope"]]}}, "unknown parameter 'nope'"),
    ({"buckets": {"steady": [-1]}}, r"buckets.steady\[0\]: expected an integer >= 0"),
    ({"optimizer": {"kind": "lion", "lr": 1}}, "optimizer.kind"),
    ({"optimizer": {"kind": "adam", "lr": 1, "betas": [0.9]}}, "two numbers"),
    ({"channels": 0}, "channels: expected an integer >= 1"),
    ({"surprise": 1}, "unknown field"),
])
def test_bad_job_is_refused_with_the_field(patch, match):
    raw = {"ring": RING, "buckets": {"steady": [10]}, **patch}
    with pytest.raises(JobError, match=match):
        job_from_dict(raw)


def test_bucket_contents_must_cover_every_parameter_once():
    raw = {"ring": RING, "parameters": [{"name": "a", "shape": [2]}, {"name": "b", "shape": [3]}],
           "buckets": {"steady": [["a"]]}}
    with pytest.raises(JobError, match="every parameter in exactly one bucket"):
        job_from_dict(raw)


def test_load_job_names_the_file(tmp_path):
    p = tmp_path / "j.yaml"
    p.write_text("ring: [1, 2]\n")
    with pytest.raises(JobError, match=str(p)):
        load_job(str(p))
    p.write_text("ring: [\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(str(p))
