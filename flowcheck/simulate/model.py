"""The simulator's model: a small GPT (nanoGPT's shape) and its deterministic synthetic token data.

Everything is float32 and seeded; the model holds parameters only (no buffers: the causal mask
comes from ``scaled_dot_product_attention(is_causal=True)``), so its state is exactly
``model.named_parameters()`` — what a mirror-capture replica rebuilds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    block: int  # context length
    embd: int
    layers: int
    heads: int
    batch: int  # sequences per rank per iteration


MODELS = {
    "tiny": GPTConfig(vocab=64, block=16, embd=32, layers=2, heads=2, batch=4),  # ~30k parameters
    "small": GPTConfig(vocab=256, block=32, embd=128, layers=4, heads=4, batch=4),  # ~0.87M parameters
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.embd, 3 * cfg.embd)
        self.proj = nn.Linear(cfg.embd, cfg.embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.embd)
        self.fc = nn.Linear(cfg.embd, 4 * cfg.embd)
        self.out = nn.Linear(4 * cfg.embd, cfg.embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token + position embedding, pre-LN blocks, final LN, untied head (no shared tensors to confuse names)."""

    def __init__(self, cfg: GPTConfig, seed: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.embd)
        self.wpe = nn.Embedding(cfg.block, cfg.embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.embd)
        self.head = nn.Linear(cfg.embd, cfg.vocab, bias=False)
        self._init(seed)

    @torch.no_grad()
    def _init(self, seed: int) -> None:
        # a private generator: the global torch RNG (and so the caller's state) stays untouched
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(cfg: GPTConfig, seed: int, iteration: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one rank's micro-batch: arithmetic token progressions with 10% noise.

    A pure function of (seed, iteration, rank), so a rerun (or a second trainer) sees the same data.
    """
    rng = np.random.default_rng([seed, iteration, rank])
    n, t, v = cfg.batch, cfg.block + 1, cfg.vocab
    start = rng.integers(0, v, size=(n, 1))
    stride = rng.integers(1, 8, size=(n, 1))
    seq = (start + stride * np.arange(t)) % v
    noise = rng.random((n, t)) < 0.1
    seq = np.where(noise, rng.integers(0, v, size=(n, t)), seq)
    data = torch.from_numpy(seq.astype(np.int64))
    return data[:, :-1], data[:, 1:]
