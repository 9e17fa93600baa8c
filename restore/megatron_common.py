"""What both Megatron checkpoint formats share: the target, the ``args`` they carry, file names, cutting rules."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from flowcheck.restore.arch import ModelArch
from flowcheck.restore.megatron_map import RankTensor
from flowcheck.restore.megatron_optim import ResumePlan

FORMATS = ("megatron-dist", "megatron")
ADAMS = ("fused", "torch")  # the Adam megatron-core runs: TE / Apex FusedAdam, or torch.optim.AdamW without them
TRACKER = "latest_checkpointed_iteration.txt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Target:
    """The layout and format a restore writes."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    fmt: str = "megatron-dist"
    dtype: str | None = None  # fp32 | bf16 | None = as stored
    optim: bool = True
    layer_spec: str | None = None  # local | te | None = as the step was stored
    dist_optim: bool = False  # the trainer runs Megatron's distributed optimizer (--use-distributed-optimizer)
    adam: str | None = None  # fused | torch | None = as the stored step's optimizer was, else fused

    def check(self, arch: ModelArch) -> None:
        from flowcheck.errors import ConfigError

        if self.fmt not in FORMATS:
            raise ConfigError(f"--format: expected one of {FORMATS}, found {self.fmt!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"--dtype: expected one of {tuple(DTYPES)}, found {self.dtype!r}")
        if self.adam is not None and self.adam not in ADAMS:
            raise ConfigError(f"--adam: expected one of {ADAMS}, found {self.adam!r}")
        arch.check_layout(self.tp, self.pp, self.vpp)

    def check_optimizer(self, has_state: bool) -> None:
        """Refuse optimizer state the format cannot hand to the trainer's optimizer (before anything is written)."""
        from flowcheck.errors import ConfigError

        if self.fmt == "megatron" and self.dist_optim and self.optim and has_state:
            raise ConfigError(
                "--format megatron with --use-distributed-optimizer: expected --format megatron-dist to carry optimizer "
                "state into Megatron's distributed optimizer (legacy distrib_optim.pt is a flat bucket layout tied to "
                "the data-parallel size), found --format megatron; use --format megatron-dist, or --no-optim")

    def spec(self, arch: ModelArch) -> str:
        return self.layer_spec or arch.layer_spec


@dataclass(frozen=True)
class StepMeta:
    """The non-tensor state a checkpoint carries: iteration, args, and what the optimizer and scheduler resume."""

    iteration: int
    args: argparse.Namespace
    resume: ResumePlan
    flops: float = 0.0


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_dirname(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def cut(full: torch.Tensor, rt: RankTensor) -> torch.Tensor:
    """The rank's local tensor from the canonical one (pad parts repeat the last stored vocabulary row)."""
    out = torch.empty(rt.shape, dtype=full.dtype)
    for part in rt.parts:
        out[part.dest] = full[part.src]
    return out


def megatron_args(arch: ModelArch, target: Target, iteration: int, stored: dict[str, Any] | None, dtype: torch.dtype,
                  resume: ResumePlan) -> argparse.Namespace:
    """``args`` for the *target* layout: Megatron asserts TP/PP and the model shape against them on load, and takes
    the data position (consumed samples) from them."""
    values: dict[str, Any] = dict(stored or {})
    values.update({k: v for k, v in arch.to_json().items() if k != "layer_spec"})
    values.update(
        num_query_groups=arch.groups,
        group_query_attention=arch.groups != arch.num_attention_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn,
        add_position_embedding=arch.learned_positions,
        padded_vocab_size=arch.padded_vocab(target.tp),
        tensor_model_parallel_size=target.tp,
        pipeline_model_parallel_size=target.pp,
        virtual_pipeline_model_parallel_size=target.vpp if target.vpp > 1 else None,
        transformer_impl="transformer_engine" if target.spec(arch) == "te" else "local",
        ckpt_format="torch_dist" if target.fmt == "megatron-dist" else "torch",
        bf16=dtype == torch.bfloat16,
        fp16=False,
        params_dtype=dtype,
        iteration=iteration,
        consumed_train_samples=resume.consumed_train_samples,
        consumed_valid_samples=resume.consumed_valid_samples,
        # what this checkpoint lacks, said the way Megatron-LM's torch_dist load reads it (it then asks for neither)
        no_save_optim=not resume.optimizer,
        no_save_rng=True,
    )
    return argparse.Namespace(**values)
