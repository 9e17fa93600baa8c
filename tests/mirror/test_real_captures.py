"""The four shared real captures decode to their ground truth bit for bit (or report exactly what is missing)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from flowcheck.capture.mirror.anomalies import PsnGap
from flowcheck.capture.mirror.decode import Decoded, decode, read_all
from flowcheck.capture.mirror.job import load_job
from flowcheck.cli import main

PCAPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "pcaps"
JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
COMPLETE = ["allreduce+p2p", "rdma32", "iter_40000_p2p_iter10_2"]

pytestmark = pytest.mark.skipif(not PCAPS.is_dir(), reason=f"shared captures not found at {PCAPS}")


def _decode(name: str):
    info = Decoded()
    got = list(decode(load_job(str(JOBS / f"{name}.yaml")), read_all([str(PCAPS / f"{name}.pcapng")]), info))
    return got, info


@pytest.mark.parametrize("name", COMPLETE)
def test_capture_decodes_to_ground_truth_bit_for_bit(name):
    truth = np.load(PCAPS / f"{name}.all_iters.npy")
    facts = json.loads((PCAPS / f"{name}.json").read_text())
    got, _ = _decode(name)
    assert len(got) == len(truth) == facts["iterations"]
    for ar, row, it in zip(got, truth, facts["per_iteration"]):
        assert ar.complete, ar.summary()
        assert ar.data.tobytes() == row.astype(row.dtype.newbyteorder("<")).tobytes()
        assert ar.summary()["sha256"] == it["sha256_le"]
        assert ar.summary()["copies"]["min"] >= 1


def test_iter_80000_reports_the_missing_ranges_and_yields_no_gradient():
    partial = np.load(PCAPS / "iter_80000.iter01.PARTIAL_nan_missing.npy")
    (ar,), info = _decode("iter_80000")
    assert not ar.complete and "sha256" not in ar.summary()
    missing = np.zeros(ar.elements, bool)
    for a, b in ar.missing():
        missing[a:b] = True
    assert np.array_equal(missing, np.isnan(partial))
    assert int((~missing).sum()) == 6400
    seen = ~missing
    assert ar.data[seen].tobytes() == partial[seen].tobytes()
    gaps = [a for a in info.anomalies if isinstance(a, PsnGap) and "qpn=0xc99" in a.stream]
    assert {"psn": [62, 77], "packets": 15}.items() <= gaps[0].to_json().items()


def test_rdma32_forged_packets_are_rejected():
    (ar,), info = _decode("rdma32")
    assert info.packets["BAD_ICRC"] == 7
    assert not any("0xbbbbbb" in s.stream for s in info.streams)
    assert ar.complete


def test_decode_cli_json_contract_and_exit_codes(tmp_path):
    r = CliRunner().invoke(main, ["decode", "--job", str(JOBS / "iter_80000.yaml"), "--pcap",
                                  str(PCAPS / "iter_80000.pcapng"), "--json", "--dump", str(tmp_path)])
    assert r.exit_code == 3, r.output
    out = json.loads(r.output)
    (a,) = out["allreduces"]
    assert {"index", "iteration", "bucket", "elements", "dtype", "complete", "missing", "copies"} <= set(a)
    assert a["dtype"] == "float32" and a["complete"] is False and "sha256" not in a
    assert (tmp_path / "allreduce-1.npy").exists() and np.load(tmp_path / "allreduce-1.missing.npy").sum() == 3600
    r = CliRunner().invoke(main, ["decode", "--job", str(JOBS / "rdma32.yaml"), "--pcap", str(PCAPS / "rdma32.pcapng"), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["allreduces"][0]["complete"]
    r = CliRunner().invoke(main, ["decode", "--job", str(tmp_path / "nope.yaml"), "--pcap", str(PCAPS / "rdma32.pcapng")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_ll128_is_refused_clearly():
    from flowcheck.capture.mirror.job import job_from_dict
    from flowcheck.errors import JobError

    job = job_from_dict({"ring": [{"mac": "02:00:00:00:00:01"}, {"mac": "02:00:00:00:00:02"}], "protocol": "ll128",
                         "buckets": {"steady": [10]}})
    with pytest.raises(JobError, match="ll128"):
        list(decode(job, read_all([str(PCAPS / "rdma32.pcapng")])))
