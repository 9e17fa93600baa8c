"""Child side of mcore.resume: a checkpoint loaded the way Megatron-LM's training loop loads it, then saved the way
it saves one, then one optimizer step — megatron-core's own optimizers and LR scheduler, on CPU with gloo.

megatron/training is not part of the megatron-core wheel: ``load`` and ``save`` follow its checkpointing.py
(load_checkpoint, generate_state_dict, save_checkpoint) and ``scheduler_from_args`` its
get_optimizer_param_scheduler, for the paths a GPT model with Adam takes: the non-distributed FP32Optimizer and
the DistributedOptimizer, ``--ckpt-format torch`` and ``torch_dist``, the --no-load-optim / --no-load-rng /
--override-opt_param-scheduler flags.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from mcore_worker import (CONTENT_METADATA, _layout, build_chunks, check_iteration, check_legacy_args, chunk_key,
                          megatron_args, read_tracker, transformer_config)
from megatron.core import dist_checkpointing, parallel_state
from torch.optim.adam import adam as adam_update

# what Megatron-LM's _build_sharded_state_dict_metadata adds for --use-distributed-optimizer
# --dist-ckpt-optim-fully-reshardable (the only distributed-optimizer form that survives a TP/PP change)
DIST_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                     "distrib_optim_fully_reshardable_mem_efficient": False}


def patch_cpu_optimizer() -> None:
    """megatron-core's optimizers allocate a few scalars on "cuda" and check ``param.type()`` for CUDA tensor
    types; on CPU these become CPU tensors and CPU parameters answer as the CUDA type of the same dtype."""
    original_type = torch.Tensor.type
    if getattr(original_type, "cpu_patched", False):
        return

    def tensor_type(self, *args, **kwargs):
        out = original_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(out, str) or out.startswith("torch.cuda."):
            return out
        return "torch.cuda." + out[len("torch."):]

    tensor_type.cpu_patched = True
    torch.Tensor.type = tensor_type
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def _on_cpu(factory):
    def made(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return made


# ---------------------------------------------------------------- the optimizer megatron-core picks

class CpuFusedAdam(torch.optim.Optimizer):
    """Transformer Engine's / Apex's FusedAdam as megatron-core meets it (its optimizer on GPU machines), on CPU:
    each group keeps its step count (``group['step']``) and ``bias_correction``; the update is torch AdamW's
    arithmetic. megatron-core 0.16.1's DistributedOptimizer loads optimizer state only with such an optimizer:
    with torch's own Adam it puts the step into per-parameter state and then fails to copy it (KeyError 'step')."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue  # as TE: an empty group does not count a step
            group["step"] = group.get("step", 0) + 1
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            if not group["bias_correction"]:
                raise NotImplementedError("CpuFusedAdam: bias_correction=False")
            steps = [torch.tensor(float(group["step"] - 1)) for _ in params]  # adam() counts them up by one
            adam_update(
                params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params], [], steps, decoupled_weight_decay=self.adam_w_mode,
                amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


@contextmanager
def adam_of(kind: str):
    """Build megatron-core's optimizer with torch's AdamW ("torch": its choice without TE/Apex) or FusedAdam
    ("fused": its choice with them; megatron-core reads that choice from module globals at import)."""
    import megatron.core.optimizer as optim
    from megatron.core.optimizer import distrib_optimizer

    names = ((optim, "Adam"), (optim, "USING_PYTORCH_OPTIMIZER"), (distrib_optimizer, "Adam"),
             (distrib_optimizer, "HAVE_APEX_OR_TE"), (distrib_optimizer, "USING_APEX_OPTIMIZER"))
    saved = [getattr(module, name) for module, name in names]
    if kind == "fused":
        for (module, name), value in zip(names, (CpuFusedAdam, False, CpuFusedAdam, True, True)):
            setattr(module, name, value)
    elif kind != "torch":
        raise ValueError(f"adam: expected 'torch' or 'fused', found {kind!r}")
    try:
        yield
    finally:
        for (module, name), value in zip(names, saved):
            setattr(module, name, value)


# ---------------------------------------------------------------- the trainer

def build(arch: dict, args: dict, dist_opt: bool, override: bool):
    """(model chunks, DDP-wrapped chunks, optimizer, scheduler) as Megatron-LM's setup_model_and_optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tp, pp, vpp = _layout()
    chunks = build_chunks(arch, tp, pp, vpp)
    config = transformer_config(arch, tp, pp, vpp)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt)
    wrapped = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    optim_config = OptimizerConfig(
        optimizer="adam", lr=args["lr"], min_lr=args["min_lr"], weight_decay=args["weight_decay"],
        adam_beta1=args["adam_beta1"], adam_beta2=args["adam_beta2"], adam_eps=args["adam_eps"],
        clip_grad=0.0, use_distributed_optimizer=dist_opt, params_dtype=torch.float32)
    optimizer = get_megatron_optimizer(optim_config, wrapped)
    return chunks, wrapped, optimizer, scheduler_from_args(optimizer, args, override)


def scheduler_from_args(optimizer, args: dict, override: bool):
    """Megatron-LM's get_optimizer_param_scheduler (iteration-based training), checkpoint values checked against
    these unless overridden (--use-checkpoint-opt_param-scheduler is off by default)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    batch = args["global_batch_size"]
    decay = (args.get("lr_decay_iters") or args["train_iters"]) * batch
    return OptimizerParamScheduler(
        optimizer, init_lr=args.get("lr_warmup_init", 0.0), max_lr=args["lr"], min_lr=args["min_lr"],
        lr_warmup_steps=args.get("lr_warmup_iters", 0) * batch, lr_decay_steps=decay,
        lr_decay_style=args["lr_decay_style"], start_wd=args["weight_decay"], end_wd=args["weight_decay"],
        wd_incr_steps=args["train_iters"] * batch, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=override)


# ---------------------------------------------------------------- load (megatron/training/checkpointing.py)

def load(chunks, optimizer, scheduler, job: dict) -> dict:
    """Load as load_checkpoint does; returns what it restores besides tensors (iteration, args)."""
    flags = set(job["flags"])
    iter_dir, release = read_tracker(job["ckpt_dir"])
    if job["fmt"] == "megatron":
        state = _legacy_state(chunks, job["arch"], iter_dir, release)
        if "rng_state" not in state and "--no-load-rng" not in flags:
            raise RuntimeError("Unable to load rng state from checkpoint: Megatron-LM exits (pass --no-load-rng)")
    else:
        state = _dist_state(chunks, optimizer, scheduler, iter_dir, flags)
    if "--no-load-optim" not in flags:
        optimizer.load_state_dict(state["optimizer"])  # a KeyError: Megatron-LM says to pass --no-load-optim
        scheduler.load_state_dict(state["opt_param_scheduler"])
    return {"iteration": state["iteration"], "args": state["args"]}


def _legacy_state(chunks, arch: dict, iter_dir: str, release: bool) -> dict:
    tp, pp, vpp = _layout()
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    path = os.path.join(iter_dir, f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    check_iteration(state, release, path)
    check_legacy_args(state, arch, tp, pp, path)
    for v, chunk in enumerate(chunks):
        chunk.load_state_dict(state[chunk_key(v, vpp)], strict=True)
    return state


def _dist_state(chunks, optimizer, scheduler, iter_dir: str, flags: set[str]) -> dict:
    tp, pp, vpp = _layout()
    common = dist_checkpointing.load_common_state_dict(iter_dir)
    ckpt_args = common.get("args")
    same_layout = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                   getattr(ckpt_args, "pipeline_model_parallel_size", 1)) == (tp, pp)
    if same_layout and "--no-load-rng" not in flags and not getattr(ckpt_args, "no_save_rng", False):
        raise RuntimeError("Megatron-LM would ask for rng_state, which the checkpoint does not hold")
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    request: dict[str, Any] = {chunk_key(v, vpp): c.sharded_state_dict(metadata=metadata) for v, c in enumerate(chunks)}
    if "--no-load-optim" not in flags and not getattr(ckpt_args, "no_save_optim", False):
        request["optimizer"] = optimizer.sharded_state_dict(request, is_loading=True, metadata=metadata)
        request["opt_param_scheduler"] = scheduler.state_dict()
    state = dist_checkpointing.load(request, iter_dir, strict="assume_ok_unexpected")
    for v, chunk in enumerate(chunks):
        chunk.load_state_dict(state[chunk_key(v, vpp)], strict=True)
    return state


# ---------------------------------------------------------------- save

def save(chunks, optimizer, scheduler, job: dict, loaded: dict) -> None:
    """Save as save_checkpoint does (no RNG state), at the loaded iteration and data position."""
    _, pp, vpp = _layout()
    fmt, iteration = job["fmt"], loaded["iteration"]
    args = megatron_args(job["arch"], fmt)
    args.consumed_train_samples = loaded["args"].consumed_train_samples
    iter_dir = os.path.join(job["save_dir"], f"iter_{iteration:07d}")
    head = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "num_floating_point_operations_so_far": 0}
    if fmt == "megatron":
        if parallel_state.get_data_parallel_rank() == 0:
            t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
            rank_dir = os.path.join(iter_dir, f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
            os.makedirs(rank_dir, exist_ok=True)
            state = dict(head, optimizer=optimizer.state_dict(), opt_param_scheduler=scheduler.state_dict())
            state.update({chunk_key(v, vpp): c.state_dict_for_save_checkpoint() for v, c in enumerate(chunks)})
            torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    else:
        if dist.get_rank() == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        metadata = dict(CONTENT_METADATA, **(DIST_OPT_METADATA if job["dist_opt"] else {}))
        live = dict(metadata, dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        state = dict(head, **{chunk_key(v, vpp): c.sharded_state_dict(metadata=live) for v, c in enumerate(chunks)})
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=live)
        state["opt_param_scheduler"] = scheduler.state_dict()
        dist_checkpointing.save(state, iter_dir, content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(job["save_dir"], "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


# ---------------------------------------------------------------- the step

def step_resume(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    """Load, report the optimizer's groups and the schedule, save if asked, then take one step with the gradient
    ``grad_scale * param`` and report every parameter after it."""
    patch_cpu_optimizer()
    override = "--override-opt_param-scheduler" in job["flags"]
    with adam_of(job["adam"]):  # megatron-core reads the choice when it builds, loads and steps the optimizer
        chunks, wrapped, optimizer, scheduler = build(job["arch"], job["args"], job["dist_opt"], override)
        _run_job(task, job, chunks, wrapped, optimizer, scheduler)


def _run_job(task: dict, job: dict, chunks, wrapped, optimizer, scheduler) -> None:
    loaded = load(chunks, optimizer, scheduler, job)
    out = {"rank": _rank(), "iteration": loaded["iteration"],
           "consumed_train_samples": getattr(loaded["args"], "consumed_train_samples", None),
           "groups": [{k: g.get(k) for k in _REPORTED} for g in optimizer.param_groups],
           "scheduler": scheduler.state_dict(), "before": _params(chunks)}
    if job.get("save_dir"):
        save(chunks, optimizer, scheduler, job, loaded)
    if job.get("step", True):
        for c in wrapped:
            for p in c.module.parameters():
                p.main_grad.copy_(job["grad_scale"] * p.data)
        success, _, _ = optimizer.step()
        out["stepped"], out["after"] = success, _params(chunks)
    torch.save(out, os.path.join(task["dir"], f"resume_{job['index']}_{dist.get_rank()}.pt"))


_REPORTED = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "lr", "max_lr", "min_lr", "weight_decay",
             "betas", "eps", "decoupled_weight_decay", "bias_correction", "step")


def _rank() -> tuple[int, int, int]:
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank())


def _params(chunks) -> dict:
    _, _, vpp = _layout()
    return {(chunk_key(v, vpp), n): p.detach().clone() for v, c in enumerate(chunks) for n, p in c.named_parameters()}
