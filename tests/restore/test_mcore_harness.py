"""The megatron-core harness itself: checkpoints megatron writes load back, at every layout, to the logits of
the reference model. Independent of flowcheck's own writers, so a failure here is the harness's fault."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.restore import mcore
from tests.restore.mcore import ARCHS, LoadJob, MegatronRunError, SaveJob

if not mcore.megatron_available():
    # find_spec, not importorskip: importing megatron.core here would cost ~10 s that only the children need
    pytest.skip("megatron-core (and psutil) not installed: pip install 'megatron-core==0.16.1' psutil",
                allow_module_level=True)

TOLERANCE = 1e-5
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """References for every arch, and megatron's own TP1 checkpoints of them in both formats."""
    root = tmp_path_factory.mktemp("mcore")
    refs = {name: str(root / "ref" / name) for name in ARCHS}
    timed("make_references", mcore.make_references, [(ARCHS[n], d) for n, d in refs.items()])
    tp1 = {(n, fmt): str(root / "tp1" / fmt / n) for n in ARCHS for fmt in mcore.FORMATS}
    saves = [SaveJob(refs[n], ARCHS[n], d, fmt) for (n, fmt), d in tp1.items()]
    timed("save tp1", mcore.megatron_save_many, saves, 1, 1)
    yield {"root": root, "refs": refs, "tp1": tp1}
    print("\nmegatron harness timings:", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def timed(label, fn, *args):
    start = time.monotonic()
    out = fn(*args)
    TIMINGS[label] = time.monotonic() - start
    return out


def reference_logits(world, name) -> torch.Tensor:
    return torch.load(os.path.join(world["refs"][name], "logits.pt"), weights_only=True)


def assert_reference_logits(world, jobs: list[LoadJob], logits: list[torch.Tensor]) -> None:
    assert len(logits) == len(jobs)
    for job, got in zip(jobs, logits):
        name = next(n for n, a in ARCHS.items() if a is job.arch)
        want = reference_logits(world, name)
        assert got.shape == want.shape == (2, 16, job.arch["vocab_size"])
        diff = (got - want).abs().max().item()
        assert diff <= TOLERANCE, f"{name} {job.fmt} from {job.ckpt_dir}: max |logits - reference| = {diff}"


def test_reference_holds_local_spec_names_padded_vocab_and_arch(world):
    from safetensors import safe_open

    for name, arch in ARCHS.items():
        ref = world["refs"][name]
        with safe_open(os.path.join(ref, "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            assert {k: json.loads(v) for k, v in f.metadata().items()} == arch
            emb = f.get_tensor("embedding.word_embeddings.weight")
            assert f.get_tensor("decoder.layers.3.self_attention.linear_qkv.weight").dtype == torch.float32
        assert emb.shape == (mcore.padded_vocab(arch, 1), arch["hidden_size"])
        assert not any(k.endswith("_extra_state") for k in keys)
        assert ("output_layer.weight" in keys) == arch["untie_embeddings_and_output_weights"]
        assert ("embedding.position_embeddings.weight" in keys) == arch["add_position_embedding"]
        assert {f"decoder.layers.{i}.mlp.linear_fc2.weight" for i in range(4)} <= keys
        with open(os.path.join(ref, "arch.json")) as f:
            assert json.load(f) == arch
        assert reference_logits(world, name).shape == (2, 16, arch["vocab_size"])


def test_tp1_checkpoints_give_reference_logits(world):
    jobs = [LoadJob(d, fmt, ARCHS[n]) for (n, fmt), d in world["tp1"].items()]
    assert_reference_logits(world, jobs, timed("load tp1 (6 jobs)", mcore.load_logits, jobs, 1, 1))


@pytest.mark.parametrize("tp,pp,vpp", [(2, 2, 1), (1, 2, 2)], ids=["tp2_pp2", "pp2_vpp2"])
def test_resharded_checkpoints_give_reference_logits(world, tp, pp, vpp):
    """torch_dist TP1 loaded (megatron reshards) and legacy files megatron wrote at the layout itself."""
    label = f"tp{tp}_pp{pp}_vpp{vpp}"
    legacy = {n: str(world["root"] / label / n) for n in ARCHS}
    saves = [SaveJob(world["tp1"][(n, "megatron-dist")], ARCHS[n], d, "megatron") for n, d in legacy.items()]
    timed(f"save legacy {label}", mcore.megatron_save_many, saves, tp, pp, vpp)
    jobs = [LoadJob(world["tp1"][(n, "megatron-dist")], "megatron-dist", ARCHS[n]) for n in ARCHS]
    jobs += [LoadJob(d, "megatron", ARCHS[n]) for n, d in legacy.items()]
    assert_reference_logits(world, jobs, timed(f"load {label} (6 jobs)", mcore.load_logits, jobs, tp, pp, vpp))
    rank_file = os.path.join(legacy["gqa_swiglu_rms"], "iter_0000100", "mp_rank_00_001", "model_optim_rng.pt")
    state = torch.load(rank_file, weights_only=False)
    assert {k for k in state if k.startswith("model")} == ({"model"} if vpp == 1 else {"model0", "model1"})


def test_four_ranks_share_two_kv_groups(world):
    """TP4 with num_query_groups=2 (and 4, 8): megatron reshards the TP1 torch_dist checkpoints."""
    jobs = [LoadJob(world["tp1"][(n, "megatron-dist")], "megatron-dist", ARCHS[n]) for n in ARCHS]
    assert_reference_logits(world, jobs, timed("load tp4 (3 jobs)", mcore.load_logits, jobs, 4, 1))


def test_rank_failure_raises_with_child_traceback(world):
    """Loading with the wrong arch fails Megatron-LM's args check in the child; the parent gets the traceback."""
    job = LoadJob(world["tp1"][("gqa_swiglu_rms", "megatron")], "megatron", ARCHS["mha_gelu_ln_tied"])
    with pytest.raises(MegatronRunError, match="add_position_embedding") as err:
        mcore.load_logits([job], 1, 1, timeout=120)
    assert "Traceback (most recent call last)" in str(err.value)
