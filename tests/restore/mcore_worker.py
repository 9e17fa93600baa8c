"""Child side of tests/restore/mcore.py: real megatron-core GPTModels on CPU/gloo, one process per rank.

mcore.py runs ``main(TASK_DIR)`` in a fresh interpreter, which imports torch and megatron-core once (~10 s)
and then forks one child per rank instead of paying that import per rank. Each child runs the task's jobs
in order and writes its results and, on failure, ``error_<rank>.txt`` into TASK_DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore")  # megatron warns about missing Apex/TE on every import

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore import padded_vocab  # mcore.py puts this folder on sys.path
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from flowcheck.demo.ranks import exit_now, leave_group, run_ranks  # noqa: F401 - exit_now: the entry (mcore.py) leaves through it

# What Megatron-LM's _build_sharded_state_dict_metadata writes for a model without distributed optimizer.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


# ---------------------------------------------------------------- CPU patches (docs: shared/specs/megatron.md)

def _patch_cuda() -> None:
    """megatron-core assumes CUDA in a few places that matter on CPU; none of them compute anything."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # RoPE inv_freq .to(current_device())
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings at PP>1: weight.data.cuda() before all_reduce


def _local_save_results_queue() -> None:
    """dist_checkpointing.save hands the writer's results back through a queue served by a "spawn"
    multiprocessing Manager, which imports torch to unpickle them: ~10 s per rank on 2 cores. A synchronous
    save puts and gets in this process, so an in-process queue carries the same results (files are unchanged).
    Not a multiprocessing.Queue: its put() returns before a feeder thread has written the item, and the
    writer's get_nowait() right after can find it empty ("results_queue should not be empty")."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


# ---------------------------------------------------------------- model

def transformer_config(arch: dict, tp: int, pp: int, vpp: int) -> TransformerConfig:
    learned = arch["position_embedding_type"] == "learned_absolute"
    if arch["add_position_embedding"] != learned:  # Megatron-LM derives one from the other
        raise ValueError(f"add_position_embedding={arch['add_position_embedding']} contradicts "
                         f"position_embedding_type={arch['position_embedding_type']!r}")
    return TransformerConfig(
        num_layers=arch["num_layers"],
        hidden_size=arch["hidden_size"],
        num_attention_heads=arch["num_attention_heads"],
        num_query_groups=arch["num_query_groups"],
        kv_channels=arch["kv_channels"],
        ffn_hidden_size=arch["ffn_hidden_size"],
        gated_linear_unit=arch["swiglu"],
        activation_func=F.silu if arch["swiglu"] else F.gelu,  # as Megatron-LM's --swiglu / default
        normalization=arch["normalization"],
        add_bias_linear=arch["add_bias_linear"],
        add_qkv_bias=arch["add_qkv_bias"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_chunks(arch: dict, tp: int, pp: int, vpp: int) -> list[GPTModel]:
    """The model chunks of this rank, as Megatron-LM's get_model builds them (vp_stage passed explicitly)."""
    config = transformer_config(arch, tp, pp, vpp)
    spec = get_gpt_layer_local_spec(normalization=arch["normalization"])
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab(arch, tp),
            max_sequence_length=arch["max_position_embeddings"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not arch["untie_embeddings_and_output_weights"],
            position_embedding_type=arch["position_embedding_type"],
            vp_stage=vp_stage,
        )
        model.eval()
        chunks.append(model)
    return chunks


def chunk_key(v: int, vpp: int) -> str:
    return "model" if vpp == 1 else f"model{v}"


# ---------------------------------------------------------------- forward over the pipeline

def forward_logits(chunks: list[GPTModel], arch: dict, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, V] (true vocab) on the last stage's TP ranks, None elsewhere.

    Runs the virtual chunks in pipeline order (for v: for p:), handing hidden states [s, b, h] to the
    next stage with send/recv; the last stage's vocab-parallel logits are all-gathered over TP.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    my_p = parallel_state.get_pipeline_model_parallel_rank()
    vpp = len(chunks)
    b, s = input_ids.shape
    position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s)
    # megatron's own default causal mask is built on "cuda"; pass the equivalent one (True = masked)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    steps = [(v, p) for v in range(vpp) for p in range(pp)]  # consecutive steps run on different stages
    out = None
    with torch.no_grad():
        for i, (v, p) in enumerate(steps):
            if p != my_p:
                continue
            if i > 0:
                hidden = torch.empty(s, b, arch["hidden_size"], dtype=torch.float32)
                dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                chunks[v].set_input_tensor(hidden)
            out = chunks[v](input_ids, position_ids, mask)
            if i + 1 < len(steps):
                dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
    if my_p != pp - 1:
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., : arch["vocab_size"]].float().contiguous()


# ---------------------------------------------------------------- checkpoints

def read_tracker(ckpt_dir: str) -> tuple[str, bool]:
    """(iteration directory, release) as Megatron-LM's read_metadata + get_checkpoint_name."""
    with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")) as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(ckpt_dir, "release"), True
    return os.path.join(ckpt_dir, f"iter_{int(text):07d}"), False


def check_iteration(state: dict, release: bool, where: str) -> None:
    # Megatron-LM load_checkpoint exits when a non-release checkpoint lacks the iteration
    if not release and "iteration" not in state and "total_iters" not in state:
        raise RuntimeError(f"{where}: no 'iteration' (Megatron-LM would exit: unable to load iteration)")


def check_legacy_args(state: dict, arch: dict, tp: int, pp: int, where: str) -> None:
    """The comparisons Megatron-LM's check_checkpoint_args makes for a --ckpt-format torch load."""
    args = state.get("args")
    if args is None:
        return
    version = state.get("checkpoint_version", 0)
    expect = {
        "num_layers": arch["num_layers"],
        "hidden_size": arch["hidden_size"],
        "num_attention_heads": arch["num_attention_heads"],
    }
    found = {k: getattr(args, k, "<missing>") for k in expect}
    found["add_position_embedding"] = getattr(args, "add_position_embedding", True)
    expect["add_position_embedding"] = arch["add_position_embedding"]
    if version < 3.0:
        found["model_parallel_size"], expect["model_parallel_size"] = getattr(args, "model_parallel_size", None), tp
    else:
        expect.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            found[k] = getattr(args, k, "<missing>")
    bad = {k: (found[k], v) for k, v in expect.items() if found[k] != v}
    if bad:
        raise RuntimeError(f"{where}: args differ from the loading trainer (found, expected): {bad}")


def load_legacy(chunks: list[GPTModel], arch: dict, ckpt_dir: str) -> None:
    tp, pp, vpp = _layout()
    iter_dir, release = read_tracker(ckpt_dir)
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    path = os.path.join(iter_dir, name, "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    check_iteration(state, release, path)
    check_legacy_args(state, arch, tp, pp, path)
    for v, chunk in enumerate(chunks):
        key = chunk_key(v, vpp)
        if key not in state:
            raise KeyError(f"{path}: no {key!r}; keys are {sorted(state)}")
        chunk.load_state_dict(state[key], strict=True)


def sharded_model_state(chunks: list[GPTModel], content_metadata: dict | None) -> dict:
    """The model part of Megatron-LM's generate_state_dict for --ckpt-format torch_dist."""
    _, _, vpp = _layout()
    metadata = dict(content_metadata or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return {chunk_key(v, vpp): c.sharded_state_dict(metadata=metadata) for v, c in enumerate(chunks)}


def load_dist(chunks: list[GPTModel], arch: dict, ckpt_dir: str) -> None:
    _, _, vpp = _layout()
    iter_dir, release = read_tracker(ckpt_dir)
    common = dist_checkpointing.load_common_state_dict(iter_dir)
    check_iteration(common, release, iter_dir)
    content_metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    loaded = dist_checkpointing.load(sharded_model_state(chunks, content_metadata), iter_dir)
    for v, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[chunk_key(v, vpp)], strict=True)


def load_reference(chunks: list[GPTModel], ref_dir: str) -> None:
    from safetensors.torch import load_file

    if len(chunks) != 1 or _layout() != (1, 1, 1):
        raise ValueError("a reference (model.safetensors) loads only at TP1/PP1; save a torch_dist checkpoint first")
    # strict: ColumnParallel/RowParallelLinear add their missing _extra_state themselves (load pre-hook)
    chunks[0].load_state_dict(load_file(os.path.join(ref_dir, "model.safetensors")), strict=True)


def megatron_args(arch: dict, fmt: str) -> argparse.Namespace:
    """The model and layout part of the args Megatron-LM stores, with the values validate_args leaves."""
    tp, pp, vpp = _layout()
    gqa = arch["num_query_groups"] != arch["num_attention_heads"]
    names = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "swiglu", "normalization",
             "position_embedding_type", "add_position_embedding", "untie_embeddings_and_output_weights",
             "add_bias_linear", "max_position_embeddings", "make_vocab_size_divisible_by", "vocab_size")
    return argparse.Namespace(
        **{k: arch[k] for k in names},
        kv_channels=arch["kv_channels"] or arch["hidden_size"] // arch["num_attention_heads"],
        group_query_attention=gqa,
        num_query_groups=arch["num_query_groups"] if gqa else 1,  # the argparse default, ignored without GQA
        add_qkv_bias=arch["add_qkv_bias"] or arch["add_bias_linear"],  # validate_args keeps them in sync
        padded_vocab_size=padded_vocab(arch, tp),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        ckpt_format="torch" if fmt == "megatron" else "torch_dist",
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )


def save_checkpoint(chunks: list[GPTModel], arch: dict, ckpt_dir: str, fmt: str, iteration: int) -> None:
    """What Megatron-LM's save_checkpoint writes for the model (no optimizer, no RNG state)."""
    _, pp, vpp = _layout()
    args = megatron_args(arch, fmt)
    iter_dir = os.path.join(ckpt_dir, f"iter_{iteration:07d}")
    head = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    if fmt == "megatron":
        t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        rank_dir = os.path.join(iter_dir, f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
        os.makedirs(rank_dir, exist_ok=True)
        state = dict(head)
        for v, chunk in enumerate(chunks):
            state[chunk_key(v, vpp)] = chunk.state_dict_for_save_checkpoint()
        torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    elif fmt == "megatron-dist":
        if dist.get_rank() == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        state = dict(head, **sharded_model_state(chunks, CONTENT_METADATA))
        dist_checkpointing.save(state, iter_dir, content_metadata=dict(CONTENT_METADATA))
    else:
        raise ValueError(f"fmt must be 'megatron' or 'megatron-dist', got {fmt!r}")
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def _layout() -> tuple[int, int, int]:
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
    )


# ---------------------------------------------------------------- steps

def perturb(model: GPTModel, seed: int) -> None:
    """Megatron starts biases at 0 and norms at 1; give every parameter distinct values so a misplaced
    bias or norm changes the logits."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)


def step_reference(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    from safetensors.torch import save_file

    arch, out_dir = job["arch"], job["out_dir"]
    torch.manual_seed(job["seed"])  # use_cpu_initialization: weights come from the default CPU generator
    (model,) = build_chunks(arch, 1, 1, 1)
    perturb(model, job["seed"])
    tensors = {
        k: v.detach().to(torch.float32).contiguous().clone()
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)
    }
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={k: json.dumps(v) for k, v in arch.items()})
    torch.save(forward_logits([model], arch, input_ids), os.path.join(out_dir, "logits.pt"))
    with open(os.path.join(out_dir, "arch.json"), "w") as f:
        json.dump(arch, f, indent=1, sort_keys=True)


def step_save(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    chunks = build_chunks(job["arch"], task["tp"], task["pp"], task["vpp"])
    if os.path.exists(os.path.join(job["source"], "model.safetensors")):
        load_reference(chunks, job["source"])
    else:
        load_dist(chunks, job["arch"], job["source"])
    save_checkpoint(chunks, job["arch"], job["ckpt_dir"], job["fmt"], job.get("iteration", 100))


def step_logits(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    chunks = build_chunks(job["arch"], task["tp"], task["pp"], task["vpp"])
    if job["fmt"] == "megatron":
        load_legacy(chunks, job["arch"], job["ckpt_dir"])
    elif job["fmt"] == "megatron-dist":
        load_dist(chunks, job["arch"], job["ckpt_dir"])
    else:
        raise ValueError(f"fmt must be 'megatron' or 'megatron-dist', got {job['fmt']!r}")
    logits = forward_logits(chunks, job["arch"], input_ids)
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(logits, os.path.join(task["dir"], f"logits_{job['index']}.pt"))


def step_optim(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    """Load the fully_reshardable optimizer state of a torch_dist checkpoint the way Megatron's distributed
    optimizer asks for it: for every model ShardedTensor (or SwiGLU factory), one per slot with the key
    ``optimizer.state.<slot>.<model key>`` and the model param's local shape; save what each rank got."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    _, _, vpp = _layout()
    chunks = build_chunks(job["arch"], task["tp"], task["pp"], task["vpp"])
    iter_dir, _ = read_tracker(job["ckpt_dir"])
    model_sd = sharded_model_state(chunks, {"singleton_local_shards": False})
    request = {}
    for slot in job["slots"]:
        for ck, entries in model_sd.items():
            for name, sh in entries.items():
                if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
                    request[f"{slot}|{ck}|{name}"] = make_sharded_optimizer_tensor(
                        sh, torch.empty_like(sh.data), prefix=f"optimizer.state.{slot}")
    loaded = dist_checkpointing.load(request, iter_dir)
    rank = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    out = {tuple(k.split("|")): v.clone() for k, v in loaded.items() if "|" in k}  # (common state comes too)
    torch.save({"rank": rank, "state": out}, os.path.join(task["dir"], f"optim_{job['index']}_{dist.get_rank()}.pt"))


def step_legacy_optim(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    """Load a legacy checkpoint's optimizer state the way Megatron's non-distributed FP32Optimizer does:
    param groups from megatron's _get_param_groups, groups matched by _filter_and_reorder_param_groups,
    then torch's load_state_dict; save each named parameter's state per rank."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    _, _, vpp = _layout()
    chunks = build_chunks(job["arch"], task["tp"], task["pp"], task["vpp"])
    load_legacy(chunks, job["arch"], job["ckpt_dir"])
    iter_dir, _ = read_tracker(job["ckpt_dir"])
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    sub = f"mp_rank_{tp_rank:02d}" if task["pp"] == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    saved = torch.load(os.path.join(iter_dir, sub, "model_optim_rng.pt"), weights_only=False)["optimizer"]
    groups = _get_param_groups(chunks, OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=0.0, weight_decay=0.1), None)
    opt = torch.optim.Adam(groups, lr=1e-3)
    saved["param_groups"] = MegatronOptimizer._filter_and_reorder_param_groups(opt.param_groups, saved["param_groups"])
    opt.load_state_dict(saved)
    out = {}
    for v, c in enumerate(chunks):
        for n, prm in c.named_parameters():
            for slot, t in opt.state[prm].items():
                out[(slot, chunk_key(v, vpp), n)] = t.clone()
    torch.save({"rank": (tp_rank, pp_rank), "state": out}, os.path.join(task["dir"], f"optim_{job['index']}_{dist.get_rank()}.pt"))


def step_names(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    """Each rank's trainable parameters in named_parameters() order per chunk: the order Megatron's
    (non-distributed) optimizer indexes its state by."""
    chunks = build_chunks(job["arch"], task["tp"], task["pp"], task["vpp"])
    rank = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    names = [(v, n, list(p.shape)) for v, c in enumerate(chunks) for n, p in c.named_parameters() if p.requires_grad]
    with open(os.path.join(task["dir"], f"names_{job['index']}_{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": list(rank), "names": names}, f)


def step_resume(task: dict, job: dict, input_ids: torch.Tensor) -> None:
    import mcore_resume  # imported when asked: it patches torch for megatron-core's optimizers on CPU

    mcore_resume.step_resume(task, job, input_ids)


STEPS = {"reference": step_reference, "save": step_save, "logits": step_logits, "optim": step_optim,
         "names": step_names, "legacy_optim": step_legacy_optim, "resume": step_resume}


# ---------------------------------------------------------------- processes

def run_rank(task: dict, rank: int) -> None:
    _patch_cuda()
    _local_save_results_queue()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{task['port']}",
        rank=rank,
        world_size=task["world"],
        timeout=timedelta(seconds=task["timeout"]),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=task["tp"],
        pipeline_model_parallel_size=task["pp"],
        virtual_pipeline_model_parallel_size=task["vpp"] if task["vpp"] > 1 else None,
    )
    # the inference tracker's fork() is a no-op: megatron's training tracker needs CUDA RNG states
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    input_ids = torch.tensor(task["tokens"], dtype=torch.int64)
    for i, job in enumerate(task["jobs"]):
        start = time.monotonic()
        STEPS[task["op"]](task, job, input_ids)
        dist.barrier()
        print(f"rank {rank}: {task['op']} job {i} took {time.monotonic() - start:.2f} s", flush=True)
    leave_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(task_dir: str, rank_main=None) -> int:
    """Run the task's ranks (``rank_main(task, rank)``, default this module's ``run_rank``), forked after the import."""
    with open(os.path.join(task_dir, "task.json")) as f:
        task = json.load(f)
    task["dir"], task["port"] = task_dir, _free_port()
    return run_ranks(task["world"], lambda rank: (rank_main or run_rank)(task, rank), task_dir)
