"""`flowcheck demo`, the README's main job: it passes with one verdict line, every command it prints runs as
printed from any folder, it restores into Megatron in both formats, honours a given config, and fails loudly."""
from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys
import uuid

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from flowcheck.cli import main
from flowcheck.demo import Check, DemoOptions, DemoSummary, demo_config
from tests.conftest import point_aws_at

EXE = os.path.join(os.path.dirname(sys.executable), "flowcheck")
STEPS = 40


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("FLOWCHECK_CONFIG", None)
    return env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A real `flowcheck demo` process, shortened: (workdir, its stdout, its stderr)."""
    workdir = tmp_path_factory.mktemp("demo") / "work"
    proc = subprocess.run([EXE, "demo", "--workdir", str(workdir), "--steps", str(STEPS), "--local-every", "10",
                           "--object-seconds", "0.5"], check=False, capture_output=True, text=True, timeout=600, env=_env(),
                          cwd=tmp_path_factory.mktemp("elsewhere"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return workdir, proc.stdout, proc.stderr


def _printed_commands(stdout: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in stdout.splitlines()
            if line.startswith(("$ flowcheck ", "next: flowcheck "))]


def test_demo_passes_and_ends_with_one_verdict_line(demo_run):
    _, out, _ = demo_run
    last = out.strip().splitlines()[-1]
    assert last.startswith("demo: PASSED — ") and "FAILED" not in out
    for shown in ("losses == uninterrupted run bit for bit", "audit OK", "export of step 40 == trainer's state",
                  "restore TP2/PP2 megatron-dist == trainer's state", "restore TP2/PP2 megatron == trainer's state",
                  "state rebuilt from mirrored frames == trainer's"):
        assert shown in last
    # a trainer process pushed to a node process, was killed, restored and resumed with identical losses
    assert "then killed (SIGKILL)" in out
    assert "identical to the uninterrupted run bit for bit: True" in out


def test_demo_output_has_no_warning_a_newcomer_would_read_as_failure(demo_run):
    _, out, err = demo_run
    for noise in ("WARNING", "Traceback", "resource_tracker", "leaked shared_memory", "torch.distributed is disabled"):
        assert noise not in out + err, noise
    # what those warnings were about is said plainly instead
    assert "push buffer was unlinked by its resource tracker" in out
    assert "lost on every copy, as injected: marked stale (never snapshotted) and resynced" in out


def test_every_printed_command_runs_as_printed_from_another_folder(demo_run, tmp_path):
    workdir, out, _ = demo_run
    commands = _printed_commands(out)
    names = [shlex.split(c)[1] for c in commands]
    assert names == ["ls", "audit", "export", "restore", "restore", "simulate", "capture", "diff", "lineage"]
    for command in commands:
        argv = shlex.split(command)
        if argv[1] != "simulate":  # the one command that reads no store, so takes no --config
            config = argv[argv.index("--config") + 1]
            assert os.path.isabs(config) and os.path.isfile(config), command
        proc = subprocess.run([EXE, *argv[1:]], check=False, capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}{proc.stderr}"
    assert str(workdir / "mirror" / "flowcheck.yaml") in out  # the mirror half's store has its own config


def test_restore_writes_both_megatron_formats_at_tp2_pp2(demo_run):
    workdir, out, _ = demo_run
    dist = workdir / "restore" / "tp2-pp2-megatron-dist"
    legacy = workdir / "restore" / "tp2-pp2-megatron"
    for ckpt in (dist, legacy):
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    it = f"iter_{STEPS:07d}"
    assert {p.name for p in (dist / it).iterdir()} >= {".metadata", "common.pt", "metadata.json"}
    ranks = sorted(os.path.relpath(p, legacy / it) for p in glob.glob(str(legacy / it / "*" / "model_optim_rng.pt")))
    assert ranks == [f"mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t, p in ((0, 0), (0, 1), (1, 0), (1, 1))]
    lines = out.splitlines()
    assert sum(line.endswith("== the trainer's state bit for bit: True") for line in lines) == 2
    loaded_by = "loaded by megatron-core" if _megatron_core() else "megatron-core is not installed"
    assert sum(line.startswith(loaded_by) for line in lines) == 2


def _megatron_core() -> bool:
    from flowcheck.demo import mcore

    return mcore.available()


def test_demo_leaves_a_config_every_command_accepts(demo_run):
    workdir, _, _ = demo_run
    cfg = str(workdir / "flowcheck.yaml")
    rows = json.loads(_run("ls", "--config", cfg, "--json").output)
    assert {r["tier"] for r in rows} == {"local", "object"} and all(r["status"] == "committed" for r in rows)
    assert _run("audit", "--config", cfg).exit_code == 0
    show = _run("show", "--step", "latest", "--config", cfg)
    assert show.exit_code == 0 and "source=push" in show.output
    assert f"step {STEPS}" in _run("lineage", "--config", cfg).output
    assert "digraph" in _run("lineage", "--format", "dot", "--config", cfg).output
    assert _run("gc", "--dry-run", "--config", cfg).exit_code == 0


def test_export_is_loadable_by_safetensors_under_megatron_names(demo_run, tmp_path):
    workdir, _, _ = demo_run
    out = tmp_path / "model.safetensors"
    result = _run("export", "--step", str(STEPS), "--format", "safetensors", "--out", str(out), "--no-optim",
                  "--config", str(workdir / "flowcheck.yaml"))
    assert result.exit_code == 0, result.output
    tensors = load_file(str(out))
    assert tensors["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (192, 64)
    assert "embedding.word_embeddings.weight" in tensors and not any(k.startswith("optimizer.") for k in tensors)


def _run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def test_demo_refuses_a_non_empty_foreign_folder(tmp_path):
    (tmp_path / "precious.txt").write_text("do not touch")
    result = _run("demo", "--workdir", str(tmp_path), "--steps", "1")
    assert result.exit_code == 2 and "expected a new or empty folder" in result.output
    assert (tmp_path / "precious.txt").read_text() == "do not touch"


# ---- a given --config ------------------------------------------------------------------------------------------
def test_a_given_config_wins_where_it_speaks_and_the_demo_fills_in_the_rest(tmp_path):
    cfg = tmp_path / "conf" / "keepall.yaml"
    cfg.parent.mkdir()
    cfg.write_text("run: keepall\ntiers:\n  local: {root: ./store}\npolicy:\n  local: {keep_last: 100}\n")
    got = demo_config(DemoOptions(str(tmp_path / "w"), config=str(cfg)))
    assert got.run == "keepall" and got.tiers.local.root == str(tmp_path / "w" / "store")  # under --workdir
    assert got.policy.local.keep_last == 100 and got.policy.local.every_steps == 25  # the demo's, where silent
    assert got.tiers.object.url == "file://" + str(tmp_path / "w" / "object")
    assert got.policy.object.every_seconds == 2.0
    given = demo_config(DemoOptions(str(tmp_path / "w"), config=str(cfg), local_every=5, object_seconds=0.5))
    assert given.policy.local.every_steps == 5 and given.policy.object.every_seconds == 0.5  # options win
    assert given.policy.local.keep_last == 100
    help_text = " ".join(_run("demo", "--help").output.split())
    assert "--config FILE" in help_text and "an option given here wins, then this file" in help_text


def test_the_hourly_config_keeps_the_store_under_the_workdir_and_the_verdict_says_the_object_tier_was_idle(tmp_path):
    """configs/hourly.yaml names ./flowcheck-data: the demo's store goes under --workdir, never beside the config (in
    the checkout); its hourly promotion never runs in a demo of seconds, and PASSED says the object tier was not
    exercised."""
    import shutil

    conf = tmp_path / "checkout" / "configs"
    conf.mkdir(parents=True)
    hourly = conf / "hourly.yaml"
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "configs", "hourly.yaml"), hourly)
    work = tmp_path / "w"
    proc = subprocess.run([EXE, "demo", "--workdir", str(work), "--config", str(hourly), "--steps", "10",
                           "--local-every", "5"], check=False, capture_output=True, text=True, timeout=600,
                          env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.listdir(conf) == ["hourly.yaml"]  # nothing written beside the config
    assert (work / "flowcheck-data" / "local" / "default").is_dir()
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("demo: PASSED — ") and "object tier NOT exercised (no promotion ran: policy.object " \
        "every 3600 s)" in last, last


def _flip_one_bit_of_the_legacy_checkpoint(real_restore):
    """restore, then flip one bit of one weight on TP rank 1 / pipeline stage 1 of the legacy checkpoint."""
    import torch

    def restore(store, step, target, out, **kw):
        report = real_restore(store, step, target, out, **kw)
        if target.fmt == "megatron":
            (path,) = glob.glob(os.path.join(out, "iter_*", "mp_rank_01_001", "model_optim_rng.pt"))
            obj = torch.load(path, weights_only=False)
            obj["model"]["decoder.layers.0.mlp.linear_fc2.weight"].view(torch.uint8).view(-1)[3] ^= 0x80
            torch.save(obj, path)
        return report

    return restore


@pytest.fixture(scope="module")
def keepall_sabotaged(tmp_path_factory):
    """One in-process demo run with a config that keeps every local step, and a flipped bit in its legacy
    restore: (workdir, CliRunner result)."""
    from flowcheck.restore import service

    base = tmp_path_factory.mktemp("keepall")
    cfg = base / "keepall.yaml"
    cfg.write_text("policy:\n  local: {keep_last: 100}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FLOWCHECK_CONFIG", raising=False)
        mp.setattr(service, "restore", _flip_one_bit_of_the_legacy_checkpoint(service.restore))
        result = CliRunner().invoke(main, ["demo", "--workdir", str(base / "w"), "--config", str(cfg),
                                           "--steps", "30", "--local-every", "5", "--object-seconds", "0.5"])
    return base / "w", result


def test_keep_last_of_a_given_config_is_what_the_node_keeps(keepall_sabotaged):
    workdir, result = keepall_sabotaged
    steps = sorted(int(p.name.split("-")[1]) for p in (workdir / "local" / "demo").glob("step-*"))
    # a snapshot about every 5 steps (a step that arrives while one is in flight may be taken at the next), none
    # pruned: the demo's own policy would keep only the last 3, never the first
    assert len(steps) > 3 and steps[0] < 10 and steps[-1] == 30, result.output
    assert "local snapshot every 5 steps, keep last 100" in result.output


def test_a_flipped_bit_in_a_restored_checkpoint_fails_the_demo(keepall_sabotaged):
    _, result = keepall_sabotaged
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    # stage 1's local layer 0 is global layer 1: the read-back names the tensor as the trainer knows it
    assert last == ("demo: FAILED — restore megatron: decoder.layers.1.mlp.linear_fc2.weight: 1 of 16384 elements "
                    "differ from the trainer's state"), result.output
    assert "restore TP2/PP2 megatron-dist == trainer's state" not in last  # only what failed is named


def test_the_verdict_names_what_was_shown_or_what_failed():
    passed = Check("audit", True, "audit OK (5 step copies)")
    failed = Check("export", False, "", "3 tensors differ")
    assert DemoSummary((passed,)).verdict == "demo: PASSED — audit OK (5 step copies)"
    assert DemoSummary((passed, failed)).verdict == "demo: FAILED — export: 3 tensors differ"
    assert not DemoSummary().ok


@pytest.mark.s3
def test_demo_with_an_s3_object_store_over_http(tmp_path, s3_env):
    """`demo --object-url s3://bucket/prefix` against the moto server, AWS settings from the environment."""
    proc = subprocess.run([EXE, "demo", "--workdir", str(tmp_path / "w"), "--steps", "20", "--local-every", "10",
                           "--object-seconds", "0.5", "--object-url", "s3://demo-bucket/ckpt"],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from the object tier" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("demo: PASSED")
    assert "s3://demo-bucket/ckpt" in (tmp_path / "w" / "flowcheck.yaml").read_text()


@pytest.mark.s3
def test_demo_against_a_seaweedfs_cluster(tmp_path, seaweedfs_server, monkeypatch):
    """`demo --object-url` against a real distributed store (tests/seaweedfs.py, as a user starts it with
    `python -m tests.seaweedfs DIR`): the demo creates its bucket and passes; an object step deleted afterwards
    leaves neither an `ls` row nor an `audit` warning (SeaweedFS keeps a folder until it is deleted itself)."""
    point_aws_at(seaweedfs_server, monkeypatch)
    url = f"s3://demo-{uuid.uuid4().hex[:12]}/ckpt"
    proc = subprocess.run([EXE, "demo", "--workdir", str(tmp_path / "w"), "--steps", "20", "--local-every", "10",
                           "--object-seconds", "0.5", "--object-url", url],
                          check=False, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from the object tier" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("demo: PASSED")
    cfg = str(tmp_path / "w" / "flowcheck.yaml")
    assert url in open(cfg).read()

    def flowcheck(*args: str) -> str:
        return subprocess.run([EXE, *args, "--config", cfg], check=True, capture_output=True, text=True,
                              env=_env()).stdout

    stored = sorted(r["step"] for r in json.loads(flowcheck("ls", "--json")) if r["tier"] == "object")
    assert len(stored) >= 2, stored  # the demo promotes its first and its last step
    flowcheck("delete", "--step", str(stored[0]), "--tier", "object")
    flowcheck("gc")
    listing, checked = flowcheck("ls"), flowcheck("audit")
    assert "object" in listing and "incomplete" not in listing, listing
    assert " 0 errors, 0 warnings" in checked, checked


def test_a_second_demo_on_one_store_is_a_second_root_in_lineage(demo_run):
    """The second run trains a freshly initialised model from the step after the first run's last: it descends from
    nothing the first run stored (runs last here: it adds to the shared demo's store)."""
    workdir, _, _ = demo_run
    again = subprocess.run([EXE, "demo", "--workdir", str(workdir), "--steps", "10", "--local-every", "5",
                            "--object-seconds", "0.5"], check=False, capture_output=True, text=True, timeout=600,
                           env=_env())
    assert again.returncode == 0, again.stdout + again.stderr
    done = subprocess.run([EXE, "lineage", "--format", "json", "--config", str(workdir / "flowcheck.yaml")],
                          check=True, capture_output=True, text=True, env=_env())
    view = json.loads(done.stdout)
    second = min((n for n in view["nodes"] if n["step"] > STEPS), key=lambda n: n["step"])
    assert second["parent"] is None, second  # not the first run's last step: it does not descend from it
    assert str(second["step"]) in [r.split("@")[0] for r in view["roots"]], view["roots"]


def test_the_readme_tour_runs_as_printed_on_the_store_the_demo_left(demo_run, tmp_path):
    """README "A five-minute tour": its commands run as printed from the folder the demo ran in."""
    workdir, _, _ = demo_run
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md"),
              encoding="utf-8") as f:
        readme = f.read()
    tour = readme[readme.index("## A five-minute tour"):]
    block = tour[tour.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    assert "flowcheck-demo/flowcheck.yaml" in block and "flowcheck restore" in block
    (tmp_path / "flowcheck-demo").symlink_to(workdir)
    env = {**_env(), "PWD": str(tmp_path), "PATH": os.path.dirname(EXE) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(["bash", "-e", "-c", block], check=False, capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "step.safetensors").is_file() and (tmp_path / "megatron-tp1pp2").is_dir()
