"""Coordinates: where a trainer rank sits — its data-, tensor- and pipeline-parallel rank and sizes."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Coordinates:
    """Where this trainer rank sits: data-parallel rank/size (TP/PP come from Megatron when present)."""

    dp_rank: int = 0
    dp: int = 1
    tp_rank: int = 0
    tp: int = 1
    pp_rank: int = 0
    pp: int = 1
    vpp: int = 1  # virtual pipeline chunks per stage: the model is then the list of its chunks

    @classmethod
    def detect(cls) -> Coordinates:
        """From megatron.core.parallel_state when initialised, else torch.distributed (all ranks DP), else 1."""
        import sys

        ps = sys.modules.get("megatron.core.parallel_state")  # only if the trainer uses Megatron (it is slow to import)
        if ps is not None:
            if ps.model_parallel_is_initialized():
                return cls(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                           ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                           ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                           ps.get_virtual_pipeline_model_parallel_world_size() or 1)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return cls(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return cls()

    @property
    def sender(self) -> int:
        return (self.pp_rank * self.tp + self.tp_rank) * self.dp + self.dp_rank

    @property
    def senders(self) -> int:
        return self.dp * self.tp * self.pp
