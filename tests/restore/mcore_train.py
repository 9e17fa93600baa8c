"""Child side of the Megatron training-loop test: a GPT trained with real megatron-core on CPU (gloo, one process per
rank, megatron's DDP and optimizer, Adam, cosine OptimizerParamScheduler), pushing every step with flowcheck's
Checkpointer, or resumed from a checkpoint ``flowcheck restore`` wrote.

The test runs ``main(TASK_DIR)`` in a fresh interpreter (``python -c``, as tests/restore/mcore.py does), which imports megatron once and forks one
child per rank.  Ops: ``train`` (push steps 1..k, dump the trainer's own full state at k, train m more steps as the
uninterrupted reference, then hang until the test kills the job) and ``resume`` (load a restored checkpoint at a new
layout, train m steps).  Results go to TASK_DIR as JSON / torch files; a failing rank writes ``error_<rank>.txt``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore")  # megatron warns about missing Apex/TE on every import

import mcore_worker as W  # the harness of this folder (the test puts it on sys.path)
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.overrides import TorchFunctionMode

from flowcheck.demo.ranks import leave_group

GLOBAL_BATCH, SEQ, SEED = 4, 16, 1234
LR, MIN_LR, WD = 1e-2, 1e-3, 0.01
WARMUP_SAMPLES, DECAY_SAMPLES = GLOBAL_BATCH, 12 * GLOBAL_BATCH
BUCKET = 4000  # elements: several gradient buckets, so DP ranges cross parameter boundaries


class OnCpu(TorchFunctionMode):
    """megatron's optimizer and DDP allocate small tensors on ``device='cuda'`` and check ``param.type()`` for
    ``torch.cuda.*Tensor``: run them on the CPU unchanged otherwise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (device == "cuda" or getattr(device, "type", None) == "cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _patch_torch_adam_load() -> None:
    """megatron-core 0.16.1's distributed optimizer, on torch's AdamW (its fallback without Apex/TE: the only one
    on CPU), keeps a per-parameter ``step`` its fully_reshardable load does not provide (KeyError 'step' in
    _set_main_param_and_optimizer_states): keep the step load_state_dict already set from the param groups."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        step = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]].get("step")
        original(self, model_param, tensors if step is None or "step" in tensors else {**tensors, "step": step})

    DistributedOptimizer._set_main_param_and_optimizer_states = keep_step


# ---------------------------------------------------------------- the trainer

def build(arch: dict, tp: int, pp: int, distributed: bool, freeze: tuple[str, ...] = ()):
    """(DDP model chunks, megatron optimizer, scheduler) as Megatron-LM's setup_model_and_optimizer builds them;
    parameters whose names start with one of ``freeze`` are frozen first (no gradient buffer, no optimizer state)."""
    torch.manual_seed(SEED)
    chunks = W.build_chunks(arch, tp, pp, 1)
    for c in chunks:
        for name, p in c.named_parameters():
            if freeze and name.startswith(tuple(freeze)):
                p.requires_grad_(False)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads  # the DP gradient reduce-scatter / all-reduce
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=False,
                                        bucket_size=BUCKET)
    model = []
    for c in chunks:
        c.train()
        model.append(DistributedDataParallel(config, ddp, c))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD,
                                                 adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
                                                 use_distributed_optimizer=distributed), model)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP_SAMPLES,
                                    lr_decay_steps=DECAY_SAMPLES, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
                                    wd_incr_steps=DECAY_SAMPLES, wd_incr_style="constant")
    return model, opt, sched


def samples(iteration: int, vocab: int) -> list[torch.Tensor]:
    """This DP rank's share of iteration ``iteration``'s global batch: sample i of the run is seeded by i alone,
    so every layout (any DP size) trains on the same data; tokens are real vocabulary ids (never padding rows)."""
    dp, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per = GLOBAL_BATCH // dp
    first = (iteration - 1) * GLOBAL_BATCH + r * per
    return [torch.randint(0, vocab, (SEQ + 1,), generator=torch.Generator().manual_seed(SEED + i))
            for i in range(first, first + per)]


def _forward_step(data, model):
    s = next(data)
    tokens, labels = s[:-1][None], s[1:][None]
    positions = torch.arange(SEQ)[None]
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    out = model(tokens, positions, mask, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # megatron divides the loss in place by the microbatches

    return out, loss_func


def train_step(model, opt, sched, iteration: int, vocab: int) -> tuple[float | None, float]:
    """One iteration; (the global batch's mean loss on the last stage's ranks else None, the lr it used)."""
    mine = samples(iteration, vocab)
    for m in model:
        m.zero_grad_buffer()
    opt.zero_grad()
    lr = opt.param_groups[0]["lr"]
    losses = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(mine), model=model,
                                         num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=1,
                                         forward_only=False)
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError(f"iteration {iteration}: the optimizer step failed")
    sched.step(increment=GLOBAL_BATCH)
    if not parallel_state.is_pipeline_last_stage():
        return None, lr
    local = torch.stack([x["lm loss"] for x in losses]).sum()
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return float(local) / GLOBAL_BATCH, lr


# ---------------------------------------------------------------- ops

def op_train(task: dict, rank: int) -> None:
    from flowcheck.restore.arch import ModelArch

    from flowcheck.torch import Checkpointer

    tp, pp, k, m = task["tp"], task["pp"], task["k"], task["m"]
    model, opt, sched = build(task["arch"], tp, pp, distributed=task.get("distributed", True),
                              freeze=tuple(task.get("freeze", ())))
    ckpt = Checkpointer(model, opt, sched, node=task["node"], run=task["run"], arch=ModelArch.from_mapping(task["arch"]),
                        timeout_s=60)
    record = []
    for it in range(1, k + m + 1):
        loss, lr = train_step(model, opt, sched, it, task["arch"]["vocab_size"])
        record.append({"iteration": it, "loss": loss, "lr": lr})
        if it <= k:
            ckpt.save(it, consumed_train_samples=it * GLOBAL_BATCH)
        if it == k:
            if not ckpt.flush(60):
                raise RuntimeError(f"push of step {k} failed: {ckpt.stats.last_error}")
            ckpt.close()
            dump_state(model, opt, task["dir"], sched)
    write_record(task["dir"], "train", record)
    open(os.path.join(task["dir"], f"done_{rank}"), "w").close()
    time.sleep(3600)  # the job is killed here (SIGKILL), as a crashed job


def op_resume(task: dict, rank: int) -> None:
    """Load a restored checkpoint, save it again with Megatron's own writer if asked (``save_dir``: torch_dist, this
    job's optimizer), train ``m`` steps."""
    fmt = task["fmt"]
    model, opt, sched = build(task["arch"], task["tp"], task["pp"], distributed=fmt == "megatron-dist")
    start = (load_dist if fmt == "megatron-dist" else load_legacy)(model, opt, sched, task["ckpt_dir"])
    if task.get("save_dir"):
        from types import SimpleNamespace

        from mcore_resume import save

        job = {"fmt": "megatron-dist", "arch": task["arch"], "save_dir": task["save_dir"],
               "dist_opt": fmt == "megatron-dist"}
        save([m.module for m in model], opt, sched, job,
             {"iteration": start, "args": SimpleNamespace(consumed_train_samples=start * GLOBAL_BATCH)})
    vocab = task["arch"]["vocab_size"]
    record = [{"iteration": it, **dict(zip(("loss", "lr"), train_step(model, opt, sched, it, vocab)))}
              for it in range(start + 1, start + task["m"] + 1)]
    write_record(task["dir"], f"resume_{task['index']}", record, start)


def write_record(task_dir: str, name: str, record: list[dict], start: int | None = None) -> None:
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        with open(os.path.join(task_dir, f"{name}.json"), "w") as f:
            json.dump({"start": start, "steps": record}, f)


def dump_state(model, opt, task_dir: str, sched) -> None:
    """The trainer's own full state, TP-local: weights and optimizer slots (a distributed optimizer's assembled from
    the DP ranks' ranges: each rank's range in place, zeros elsewhere, summed over DP)."""
    (leaf,) = opt.chained_optimizers
    state = {}
    for v, chunk in enumerate(model):
        for name, p in chunk.module.named_parameters():
            state[("weight", v, name)] = p.detach().clone()
            for slot, t in (_full_slots(leaf, p) if p.requires_grad else {}).items():  # frozen: no optimizer state
                state[(slot, v, name)] = t
    if parallel_state.get_data_parallel_rank() == 0:
        rank = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
        (step,) = {int(s["step"]) for s in leaf.optimizer.state.values()}
        if hasattr(leaf, "model_param_group_index_map"):  # as megatron's distributed optimizer saves them
            groups = opt.state_dict()["optimizer"]["param_groups"]
        else:
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": step} for g in leaf.optimizer.param_groups]
        torch.save({"rank": rank, "state": state, "param_groups": groups, "step": step, "scheduler": sched.state_dict()},
                   os.path.join(task_dir, f"state_{rank[0]}_{rank[1]}.pt"))


def _full_slots(leaf, p) -> dict[str, torch.Tensor]:
    if not hasattr(leaf, "model_param_group_index_map"):  # non-distributed: every DP replica holds it all
        return {k: t.detach().clone() for k, t in leaf.optimizer.state[p].items() if t.dim() > 0}
    held = p in leaf.model_param_group_index_map
    rng = leaf._get_model_param_range_map(p)["param"] if held else None
    slots = leaf._get_main_param_and_optimizer_states(p) if held else {}
    out = {}
    for slot in ("param", "exp_avg", "exp_avg_sq"):
        full = torch.zeros(p.numel(), dtype=torch.float32)
        if held:
            full[rng.start:rng.end] = slots[slot].detach()
        dist.all_reduce(full, group=parallel_state.get_data_parallel_group())
        out[slot] = full.view(p.shape)
    return out


def load_dist(model, opt, sched, ckpt_dir: str) -> int:
    """What Megatron-LM's load_checkpoint does for --ckpt-format torch_dist with the distributed optimizer."""
    iter_dir, _ = W.read_tracker(ckpt_dir)
    common = dist_checkpointing.load_common_state_dict(iter_dir)
    W.check_iteration(common, False, iter_dir)
    meta = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    meta.setdefault("distrib_optim_sharding_type", common["optimizer"]["param_state_sharding_type"])
    meta["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for leaf in opt.chained_optimizers:
        # with torch's AdamW (no Apex/TE on CPU) the distributed optimizer's state_dict() reads the step from
        # allocated state: allocate it as megatron's own fsdp_dtensor load does (the load overwrites all of it)
        if len(leaf.optimizer.state) == 0:
            leaf._init_optimizer_states_with_dummy_values()
    (chunk,) = model
    request = {"model": chunk.module.sharded_state_dict(metadata=meta)}
    request["optimizer"] = opt.sharded_state_dict(request, is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load(request, iter_dir)
    chunk.module.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    for leaf in opt.chained_optimizers:
        # megatron-core 0.16.1 (torch's AdamW fallback) gives every parameter the *same* loaded step tensor, which
        # AdamW then increments once per parameter: give each its own, as a trained optimizer has
        for state in leaf.optimizer.state.values():
            state["step"] = state["step"].clone()
    sched.load_state_dict(common["opt_param_scheduler"])
    return int(common["iteration"])


def load_legacy(model, opt, sched, ckpt_dir: str) -> int:
    """What Megatron-LM's load_checkpoint does for --ckpt-format torch with the non-distributed optimizer."""
    iter_dir, _ = W.read_tracker(ckpt_dir)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    path = os.path.join(iter_dir, f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    W.check_iteration(state, False, path)
    (chunk,) = model
    chunk.module.load_state_dict(state["model"], strict=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["opt_param_scheduler"])
    return int(state["iteration"])


OPS = {"train": op_train, "resume": op_resume}


# ---------------------------------------------------------------- processes

def run_rank(task: dict, rank: int) -> None:
    W._patch_cuda()
    _patch_torch_adam_load()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{task['port']}", rank=rank,
                            world_size=task["world"], timeout=timedelta(seconds=task["timeout"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=task["tp"],
                                             pipeline_model_parallel_size=task["pp"])
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    with OnCpu():
        for job in task["jobs"]:
            OPS[task["op"]]({**task, **job}, rank)
            dist.barrier()
    leave_group()


def main(task_dir: str) -> int:
    return W.main(task_dir, run_rank)


if __name__ == "__main__":
    sys.exit("run through the test (tests/restore/test_megatron_train_loop.py)")
