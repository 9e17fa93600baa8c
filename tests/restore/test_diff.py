"""flowcheck diff: a stored step against a reference safetensors file, bit for bit per tensor."""
from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from flowcheck.cli import main


def _setup(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: r\ntiers: {local: {root: ./loc}, object: {url: file://./obj}}\n")
    ref = {"w": torch.randn(4, 5), "b": torch.randn(3).to(torch.bfloat16), "n": torch.arange(6), "s": torch.tensor(3.0)}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    r = CliRunner().invoke(main, ["snapshot", "--config", str(cfg), "--state", str(tmp_path / "ref.safetensors"), "--step", "1"])
    assert r.exit_code == 0, r.output
    return cfg, ref


def _diff(cfg, ref_path, *extra):
    return CliRunner().invoke(main, ["diff", "--config", str(cfg), "--step", "1", "--against", str(ref_path), *extra])


def test_diff_reports_bit_exact_step(tmp_path):
    cfg, _ = _setup(tmp_path)
    r = _diff(cfg, tmp_path / "ref.safetensors", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["bit_exact"] and out["counts"] == {"equal": 4}  # incl. a 0-d tensor


def test_diff_names_each_differing_tensor_and_by_how_much(tmp_path):
    cfg, ref = _setup(tmp_path)
    other = dict(ref)
    w = ref["w"].clone()
    w.view(-1).view(torch.int32)[7] ^= 1  # one flipped mantissa bit
    other["w"] = w
    other.pop("n")
    other["extra"] = torch.zeros(2)
    save_file(other, str(tmp_path / "other.safetensors"))
    r = _diff(cfg, tmp_path / "other.safetensors", "--json")
    assert r.exit_code == 1
    by_name = {t["name"]: t for t in json.loads(r.output)["tensors"]}
    assert by_name["w"]["status"] == "different" and by_name["w"]["differing"] == 1
    assert 0 < by_name["w"]["max_abs_diff"] < 1e-5
    assert by_name["b"]["status"] == "equal"
    assert by_name["n"]["status"] == "only-stored" and by_name["extra"]["status"] == "only-reference"


def test_diff_refuses_a_file_that_is_not_safetensors(tmp_path):
    cfg, _ = _setup(tmp_path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    r = _diff(cfg, bad)
    assert r.exit_code == 2 and "header claims" in r.output
