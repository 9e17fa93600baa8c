"""`flowcheck simulate` end to end, and its refusals of bad options."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from flowcheck.capture.mirror.job import load_job
from flowcheck.cli.simulate import simulate_command


def test_simulate_writes_job_pcaps_and_truth(tmp_path):
    out = tmp_path / "sim"
    res = CliRunner().invoke(simulate_command, ["--dp", "4", "--iters", "2", "--channels", "2", "--mirror", "0:in,2:out",
                                                "--loss", "0.01", "--optimizer", "sgd", "--clip", "none",
                                                "--bucket-kb", "16", "--seed", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    names = set(os.listdir(out))
    assert {"job.yaml", "mirror-r0-in.pcap", "mirror-r2-out.pcap", "injected.json", "truth"} <= names
    assert {"step-0.safetensors", "step-1.safetensors", "step-2.safetensors", "allreduces.json",
            "losses.json"} <= set(os.listdir(out / "truth"))
    job = load_job(str(out / "job.yaml"))
    assert job.optimizer.kind == "sgd" and job.clip_grad_norm is None and job.channels == 2 and job.nranks == 4
    assert len(job.buckets) > 3  # 16 KiB buckets
    assert "mirror-r2-out.pcap" in res.output


@pytest.mark.parametrize("args,option", [
    (["--dp", "1"], "--dp"),
    (["--dp", "4", "--mirror", "9:out"], "--mirror"),
    (["--dp", "4", "--loss", "2"], "--loss"),
    (["--dp", "4", "--proto", "ll256"], "--proto"),
    (["--dp", "4", "--mtu", "1000"], "--mtu"),
    (["--dp", "4", "--clip", "big"], "--clip"),
    (["--dp", "4", "--channels", "0"], "--channels"),
])
def test_bad_options_are_refused_naming_the_option(tmp_path, args, option):
    res = CliRunner().invoke(simulate_command, [*args, "--iters", "1", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2
    assert option in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x").exists()
