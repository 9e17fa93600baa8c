"""The demo GPT fine-tuned with LoRA: the model frozen, rank-``rank`` adapters on every attention projection, AdamW
over the adapters only (PEFT's way) — the trainer whose push and steps shrink to its trainable share (its test
and benchmark)."""
from __future__ import annotations

import torch

from flowcheck.demo.model import build
from flowcheck.restore.arch import ModelArch


class LoRA(torch.nn.Module):
    """y = base(x) + x A^T B^T: the frozen base linear plus a trainable rank-``rank`` update."""

    def __init__(self, base: torch.nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.02)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.02)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora_gpt(arch: ModelArch, rank: int = 8, lr: float = 1e-3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The demo GPT of ``arch`` (seed 0), frozen, with adapters on ``linear_qkv`` and ``linear_proj``."""
    torch.manual_seed(0)
    model = build(arch)
    model.requires_grad_(False)
    for layer in model.decoder.layers:
        att = layer.self_attention
        att.linear_qkv, att.linear_proj = LoRA(att.linear_qkv, rank), LoRA(att.linear_proj, rank)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
