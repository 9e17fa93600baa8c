"""When megatron-core is installed: load the demo's restored checkpoints into real GPTModels at TP=2/PP=2.

One launcher process imports megatron-core once (~5 s) and forks the 4 ranks (gloo on loopback, CPU); each
builds its GPTModel stage as Megatron-LM's ``get_model`` does, loads both checkpoints the way Megatron-LM's
``load_checkpoint`` does (legacy: ``load_state_dict(strict=True)`` of its ``mp_rank`` file; torch_dist:
``dist_checkpointing.load`` of its sharded state dict), and runs a pipelined forward pass; the logits must match
the trainer's model on the same tokens.  megatron-core is imported only in those processes (``pip install
megatron-core`` adds this check; without it the demo's single-process read-back is the whole check).
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from flowcheck.demo.ranks import ERROR_PREFIX, exit_now, first_error, leave_group, run_ranks

TP, PP = 2, 2
_ENTRY = "import sys; from flowcheck.demo.mcore import launcher; launcher(sys.argv[1])"
_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class McoreLoad:
    """What megatron-core made of one restored checkpoint."""

    fmt: str
    ok: bool
    line: str  # one line for the demo's output


def available() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("megatron-core")
    except PackageNotFoundError:
        return "?"


def load_all(outs: dict[str, str], final_state: dict, work: str) -> dict[str, McoreLoad]:
    """Load every ``{format: checkpoint dir}`` into GPTModels at TP=2/PP=2 and compare their logits with the
    trainer's model (weights from ``final_state``); ``work`` gets the task, the logits and the log."""
    import torch

    from flowcheck.demo.model import ARCH, build, data

    os.makedirs(work, exist_ok=True)
    tokens = torch.stack([data()[i:i + 32] for i in (0, 100)])
    task = {"jobs": outs, "tokens": tokens.tolist(), "arch": ARCH.to_json(), "dir": os.path.abspath(work)}
    with open(os.path.join(work, "task.json"), "w", encoding="utf-8") as f:
        json.dump(task, f)
    for name in os.listdir(work):
        if name.startswith(("logits-", ERROR_PREFIX)):
            os.remove(os.path.join(work, name))
    failed = _launch(work)
    model = build()
    model.load_state_dict({k: v for k, v in final_state.items() if not k.startswith("optimizer.")})
    with torch.no_grad():
        want = model(tokens)
    where = f"megatron-core {version()} GPTModel at TP={TP}/PP={PP} (4 gloo processes)"
    results = {}
    for fmt in outs:
        path = os.path.join(work, f"logits-{fmt}.pt")
        if not os.path.exists(path):
            why = failed or "it wrote no logits"
            results[fmt] = McoreLoad(fmt, False, f"{where} could not load it: {why} (log: {work}/log.txt)")
            continue
        got = torch.load(path, weights_only=True)
        diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
        ok = got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
        results[fmt] = McoreLoad(fmt, ok, f"loaded by {where}, strictly; its logits on 2 x 32 tokens == the trainer's "
                                          f"model's: {ok} (max |diff| {diff:.1e}, float32 rounding)")
    return results


def _launch(work: str) -> str:
    """Run the launcher; '' when it succeeded, else the first line of what failed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo otherwise resolves the hostname, which may not route
    with open(os.path.join(work, "log.txt"), "wb") as log:
        # its own session: on a timeout the launcher and the ranks it forked are killed together
        proc = subprocess.Popen([sys.executable, "-c", _ENTRY, work], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"the ranks did not finish in {_TIMEOUT_S:.0f} s"
    if code == 0:
        return ""
    return first_error(work) or f"exit status {code}"


# ---- the launcher and its ranks (separate processes; megatron-core is imported only here) ---------------------
def launcher(work: str) -> None:
    """Import megatron-core once, fork the ranks, wait for them; exit status 0 when every rank succeeded."""
    import warnings

    warnings.filterwarnings("ignore")  # megatron warns about missing Apex / Transformer Engine on import
    import megatron.core.models.gpt  # noqa: F401 - imported before the fork, once for every rank

    with open(os.path.join(work, "task.json"), encoding="utf-8") as f:
        task = json.load(f)
    task["port"] = _free_port()
    exit_now(run_ranks(TP * PP, lambda rank: _rank(task, rank), work))


def _rank(task: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    _patch_cuda()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{task['port']}", rank=rank, world_size=TP * PP,
                            timeout=timedelta(seconds=_TIMEOUT_S))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    # the inference tracker's fork() is a no-op: megatron's training tracker needs CUDA RNG states
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tokens = torch.tensor(task["tokens"], dtype=torch.int64)
    for fmt, ckpt in task["jobs"].items():
        model = _build(task["arch"])
        (_load_dist if fmt == "megatron-dist" else _load_legacy)(model, ckpt)
        logits = _forward(model, task["arch"], tokens)
        if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save(logits, os.path.join(task["dir"], f"logits-{fmt}.pt"))
        dist.barrier()
    leave_group()


def _patch_cuda() -> None:
    """megatron-core assumes CUDA in a few places that matter on CPU; none of them computes anything."""
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings at PP>1: weight.data.cuda() before all_reduce


def _build(arch: dict) -> Any:
    """This rank's GPTModel stage, as Megatron-LM's get_model builds it (local layer spec, CPU, fp32)."""
    import math

    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"],
        num_attention_heads=arch["num_attention_heads"], num_query_groups=arch["num_query_groups"],
        kv_channels=arch["kv_channels"], ffn_hidden_size=arch["ffn_hidden_size"], gated_linear_unit=arch["swiglu"],
        activation_func=F.silu if arch["swiglu"] else F.gelu, normalization=arch["normalization"],
        add_bias_linear=arch["add_bias_linear"], add_qkv_bias=arch["add_qkv_bias"],
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    multiple = arch["make_vocab_size_divisible_by"] * TP
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=arch["normalization"]),
        vocab_size=math.ceil(arch["vocab_size"] / multiple) * multiple,
        max_sequence_length=arch["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=not arch["untie_embeddings_and_output_weights"],
        position_embedding_type=arch["position_embedding_type"],
    )
    model.eval()
    return model


def _iteration_dir(ckpt: str) -> str:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), encoding="utf-8") as f:
        return os.path.join(ckpt, f"iter_{int(f.read().strip()):07d}")


def _load_legacy(model: Any, ckpt: str) -> None:
    import argparse

    import torch
    from megatron.core import parallel_state

    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    path = os.path.join(_iteration_dir(ckpt), f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"], strict=True)


def _load_dist(model: Any, ckpt: str) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    it_dir = _iteration_dir(ckpt)
    common = dist_checkpointing.load_common_state_dict(it_dir)
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, it_dir)
    model.load_state_dict(loaded["model"], strict=True)


def _forward(model: Any, arch: dict, tokens: Any) -> Any:
    """Logits [b, s, V] (true vocabulary) on the last stage, None elsewhere: stage 0 sends its hidden states."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    b, s = tokens.shape
    positions = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True = masked (causal)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    with torch.no_grad():
        if not first:
            hidden = torch.empty(s, b, arch["hidden_size"], dtype=torch.float32)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, mask)
        if not last:
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :arch["vocab_size"]].float().contiguous()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
