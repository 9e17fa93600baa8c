"""Test harness: real megatron-core GPTModels on CPU (gloo, one process per rank) that write reference
weights/logits, save Megatron checkpoints themselves, load checkpoints at any TP/PP/VPP to give logits, and
resume training from them with megatron-core's optimizers and LR scheduler (``resume``, mcore_resume.py).

Everything megatron runs in child processes (mcore_worker.py); this module imports only torch, so a test
module can import it and skip cleanly when megatron-core is missing (see ``megatron_available``).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

# `python -c`, not the worker's path: dist_checkpointing.save starts a multiprocessing Manager with the
# "spawn" method, which re-imports a __main__ that has a file (megatron again: ~10 s per rank)
_ENTRY = (
    f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
    "import mcore_worker; mcore_worker.exit_now(mcore_worker.main(sys.argv[1]))"
)

# Megatron-LM argument names. Vocabulary sizes are not multiples of 128 and differ so that V_pad depends on
# TP for some of them: 300 -> 384 (TP1) / 512 (TP2, TP4); 1100 -> 1152 / 1280 / 1536; 700 -> 768 / 768 / 1024.
ARCHS: dict[str, dict] = {
    "gqa_swiglu_rms": {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 4,
        "kv_channels": None, "ffn_hidden_size": 96, "swiglu": True, "normalization": "RMSNorm",
        "position_embedding_type": "rope", "add_position_embedding": False,
        "untie_embeddings_and_output_weights": True, "add_bias_linear": False, "add_qkv_bias": False,
        "max_position_embeddings": 32, "vocab_size": 300, "make_vocab_size_divisible_by": 128,
    },
    "mha_gelu_ln_tied": {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 8,
        "kv_channels": None, "ffn_hidden_size": 256, "swiglu": False, "normalization": "LayerNorm",
        "position_embedding_type": "learned_absolute", "add_position_embedding": True,
        "untie_embeddings_and_output_weights": False, "add_bias_linear": True, "add_qkv_bias": False,
        "max_position_embeddings": 32, "vocab_size": 1100, "make_vocab_size_divisible_by": 128,
    },
    # num_query_groups=2 < TP=4 is supported by megatron-core 0.16.1: TransformerConfig accepts groups that
    # divide TP, and SelfAttention all-gathers linear_qkv's output and picks its group's slice, so linear_qkv
    # is still a plain chunk(0) of the full [q..k v | q..k v] rows. kv_channels=16 makes nq*hd (128) differ
    # from hidden (64), and SwiGLU with biases exercises the gated fc1 bias split.
    "gqa_bias_groups2": {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2,
        "kv_channels": 16, "ffn_hidden_size": 64, "swiglu": True, "normalization": "LayerNorm",
        "position_embedding_type": "rope", "add_position_embedding": False,
        "untie_embeddings_and_output_weights": True, "add_bias_linear": True, "add_qkv_bias": True,
        "max_position_embeddings": 32, "vocab_size": 700, "make_vocab_size_divisible_by": 128,
    },
}

FORMATS = ("megatron", "megatron-dist")


class MegatronRunError(RuntimeError):
    """A megatron child process failed; the message carries its traceback and log tail."""


class MegatronTimeout(MegatronRunError, TimeoutError):
    """The megatron child processes did not finish within the timeout (a rank may be stuck in a collective)."""


@dataclass(frozen=True)
class LoadJob:
    ckpt_dir: str  # a Megatron checkpoint root: latest_checkpointed_iteration.txt and iter_XXXXXXX/
    fmt: str  # "megatron" (--ckpt-format torch) or "megatron-dist" (torch_dist)
    arch: dict


@dataclass(frozen=True)
class SaveJob:
    source: str  # a make_reference dir (loads only at TP1/PP1) or a torch_dist checkpoint root (any layout)
    arch: dict
    ckpt_dir: str  # written by megatron itself at the call's layout
    fmt: str  # "megatron" or "megatron-dist"


@dataclass(frozen=True)
class ResumeJob:
    """A checkpoint a Megatron-LM-style trainer resumes from (see mcore_resume.py): built from ``args`` (Megatron-LM
    argument names: lr, min_lr, adam_beta1/2, adam_eps, weight_decay, lr_decay_style, lr_warmup_iters, train_iters,
    global_batch_size), loaded with ``flags``, saved to ``save_dir`` in ``fmt`` when given, then stepped once
    with the gradient ``grad_scale * param``."""

    ckpt_dir: str
    fmt: str
    arch: dict
    args: dict
    dist_opt: bool = False  # --use-distributed-optimizer (needs adam="fused": see mcore_resume.CpuFusedAdam)
    adam: str = "torch"  # "torch": torch AdamW (megatron-core without TE/Apex); "fused": FusedAdam's contract
    flags: tuple[str, ...] = ()  # --no-load-optim, --no-load-rng, --override-opt_param-scheduler
    save_dir: str | None = None
    step: bool = True
    grad_scale: float = 0.01


def megatron_available() -> bool:
    """megatron-core and psutil (undeclared: without it dist_checkpointing.save hangs) are installed."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("megatron", "megatron.core", "psutil"))


def padded_vocab(arch: dict, tp: int) -> int:
    """Megatron-LM's _vocab_size_with_padding: V rounded up to make_vocab_size_divisible_by * TP."""
    multiple = arch["make_vocab_size_divisible_by"] * tp
    return int(math.ceil(arch["vocab_size"] / multiple) * multiple)


def tokens() -> torch.Tensor:
    """The fixed input [2, 16] (int64) every reference and load uses."""
    low = min(a["vocab_size"] for a in ARCHS.values())
    g = torch.Generator().manual_seed(20240611)
    return torch.randint(0, low, (2, 16), generator=g, dtype=torch.int64)


# ---------------------------------------------------------------- public operations

def make_reference(arch: dict, out_dir: str, seed: int = 1234) -> None:
    """model.safetensors (local-spec names, fp32, V_pad(TP1) rows, arch in __metadata__), logits.pt
    ([2, 16, V] for tokens()), arch.json, from a TP1/PP1 megatron GPTModel with seeded random weights."""
    make_references([(arch, out_dir)], seed)


def make_references(items: list[tuple[dict, str]], seed: int = 1234, timeout: float = 300) -> None:
    """make_reference for several (arch, out_dir) in one process launch."""
    jobs = [{"arch": a, "out_dir": os.path.abspath(d), "seed": seed} for a, d in items]
    _run("reference", jobs, 1, 1, 1, timeout)


def load_logits(jobs: list[LoadJob], tp: int, pp: int, vpp: int = 1, timeout: float = 300) -> list[torch.Tensor]:
    """Load every job's checkpoint into megatron models at (tp, pp, vpp) and return its logits [2, 16, V]
    for tokens(), one tensor per job, in order. Raises MegatronRunError with the failing rank's traceback."""
    for j in jobs:
        _check_fmt(j.fmt)
    payload = [
        {"index": i, "ckpt_dir": os.path.abspath(j.ckpt_dir), "fmt": j.fmt, "arch": j.arch}
        for i, j in enumerate(jobs)
    ]
    with _task_dir() as d:
        _run("logits", payload, tp, pp, vpp, timeout, task_dir=d)
        return [torch.load(os.path.join(d, f"logits_{i}.pt"), weights_only=True) for i in range(len(jobs))]


def load_optimizer(jobs: list[LoadJob], tp: int, pp: int, vpp: int = 1, slots=("exp_avg", "exp_avg_sq", "param"),
                   timeout: float = 300) -> list[dict]:
    """The optimizer state Megatron loads at (tp, pp, vpp) — torch_dist: fully_reshardable sharded tensors;
    legacy: the non-distributed optimizer's torch state_dict — per job a dict
    {(tp_rank, pp_rank): {(slot, "model"|"model<v>", local param name): tensor}}."""
    payload = [{"index": i, "ckpt_dir": os.path.abspath(j.ckpt_dir), "fmt": j.fmt, "arch": j.arch, "slots": list(slots)}
               for i, j in enumerate(jobs)]
    op = {"megatron-dist": "optim", "megatron": "legacy_optim"}
    if len({j.fmt for j in jobs}) != 1:
        raise ValueError("load_optimizer: give jobs of one format per call")
    with _task_dir() as d:
        _run(op[jobs[0].fmt], payload, tp, pp, vpp, timeout, task_dir=d)
        results: list[dict] = [{} for _ in jobs]
        for name in os.listdir(d):
            if name.startswith("optim_"):
                i = int(name.split("_")[1])
                got = torch.load(os.path.join(d, name), weights_only=True)
                results[i][tuple(got["rank"])] = got["state"]
        return results


def resume(jobs: list[ResumeJob], tp: int, pp: int, vpp: int = 1, dp: int = 1, timeout: float = 300) -> list[dict]:
    """Run every job at (tp, pp, vpp) with ``dp`` data-parallel replicas; per job {(tp_rank, pp_rank, dp_rank):
    {iteration, consumed_train_samples, groups (the optimizer's, after loading), scheduler (its state_dict),
    before / after (every parameter, {(chunk key, name): tensor}, before and after the step), stepped}}."""
    for j in jobs:
        _check_fmt(j.fmt)
    payload = [dict(vars(j), index=i, ckpt_dir=os.path.abspath(j.ckpt_dir), flags=list(j.flags),
                    save_dir=os.path.abspath(j.save_dir) if j.save_dir else None) for i, j in enumerate(jobs)]
    with _task_dir() as d:
        _run("resume", payload, tp, pp, vpp, timeout, task_dir=d, dp=dp)
        results: list[dict] = [{} for _ in jobs]
        for name in os.listdir(d):
            if name.startswith("resume_"):
                got = torch.load(os.path.join(d, name), weights_only=True)
                results[int(name.split("_")[1])][tuple(got["rank"])] = got
        return results


def parameter_names(archs: list[dict], tp: int, pp: int, vpp: int = 1, timeout: float = 300) -> list[dict]:
    """Per arch: {(tp_rank, pp_rank): [(chunk, name, shape), ...]} in named_parameters() order."""
    payload = [{"index": i, "arch": a} for i, a in enumerate(archs)]
    with _task_dir() as d:
        _run("names", payload, tp, pp, vpp, timeout, task_dir=d)
        results: list[dict] = [{} for _ in archs]
        for name in os.listdir(d):
            if name.startswith("names_"):
                with open(os.path.join(d, name)) as f:
                    got = json.load(f)
                results[int(name.split("_")[1])][tuple(got["rank"])] = [(v, n, tuple(s)) for v, n, s in got["names"]]
        return results


def megatron_save(model_dir_ref: str, arch: dict, ckpt_dir: str, fmt: str, tp: int, pp: int, vpp: int = 1) -> None:
    """Megatron itself writes the reference weights as a checkpoint at (tp, pp, vpp): at TP1/PP1 straight
    from model.safetensors, otherwise through a TP1 torch_dist checkpoint that megatron reshards on load."""
    if (tp, pp, vpp) == (1, 1, 1):
        megatron_save_many([SaveJob(model_dir_ref, arch, ckpt_dir, fmt)], 1, 1, 1)
        return
    with _task_dir() as d:
        tp1 = os.path.join(d, "tp1")
        megatron_save_many([SaveJob(model_dir_ref, arch, tp1, "megatron-dist")], 1, 1, 1)
        megatron_save_many([SaveJob(tp1, arch, ckpt_dir, fmt)], tp, pp, vpp)


def megatron_save_many(jobs: list[SaveJob], tp: int, pp: int, vpp: int = 1, timeout: float = 300) -> None:
    """megatron_save for several jobs in one process launch; every source must suit the layout (see SaveJob)."""
    for j in jobs:
        _check_fmt(j.fmt)
    payload = [
        {"source": os.path.abspath(j.source), "arch": j.arch, "ckpt_dir": os.path.abspath(j.ckpt_dir), "fmt": j.fmt}
        for j in jobs
    ]
    _run("save", payload, tp, pp, vpp, timeout)


# ---------------------------------------------------------------- process launch

def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def _task_dir() -> tempfile.TemporaryDirectory:
    """A temporary directory for one launch's task.json, results and log."""
    return tempfile.TemporaryDirectory(prefix="mcore-", ignore_cleanup_errors=True)


def _run(op: str, jobs: list[dict], tp: int, pp: int, vpp: int, timeout: float, task_dir: str | None = None,
         dp: int = 1) -> None:
    if min(tp, pp, vpp, dp) < 1 or (vpp > 1 and pp < 2):
        raise ValueError(f"bad layout tp={tp} pp={pp} vpp={vpp} dp={dp} (vpp > 1 needs pp > 1)")
    if task_dir is None:
        with _task_dir() as d:
            return _run(op, jobs, tp, pp, vpp, timeout, d, dp)
    task = {"op": op, "jobs": jobs, "tp": tp, "pp": pp, "vpp": vpp, "world": tp * pp * dp,
            "timeout": timeout, "tokens": tokens().tolist()}
    with open(os.path.join(task_dir, "task.json"), "w") as f:
        json.dump(task, f)
    _launch(task_dir, timeout, f"{op} at tp={tp} pp={pp} vpp={vpp} dp={dp}")


def _launch(task_dir: str, timeout: float, what: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo otherwise resolves the hostname, which may not route
    log_path = os.path.join(task_dir, "log.txt")
    with open(log_path, "wb") as log:
        # own session: on timeout the launcher and the ranks it forked are killed together
        proc = subprocess.Popen([sys.executable, "-c", _ENTRY, task_dir], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise MegatronTimeout(f"megatron {what} did not finish in {timeout:.0f} s\n{_report(task_dir)}") from None
    if code != 0:
        raise MegatronRunError(f"megatron {what} failed (exit {code})\n{_report(task_dir)}")


def _report(task_dir: str) -> str:
    parts = []
    for name in sorted(os.listdir(task_dir)):
        if name.startswith("error_"):
            with open(os.path.join(task_dir, name)) as f:
                parts.append(f"--- rank {name[6:-4]} traceback ---\n{f.read()}")
    with open(os.path.join(task_dir, "log.txt"), errors="replace") as f:
        parts.append("--- output (tail) ---\n" + f.read()[-4000:])
    return "\n".join(parts)
