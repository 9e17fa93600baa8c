"""Issue 17, end to end with real megatron-core on CPU: a TP2 x PP1 x DP2 job (megatron's DDP and distributed
optimizer, Adam, cosine OptimizerParamScheduler) pushes every step to a ``flowcheck serve`` node and is killed;
the pushed step is the trainer's full state bit for bit (each DP rank sent the optimizer shards it owns);
``flowcheck restore --step latest`` writes it at another layout in both formats, and Megatron resumes from it:
the next losses and learning rates are those of the uninterrupted run.  With a vocabulary Megatron pads
(701 -> 768 rows), the padding rows are pushed and restored bit for bit, so the resumed losses are the uninterrupted
run's bit for bit wherever the layout pads to the same size; a Megatron-saved checkpoint of it imports with the Adam
it ran; GPT-2's vocabulary restores every row.

Every megatron process runs in a fresh interpreter (tests/restore/mcore_train.py); this module imports only torch.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target, cut
from flowcheck.restore.megatron_map import model_params, rank_tensors
from flowcheck.restore.service import restore

from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV
from flowcheck.store import open_store

from ..capture.conftest import NodeProcess
from .conftest import make_store
from .mcore import MegatronRunError, _report, megatron_available

pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(not megatron_available(), reason="needs megatron-core and psutil (extra 'dev')")]

# vocab 256: no padding rows at TP1 or TP2, so the loss (softmax over the padded vocabulary) is layout-independent.
# Learned positions (first stage only) break the symmetry that otherwise puts megatron's DP split of the gradient
# buffer on a parameter boundary: the split falls inside layer 0's linear_fc2, mid-row.
ARCH = {"num_layers": 2, "hidden_size": 48, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": None,
        "ffn_hidden_size": 96, "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "learned_absolute",
        "add_position_embedding": True, "untie_embeddings_and_output_weights": True, "add_bias_linear": False,
        "add_qkv_bias": False, "max_position_embeddings": 20, "vocab_size": 256, "make_vocab_size_divisible_by": 128}
K, M, GLOBAL_BATCH = 3, 3, 4  # pushed steps, steps compared after the resume, samples per step
TIMEOUT = 240


def _entry() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return (f"import sys; sys.path.insert(0, {here!r}); import mcore_train; "
            "mcore_train.W.exit_now(mcore_train.main(sys.argv[1]))")


def _start(task_dir: str, task: dict) -> subprocess.Popen:
    os.makedirs(task_dir, exist_ok=True)
    with open(os.path.join(task_dir, "task.json"), "w") as f:
        json.dump({"timeout": TIMEOUT, "arch": ARCH, "world": 4, **task}, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with open(os.path.join(task_dir, "log.txt"), "wb") as log:  # the child writes its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-c", _entry(), task_dir], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def _errors(task_dir: str) -> bool:
    return any(n.startswith("error_") for n in os.listdir(task_dir))


def _train_and_kill(task_dir: str, node: NodeProcess, job: dict, arch: dict) -> None:
    """Run the job until every rank finished its steps, then SIGKILL it (ranks then hang, as a crashed job's)."""
    proc = _start(task_dir, {"op": "train", "tp": 2, "pp": 1, "arch": arch,
                             "jobs": [{**job, "node": node.url, "run": node.run}]})
    deadline = time.monotonic() + TIMEOUT
    try:
        while sum(n.startswith("done_") for n in os.listdir(task_dir)) < 4:
            if proc.poll() is not None or _errors(task_dir) or time.monotonic() > deadline:
                raise MegatronRunError(f"megatron training failed\n{_report(task_dir)}\nnode: {node.tail()}")
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _resume(task_dir: str, tp: int, pp: int, jobs: list[dict], arch: dict = ARCH) -> list[dict]:
    proc = _start(task_dir, {"op": "resume", "tp": tp, "pp": pp, "jobs": jobs, "arch": arch})
    try:
        code = proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise MegatronRunError(f"megatron resume did not finish in {TIMEOUT} s\n{_report(task_dir)}") from None
    finally:  # what the ranks left running (a multiprocessing manager Megatron's save started) goes with them
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        raise MegatronRunError(f"megatron resume at tp={tp} pp={pp} failed\n{_report(task_dir)}")
    out = []
    for job in jobs:
        with open(os.path.join(task_dir, f"resume_{job['index']}.json")) as f:
            out.append(json.load(f))
    return out


def _pushed_job(tmp_path_factory, name: str, distributed: bool, k: int, m: int, arch: dict = ARCH, **extra):
    """A node that took ``k`` pushed steps of a killed TP2 x DP2 job of model ``arch``, and the job's own records."""
    root = str(tmp_path_factory.mktemp(name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DEFAULT_TOKEN_ENV, "megatron-loop-token")
        node = NodeProcess(root, run="gpt", every_steps=1, part_timeout_s=60).start()
        try:
            train_dir = os.path.join(root, "train")
            _train_and_kill(train_dir, node, {"k": k, "m": m, "distributed": distributed, **extra}, arch)
            _wait_local(node, k)
            yield node, train_dir
        finally:
            node.stop()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The distributed-optimizer job: K pushed steps, then M more (the uninterrupted reference), then killed."""
    yield from _pushed_job(tmp_path_factory, "megatron-loop", True, K, M)


@pytest.fixture(scope="module")
def plain_job(tmp_path_factory):
    """The same job with megatron's non-distributed optimizer (every DP replica holds all of its state)."""
    yield from _pushed_job(tmp_path_factory, "megatron-plain", False, 2, 0)


def _wait_local(node: NodeProcess, step: int, timeout: float = 60) -> None:
    """The newest pushed step in the local tier (the policy coalesces triggers that come while it is busy)."""
    node.wait_step(step)
    status, body = node.post("/snapshot")
    assert status == 200, body
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if step in open_store(node.config).local.steps():
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never reached the local tier: {node.get('/status')}")


def _trainer_state(train_dir: str) -> dict[tuple[int, int], dict]:
    out = {}
    for name in os.listdir(train_dir):
        if name.startswith("state_"):
            got = torch.load(os.path.join(train_dir, name), weights_only=False)
            out[tuple(got["rank"])] = got
    return out


def test_pushed_step_is_the_trainers_full_state_bit_for_bit(job):
    node, train_dir = job
    m = _check_pushed(node, train_dir, K)
    split = m.tensors["optimizer.exp_avg.decoder.layers.0.mlp.linear_fc2.weight"].shards
    assert any(sh.shape[0] == 1 for sh in split), "no DP range ends mid-row: the test lost its hard case"


def test_non_distributed_optimizer_push_is_the_trainers_full_state_bit_for_bit(plain_job):
    _check_pushed(*plain_job, 2)


@pytest.fixture(scope="module")
def frozen_job(tmp_path_factory):
    """The distributed-optimizer job with its embeddings frozen (a partial fine-tune): K pushed steps."""
    yield from _pushed_job(tmp_path_factory, "megatron-frozen", True, K, 0, freeze=["embedding."])


def test_frozen_parameters_of_a_megatron_trainer_are_pushed_once_and_stored_bit_for_bit(frozen_job):
    node, train_dir = frozen_job
    m = _check_pushed(node, train_dir, K, frozen=("embedding.",))
    assert "embedding.word_embeddings.weight" in m.tensors
    assert not any(n.startswith("optimizer.") and ".embedding." in n for n in m.tensors)


def _check_pushed(node: NodeProcess, train_dir: str, step: int, frozen: tuple[str, ...] = (), model: dict = ARCH):
    """Step ``step`` in the local tier holds every weight and Adam moment (none for ``frozen`` parameters), each tiled
    once by the ranks' pieces, equal bit for bit to the trainer's own (TP-local) state, the vocabulary's padding rows
    included; its scalars are the trainer's param groups, scheduler and model (with the padded vocabulary it trained
    at).  Frozen weights are sent by the first push only (later ones carry them as kept)."""
    store = open_store(node.config)
    m = store.local.manifest(step)
    arch = ModelArch.from_mapping({**model, "padded_vocab_size": ModelArch.from_mapping(model).padded_vocab(2)})
    assert ModelArch.from_mapping(m.scalars["extra"]["model"]) == arch
    ranks = _trainer_state(train_dir)
    assert sorted(ranks) == [(0, 0), (1, 0)]
    slots = {"weight": "", "exp_avg": "optimizer.exp_avg.", "exp_avg_sq": "optimizer.exp_avg_sq."}
    names = [prefix + p.name for p in model_params(arch) for prefix in slots.values()
             if not prefix or not p.name.startswith(frozen or ("\0",))]
    assert sorted(m.tensors) == sorted(names)  # fp32 training: the main params are the weights, no fp32_param
    for name, entry in m.tensors.items():  # the pieces tile each tensor: no overlap, no gap
        covered = np.zeros(entry.global_shape, dtype=np.int64)
        for sh in entry.shards:
            covered[tuple(slice(o, o + n) for o, n in zip(sh.offsets, sh.shape))] += 1
        assert (covered == 1).all(), name
    state_bytes = sum(int(np.prod(e.global_shape)) * 4 for e in m.tensors.values())
    frozen_bytes = sum(int(np.prod(e.global_shape)) * 4 for n, e in m.tensors.items() if frozen and n.startswith(frozen))
    pushed = node.get("/status")["push"]
    assert pushed["bytes"] == step * state_bytes - (step - 1) * frozen_bytes  # every piece sent once, by one rank
    assert pushed["kept_bytes"] == (step - 1) * frozen_bytes
    full = {n: torch.from_numpy(store.read(step, n, prefer="local")) for n in names}
    for (t, p), got in ranks.items():
        rts = {rt.key: rt for rt in rank_tensors(arch, 2, 1, 1, t, p)}
        for (slot, _, key), local in got["state"].items():
            if slot == "param":
                assert torch.equal(local, got["state"][("weight", 0, key)]), key  # fp32: main param == weight
                continue
            assert torch.equal(cut(full[slots[slot] + rts[key].param.name], rts[key]), local), (slot, key)
    _check_scalars(m.scalars, ranks[(0, 0)], step)
    return m


def _check_scalars(scalars: dict, trainer: dict, step: int) -> None:
    """The trainer's own iteration, samples, step, schedule and param groups; its Adam (megatron-core's torch AdamW on
    CPU), so restore writes the optimizer state in that Adam's form."""
    mega = scalars["extra"]["megatron"]
    assert (mega["iteration"], mega["consumed_train_samples"]) == (step, step * GLOBAL_BATCH)
    assert scalars["optimizer_step"] == trainer["step"] == step
    assert mega["opt_param_scheduler"] == trainer["scheduler"] == scalars["lr_scheduler"]
    groups = json.loads(json.dumps(trainer["param_groups"]))
    assert mega["param_groups"] == groups == scalars["optimizer"]["param_groups"]
    for g in groups:
        assert {"lr", "min_lr", "max_lr", "betas", "eps", "weight_decay", "wd_mult", "lr_mult", "is_expert_parallel",
                "step"} <= set(g)
    assert scalars["extra"]["push"]["dp"] == 2 and mega["adam"] == "torch"


def _restore(node: NodeProcess, out: str, tp: int, pp: int, fmt: str) -> None:
    cmd = [sys.executable, "-m", "flowcheck", "restore", "--config", node.config, "--step", "latest", "--tp", str(tp),
           "--pp", str(pp), "--format", fmt, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_megatron_resumes_at_a_new_layout_where_the_killed_job_would_have_gone(job, tmp_path, tp, pp):
    node, train_dir = job
    jobs = []
    for i, fmt in enumerate(("megatron-dist", "megatron")):
        out = str(tmp_path / fmt)
        _restore(node, out, tp, pp, fmt)
        jobs.append({"index": i, "fmt": fmt, "ckpt_dir": out, "m": M})
    with open(os.path.join(train_dir, "train.json")) as f:
        want = json.load(f)["steps"][K:]
    for j, got in zip(jobs, _resume(str(tmp_path / "resume"), tp, pp, jobs)):
        assert got["start"] == K, j["fmt"]
        for a, b in zip(got["steps"], want, strict=True):
            assert a["iteration"] == b["iteration"]
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12), (j["fmt"], a, b)  # the schedule continues
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (j["fmt"], a, b)


# ---------------------------------------------------------------- a padded vocabulary (issue 35)
# 701 tokens: Megatron pads the embedding and output layer to 768 rows at TP1 and TP2 (multiples of 128*TP), to 1024
# at TP4.  The 67 padding rows are trained (their logits are in the softmax) and differ from every real row.
PADDED = {**ARCH, "vocab_size": 701}
# GPT-2's vocabulary at a tiny width: 50,432 rows at TP2, 50,304 at TP1; its last real row is <|endoftext|>
GPT2 = {**ARCH, "num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "vocab_size": 50257}


@pytest.fixture(scope="module")
def padded_job(tmp_path_factory):
    """The distributed-optimizer job with a padded vocabulary: K pushed steps, M more, killed."""
    yield from _pushed_job(tmp_path_factory, "megatron-padded", True, K, M, arch=PADDED)


def test_the_padding_rows_of_a_padded_vocabulary_are_pushed_bit_for_bit(padded_job):
    m = _check_pushed(*padded_job, K, model=PADDED)
    assert tuple(m.tensors["output_layer.weight"].global_shape) == (768, PADDED["hidden_size"])
    model = m.scalars["extra"]["model"]
    assert (model["vocab_size"], model["padded_vocab_size"]) == (701, 768)


def _uninterrupted(train_dir: str) -> list[dict]:
    with open(os.path.join(train_dir, "train.json")) as f:
        return json.load(f)["steps"][K:]


def _record(out: str) -> dict:
    with open(os.path.join(out, "flowcheck_restore.json")) as f:
        return json.load(f)


def _losses(got: dict, want: list[dict], rel: float) -> None:
    """The resumed steps are the uninterrupted run's: same iterations and LRs, losses within ``rel`` (0: equal)."""
    assert got["start"] == K
    for a, b in zip(got["steps"], want, strict=True):
        assert a["iteration"] == b["iteration"] and a["lr"] == pytest.approx(b["lr"], rel=1e-12), (a, b)
        assert a["loss"] == (pytest.approx(b["loss"], rel=rel) if rel else b["loss"]), (a, b)


def test_a_padded_vocabulary_resumes_bit_identically_at_the_layout_it_trained_at(padded_job, tmp_path):
    """TP2 x DP2 again, both formats: every row (padding included) as trained, so the next losses are the
    uninterrupted run's bit for bit.  The torch_dist job (distributed optimizer, torch AdamW) also saves the
    checkpoint with Megatron's own writer, for the import test below."""
    node, train_dir = padded_job
    jobs = []
    for i, fmt in enumerate(("megatron-dist", "megatron")):
        out = str(tmp_path / fmt)
        _restore(node, out, 2, 1, fmt)
        assert _record(out)["vocabulary"] == {"vocab_size": 701, "stored_rows": 768, "restored_rows": 768,
                                              "rows": "768 rows (vocab_size 701 + 67 padding): every row as stored"}
        jobs.append({"index": i, "fmt": fmt, "ckpt_dir": out, "m": M})
    jobs[0]["save_dir"] = str(tmp_path / "saved")
    for got in _resume(str(tmp_path / "resume"), 2, 1, jobs, PADDED):
        _losses(got, _uninterrupted(train_dir), rel=0)
    _import_then_resume(node, train_dir, tmp_path)


def _import_then_resume(node: NodeProcess, train_dir: str, tmp_path) -> None:
    """Megatron's own torch_dist checkpoint (distributed optimizer, torch AdamW) imports with its padding rows and
    the Adam it ran; restored for the non-distributed optimizer (torch AdamW takes the step from every parameter's
    state), it loads and resumes bit for bit."""
    pushed = open_store(node.config)
    store = make_store(tmp_path, "imported")
    m = import_into(store, str(tmp_path / "saved"), K)
    assert m.scalars["extra"]["megatron"]["adam"] == "torch"
    assert m.scalars["extra"]["model"]["padded_vocab_size"] == 768
    for name in ("embedding.word_embeddings.weight", "output_layer.weight",
                 "optimizer.exp_avg_sq.output_layer.weight"):
        assert np.array_equal(store.read(K, name), pushed.read(K, name, prefer="local")), name
    out = str(tmp_path / "from-import")
    rep = restore(store, K, Target(2, 1, 1, "megatron"), out)
    assert (rep.resume.adam, rep.resume.sources["adam"]) == ("torch", "scalars.extra.megatron.adam")
    (got,) = _resume(str(tmp_path / "resume-import"), 2, 1, [{"index": 0, "fmt": "megatron", "ckpt_dir": out, "m": M}],
                     PADDED)
    _losses(got, _uninterrupted(train_dir), rel=0)


def test_a_padded_vocabulary_resumes_at_another_layout_that_pads_to_the_same_size(padded_job, tmp_path):
    """TP1 x PP2 x DP2 pads 701 to 768 as well: the stored rows are the checkpoint's rows, and the next losses are
    the uninterrupted run's bit for bit (as they are for an unpadded vocabulary)."""
    node, train_dir = padded_job
    out = str(tmp_path / "dist")
    _restore(node, out, 1, 2, "megatron-dist")
    assert _record(out)["vocabulary"]["restored_rows"] == 768
    (got,) = _resume(str(tmp_path / "resume"), 1, 2, [{"index": 0, "fmt": "megatron-dist", "ckpt_dir": out, "m": M}],
                     PADDED)
    _losses(got, _uninterrupted(train_dir), rel=0)


def test_a_layout_that_pads_to_more_rows_keeps_the_stored_ones_and_copies_the_last(padded_job, tmp_path):
    """TP4 pads 701 to 1024: rows 0..767 are the stored ones, bit for bit, rows 768..1023 copies of row 767 (weights
    and moments, as Megatron-LM's checkpoint converter pads), and the report says so.  Megatron loads it and the
    schedule continues; the losses cannot be the uninterrupted run's (256 more logits in the softmax)."""
    node, train_dir = padded_job
    out = str(tmp_path / "legacy")
    _restore(node, out, 4, 1, "megatron")
    note = _record(out)["vocabulary"]["rows"]
    assert note.startswith("1024 rows (vocab_size 701 + 323 padding): the step stores 768 rows, kept as stored; new rows "
                           "768..1023 are copies of row 767"), note
    store = open_store(node.config)
    stored = {n: torch.from_numpy(store.read(K, n, prefer="local")) for n in ("output_layer.weight",
                                                                              "optimizer.exp_avg.output_layer.weight")}
    for t in range(4):
        ck = torch.load(os.path.join(out, f"iter_{K:07d}", f"mp_rank_{t:02d}", "model_optim_rng.pt"), weights_only=False)
        rows = ck["model"]["output_layer.weight"]
        want = stored["output_layer.weight"][256 * t:256 * (t + 1)] if t < 3 else stored["output_layer.weight"][-1:]
        assert torch.equal(rows, want.expand_as(rows)), t
    (got,) = _resume(str(tmp_path / "resume"), 4, 1, [{"index": 0, "fmt": "megatron", "ckpt_dir": out, "m": M}],
                     PADDED)
    assert got["start"] == K and all(np.isfinite(s["loss"]) for s in got["steps"])
    for a, b in zip(got["steps"], _uninterrupted(train_dir), strict=True):
        assert a["iteration"] == b["iteration"] and a["lr"] == pytest.approx(b["lr"], rel=1e-12), (a, b)


@pytest.fixture(scope="module")
def gpt2_job(tmp_path_factory):
    """GPT-2's vocabulary, one pushed step of the TP2 x DP2 job."""
    yield from _pushed_job(tmp_path_factory, "megatron-gpt2", True, 1, 0, arch=GPT2)


@pytest.mark.parametrize("tp,rows", [(2, 50432), (1, 50304)])
def test_gpt2s_vocabulary_restores_every_row_bit_for_bit(gpt2_job, tmp_path, tp, rows):
    """At TP2 (the trainer's layout) every row of the restored embedding and output layer is the trainer's own,
    the 175 padding rows after <|endoftext|> included; at TP1 (50,304 rows) the 128 padding rows past them go."""
    node, train_dir = gpt2_job
    m = _check_pushed(node, train_dir, 1, model=GPT2)
    assert tuple(m.tensors["embedding.word_embeddings.weight"].global_shape) == (50432, 16)
    out = str(tmp_path / "ck")
    _restore(node, out, tp, 1, "megatron")
    trainer = _trainer_state(train_dir)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = torch.cat([trainer[(t, 0)]["state"][("weight", 0, name)] for t in range(2)])
        got = torch.cat([torch.load(os.path.join(out, f"iter_{1:07d}", f"mp_rank_{t:02d}", "model_optim_rng.pt"),
                                    weights_only=False)["model"][name] for t in range(tp)])
        assert torch.equal(got, full[:rows]), name
