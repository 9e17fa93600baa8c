"""flowcheck restore output loaded by real megatron-core GPTModels (gloo on CPU) at every TP x PP x VPP asked.

Three model configs are imported once (from megatron's own TP1 weights), restored into each layout in both
formats, and loaded by megatron processes of that layout (legacy: load_state_dict(strict=True); torch_dist:
dist_checkpointing.load); their logits must equal the source model's.
"""
from __future__ import annotations

import os

import pytest
import torch

from flowcheck.restore.arch import ModelArch
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target
from flowcheck.restore.service import restore

from . import mcore
from .conftest import make_store

pytestmark = pytest.mark.skipif(
    not mcore.megatron_available(),
    reason="megatron-core (and psutil) not installed: pip install 'megatron-core==0.16.1' psutil",
)

LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (4, 2, 1), (1, 2, 2), (2, 2, 2), (4, 2, 2)]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A store holding each config's reference weights (made by megatron at TP1/PP1) as step 100 of its own run."""
    root = tmp_path_factory.mktemp("megatron")
    refs = {name: str(root / f"ref-{name}") for name in mcore.ARCHS}
    mcore.make_references([(mcore.ARCHS[n], d) for n, d in refs.items()])
    stores = {}
    for name, d in refs.items():
        store = make_store(root, name)
        m = import_into(store, os.path.join(d, "model.safetensors"), 100)
        assert m.producer.source == "import"
        stores[name] = store
    logits = {n: torch.load(os.path.join(d, "logits.pt"), weights_only=True) for n, d in refs.items()}
    return root, stores, logits


@pytest.mark.parametrize("tp,pp,vpp", LAYOUTS, ids=[f"tp{t}-pp{p}-vpp{v}" for t, p, v in LAYOUTS])
def test_megatron_loads_the_restore_and_gives_the_source_logits(imported, tp, pp, vpp):
    root, stores, want = imported
    jobs, names = [], []
    for name, store in stores.items():
        for fmt in mcore.FORMATS:
            out = str(root / f"out-{name}-{fmt}-{tp}{pp}{vpp}")
            restore(store, 100, Target(tp, pp, vpp, fmt), out)
            jobs.append(mcore.LoadJob(out, fmt, mcore.ARCHS[name]))
            names.append((name, fmt))
    got = mcore.load_logits(jobs, tp, pp, vpp)
    for (name, fmt), logits in zip(names, got):
        diff = (logits - want[name]).abs().max().item()
        assert logits.shape == want[name].shape and diff <= 1e-5, f"{name} {fmt} at TP={tp} PP={pp} VPP={vpp}: {diff}"


def test_bf16_restore_loads_with_bf16_rounding_only(imported):
    root, stores, want = imported
    name = "gqa_swiglu_rms"
    out = str(root / "out-bf16")
    restore(stores[name], 100, Target(2, 2, 1, "megatron", dtype="bf16"), out)
    (logits,) = mcore.load_logits([mcore.LoadJob(out, "megatron", mcore.ARCHS[name])], 2, 2, 1)
    scale = want[name].abs().max().item()
    diff = (logits - want[name]).abs().max().item()
    assert 0 < diff <= 2e-2 * scale, diff  # the weights went through bf16: close, not equal


def test_checkpoint_written_by_megatron_imports_and_restores_elsewhere(imported):
    """Import a TP=2/PP=2 checkpoint megatron wrote itself (both formats), restore it at TP=4/PP=1."""
    root, _stores, want = imported
    name = "gqa_bias_groups2"
    ref = str(root / f"ref-{name}")
    jobs = []
    for fmt in mcore.FORMATS:
        theirs = str(root / f"theirs-{fmt}")
        mcore.megatron_save(ref, mcore.ARCHS[name], theirs, fmt, 2, 2, 1)
        store = make_store(root, f"theirs_{fmt.replace('-', '_')}")
        # the harness's args name only the layout and a few sizes: the model comes as --arch would give it
        m = import_into(store, theirs, 100, arch=ModelArch.from_mapping(mcore.ARCHS[name]))
        assert (m.source_layout.tp, m.source_layout.pp) == (2, 2)
        out = str(root / f"mine-{fmt}")
        restore(store, 100, Target(4, 1, 1, fmt), out)
        jobs.append(mcore.LoadJob(out, fmt, mcore.ARCHS[name]))
    for logits in mcore.load_logits(jobs, 4, 1, 1):
        assert (logits - want[name]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("fmt,tp,pp,vpp", [("megatron-dist", 2, 2, 1), ("megatron-dist", 4, 1, 1),
                                            ("megatron-dist", 1, 2, 2), ("megatron", 2, 2, 2), ("megatron", 4, 1, 1)])
def test_megatron_loads_optimizer_moments_bit_exact(imported, tmp_path, fmt, tp, pp, vpp):
    """What Megatron's optimizer reads back per rank (torch_dist: the fully_reshardable sharded tensors;
    legacy: the non-distributed optimizer's state by parameter index) equals our canonical moments cut by
    the split rules, bit for bit."""
    from safetensors.torch import load_file, save_file

    from flowcheck.restore.megatron_common import cut
    from flowcheck.restore.megatron_map import chunk_key, rank_tensors

    root, _, _ = imported
    name = "gqa_bias_groups2"
    arch = ModelArch.from_mapping(mcore.ARCHS[name])
    ref = os.path.join(root, f"ref-{name}")
    state = load_file(os.path.join(ref, "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for k in list(state):
        state[f"optimizer.exp_avg.{k}"] = torch.randn(state[k].shape, generator=g)
        state[f"optimizer.exp_avg_sq.{k}"] = torch.rand(state[k].shape, generator=g)
    src = str(tmp_path / "with-optim.safetensors")
    meta = {k: __import__("json").dumps(v) for k, v in arch.to_json().items()}
    save_file(state, src, metadata=dict(meta, optimizer_step="7"))
    store = make_store(tmp_path, "optim")
    import_into(store, src, 100)
    out = str(tmp_path / "ck")
    restore(store, 100, Target(tp, pp, vpp, fmt, adam="torch"), out)  # the harness loads into torch.optim.Adam
    (per_rank,) = mcore.load_optimizer([mcore.LoadJob(out, fmt, mcore.ARCHS[name])], tp, pp, vpp)
    assert len(per_rank) == tp * pp
    checked = 0
    # the reference's every row, Megatron's padding rows included, as imported: the step stores them all
    stored = arch.with_stored_rows(state["embedding.word_embeddings.weight"].shape[0], "the reference")
    for (t, p), got in per_rank.items():
        rts = {(chunk_key(vpp, rt.chunk), rt.key): rt for rt in rank_tensors(stored, tp, pp, vpp, t, p)}
        for (slot, ck, key), tensor in got.items():
            if slot == "step":
                assert tensor.item() == 7.0 if fmt == "megatron" else True
                continue
            rt = rts[ck, key]
            canonical = state[rt.param.name if slot == "param" else f"optimizer.{slot}.{rt.param.name}"]
            want = cut(canonical, rt)
            assert torch.equal(tensor, want), (slot, t, p, key)
            checked += 1
    assert checked >= (3 if fmt == "megatron-dist" else 2) * len(rts)


@pytest.mark.parametrize("tp,pp,vpp", [(2, 2, 2), (4, 2, 1)])
def test_rank_tensors_follow_megatrons_parameter_order_and_shapes(tp, pp, vpp):
    """The legacy optimizer indexes state by named_parameters() order: ours must be Megatron's, per rank."""
    from flowcheck.restore.megatron_map import rank_tensors

    archs = list(mcore.ARCHS.values())
    for arch_raw, per_rank in zip(archs, mcore.parameter_names(archs, tp, pp, vpp)):
        arch = ModelArch.from_mapping(arch_raw)
        assert len(per_rank) == tp * pp
        for (t, p), theirs in per_rank.items():
            rts = sorted(rank_tensors(arch, tp, pp, vpp, t, p), key=lambda rt: rt.chunk)
            ours = [(rt.chunk, rt.key, rt.shape) for rt in rts]
            assert ours == theirs, (t, p)
