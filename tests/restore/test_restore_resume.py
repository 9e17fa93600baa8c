"""A restored step resumes training in real megatron-core: its optimizers load the state the way Megatron-LM's
training loop does (the non-distributed FP32Optimizer from either format, the DistributedOptimizer from
torch_dist at another data-parallel size), the LR scheduler continues where the step left it, one optimizer
step updates every parameter exactly as Adam from the stored moments does, and what Megatron then saves imports
back bit for bit. A weights-only step restores with a warning and loads with --no-load-optim.

Two launches of megatron processes on CPU (mcore_resume.py): all jobs at TP2/PP2, then one at TP1/PP2/DP2.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowcheck.restore.arch import ModelArch
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target, cut
from flowcheck.restore.megatron_map import chunk_key, model_params, rank_tensors
from flowcheck.restore.megatron_optim import decayed
from flowcheck.restore.service import restore

from . import mcore
from .conftest import ITERATION, SAMPLES, SCHEDULE, TRAIN, make_store, same_or_padded, scheduled_lr, stored_step

pytestmark = pytest.mark.skipif(
    not mcore.megatron_available(),
    reason="megatron-core (and psutil) not installed: pip install 'megatron-core==0.16.1' psutil",
)

def adam_step(arch: ModelArch, state: dict[str, torch.Tensor], lr: float, grad_scale: float = 0.01) -> dict:
    """Every canonical weight after one torch AdamW step from the stored moments (the gradient: grad_scale * weight)."""
    out = {}
    for p in model_params(arch):
        weight = torch.nn.Parameter(state[p.name].clone())
        weight.grad = grad_scale * state[p.name]
        opt = torch.optim.AdamW([weight], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1 if decayed(p.name, p.shape) else 0.0)
        opt.state[weight] = {"step": torch.tensor(float(ITERATION)), "exp_avg": state[f"optimizer.exp_avg.{p.name}"].clone(),
                             "exp_avg_sq": state[f"optimizer.exp_avg_sq.{p.name}"].clone()}
        opt.step()
        out[p.name] = weight.detach()
    return out


def assert_ranks_hold(arch: ModelArch, per_rank: dict, which: str, full: dict, layout: tuple[int, int, int]) -> None:
    tp, pp, vpp = layout
    for (t, p, _), got in per_rank.items():
        rts = {(chunk_key(vpp, rt.chunk), rt.key): rt for rt in rank_tensors(arch, tp, pp, vpp, t, p)}
        assert set(got[which]) == set(rts), (t, p)
        for key, tensor in got[which].items():
            want = cut(full[rts[key].param.name], rts[key])
            torch.testing.assert_close(tensor, want, rtol=1e-6, atol=1e-7, msg=f"{which} {key} on rank tp={t} pp={p}")


def assert_resumed_schedule(per_rank: dict) -> None:
    """The optimizer's groups after loading: the scheduler's LR and decay, the stored Adam hyper-parameters."""
    for rank, got in per_rank.items():
        assert got["iteration"] == ITERATION and got["consumed_train_samples"] == SAMPLES, rank
        assert got["scheduler"] == SCHEDULE, rank
        assert [g["wd_mult"] for g in got["groups"]] == [1.0, 0.0], rank
        for g in got["groups"]:
            assert g["lr"] == pytest.approx(scheduled_lr(), rel=1e-12), rank
            assert g["weight_decay"] == pytest.approx(0.1 * g["wd_mult"]), rank
            assert (tuple(g["betas"]), g["eps"], g["max_lr"], g["min_lr"]) == ((0.9, 0.95), 1e-8, 3e-3, 3e-4), rank
            assert g["decoupled_weight_decay"] is True, rank


# ---------------------------------------------------------------- TP2 x PP2, one launch for every job

ARCH = "gqa_bias_groups2"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    arch = ModelArch.from_mapping(mcore.ARCHS[ARCH])
    states, reports, jobs = {}, {}, []
    for kind in ("push", "args", "weights"):
        store = make_store(root, kind)
        states[kind] = stored_step(store, arch, kind)
        for fmt in mcore.FORMATS:
            # nothing in an args-only step says which Adam: FusedAdam unless told (the torch_dist job runs torch's)
            adam = "torch" if (kind, fmt) == ("args", "megatron-dist") else None
            reports[kind, fmt] = restore(store, ITERATION, Target(2, 2, 1, fmt, adam=adam), str(root / f"{kind}-{fmt}"))
    # (stored step, format, distributed optimizer, Adam): megatron-core's Adam is torch AdamW without TE/Apex,
    # FusedAdam with them (the distributed optimizer loads optimizer state only with it)
    for kind, fmt, dist_opt, adam in (("push", "megatron", False, "torch"), ("push", "megatron-dist", True, "fused"),
                                      ("args", "megatron", False, "fused"), ("args", "megatron-dist", False, "torch"),
                                      ("weights", "megatron", False, "torch"),
                                      ("weights", "megatron-dist", False, "torch")):
        rep = reports[kind, fmt]
        jobs.append(mcore.ResumeJob(rep.out, fmt, mcore.ARCHS[ARCH], TRAIN, dist_opt=dist_opt, adam=adam,
                                    flags=rep.resume.flags,
                                    save_dir=str(root / f"saved-{kind}-{fmt}") if kind != "weights" else None,
                                    step=kind != "weights"))
    results = mcore.resume(jobs, 2, 2)
    got = {(j.fmt, kind): r for j, kind, r in zip(jobs, ("push", "push", "args", "args", "weights", "weights"), results)}
    return SimpleNamespace(root=root, arch=arch, states=states, reports=reports, got=got)


@pytest.mark.parametrize("fmt,kind", [("megatron", "push"), ("megatron-dist", "push"), ("megatron", "args"),
                                      ("megatron-dist", "args")])
def test_adam_state_resumes_at_tp2_pp2_with_the_schedules_lr_and_steps(resumed, fmt, kind):
    """legacy: FP32Optimizer; torch_dist: DistributedOptimizer (push) and FP32Optimizer (args); the groups and
    schedule stored by a push, or derived from the job's args exactly as Megatron-LM builds them."""
    per_rank = resumed.got[fmt, kind]
    assert len(per_rank) == 4
    assert_resumed_schedule(per_rank)
    assert all(r["stepped"] for r in per_rank.values())
    expected = adam_step(resumed.arch, resumed.states[kind], scheduled_lr())
    assert_ranks_hold(resumed.arch, per_rank, "after", expected, (2, 2, 1))
    assert resumed.reports[kind, fmt].resume.flags == (("--no-load-rng",) if fmt == "megatron" else ())


def test_the_restore_names_where_groups_and_schedule_came_from(resumed):
    push, args = resumed.reports["push", "megatron-dist"].resume, resumed.reports["args", "megatron"].resume
    assert push.sources["lr_scheduler"] == "stored (scalars.lr_scheduler)"
    assert push.sources["param_groups"].startswith("stored (scalars.optimizer.param_groups)")
    assert push.sources["optimizer_step"] == "scalars.optimizer_step"
    assert args.sources["lr_scheduler"].startswith("derived from scalars.extra.megatron.args")
    assert "from scalars.extra.megatron.args: max_lr, min_lr" in args.sources["param_groups"]
    assert args.sources["consumed_train_samples"] == "scalars.extra.megatron.args.consumed_train_samples"
    assert not push.warnings and not args.warnings


@pytest.mark.parametrize("fmt,kind", [("megatron", "push"), ("megatron-dist", "push"), ("megatron", "args"),
                                      ("megatron-dist", "args")])
def test_what_megatron_saves_after_resuming_imports_back_bit_for_bit(resumed, fmt, kind):
    """restore -> megatron-core load -> Megatron's own writer -> flowcheck import: same tensors, step, schedule
    (saved by FP32Optimizer with torch AdamW or FusedAdam, and by the distributed optimizer)."""
    saved = make_store(resumed.root, f"back_{kind}_{fmt.replace('-', '_')}")
    m = import_into(saved, str(resumed.root / f"saved-{kind}-{fmt}"), ITERATION, arch=resumed.arch)
    assert (m.source_layout.tp, m.source_layout.pp) == (2, 2)
    state = resumed.states[kind]
    assert set(m.tensors) == set(state)
    for name, tensor in state.items():  # with the padding rows the restore wrote (the step stored none)
        assert same_or_padded(saved.read(ITERATION, name), tensor.numpy()), name
    assert m.scalars["optimizer_step"] == ITERATION
    megatron = m.scalars["extra"]["megatron"]
    assert megatron["opt_param_scheduler"] == SCHEDULE and megatron["args"]["consumed_train_samples"] == SAMPLES
    groups = m.scalars["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["betas"], g["eps"], g["max_lr"], g["min_lr"]) for g in groups] == [
        (1.0, [0.9, 0.95], 1e-8, 3e-3, 3e-4), (0.0, [0.9, 0.95], 1e-8, 3e-3, 3e-4)]
    again = restore(saved, ITERATION, Target(1, 1, 1, fmt), str(resumed.root / f"again-{kind}-{fmt}")).resume
    assert again.sources["lr_scheduler"] == "stored (scalars.extra.megatron.opt_param_scheduler)"
    def but_lr(groups):  # Megatron's scheduler set lr on loading (a group derived from args held max_lr)
        return [{k: v for k, v in g.items() if k != "lr"} for g in groups]

    assert but_lr(again.groups) == but_lr(resumed.reports[kind, fmt].resume.groups)
    assert [g["lr"] for g in again.groups] == pytest.approx([scheduled_lr()] * 2, rel=1e-12)


@pytest.mark.parametrize("fmt", mcore.FORMATS)
def test_a_weights_only_step_restores_model_only_and_loads_with_no_load_optim(resumed, fmt):
    rep = resumed.reports["weights", fmt]
    assert not rep.resume.optimizer and "--no-load-optim" in rep.resume.flags
    assert any("model weights only" in w for w in rep.resume.warnings)
    per_rank = resumed.got[fmt, "weights"]
    assert len(per_rank) == 4
    for rank, got in per_rank.items():
        assert got["iteration"] == ITERATION and got["consumed_train_samples"] == SAMPLES, rank
    assert_ranks_hold(resumed.arch, per_rank, "before", resumed.states["weights"], (2, 2, 1))


# ---------------------------------------------------------------- the distributed optimizer at another DP size

def test_torch_dist_loads_into_the_distributed_optimizer_at_another_data_parallel_size(tmp_path):
    """Stored from 4 data-parallel replicas, resumed by 2 (TP1 x PP2, tied embeddings: the last stage's output
    layer shares the word embedding's moments): every DP rank's shard of the moments is the stored one."""
    name = "mha_gelu_ln_tied"
    arch = ModelArch.from_mapping(mcore.ARCHS[name])
    store = make_store(tmp_path, "dp")
    state = stored_step(store, arch, "push", seed=11)
    assert store.manifest(ITERATION).source_layout.dp == 4
    out = restore(store, ITERATION, Target(1, 2, 1, "megatron-dist", dist_optim=True), str(tmp_path / "ck")).out
    job = mcore.ResumeJob(out, "megatron-dist", mcore.ARCHS[name], TRAIN, dist_opt=True, adam="fused")
    (per_rank,) = mcore.resume([job], 1, 2, dp=2)
    assert sorted(per_rank) == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert_resumed_schedule(per_rank)
    assert_ranks_hold(arch, per_rank, "after", adam_step(arch, state, scheduled_lr()), (1, 2, 1))
