"""The demo's model: a small GPT whose parameters carry megatron-core's GPTModel names and shapes.

A plain torch module (megatron-core is not needed to train it), laid out as
megatron-core's local layer spec lays out a GPTModel at TP=1/PP=1: the names
``flowcheck restore`` maps to any TP/PP layout (restore/megatron_map.py), fused
QKV rows per query group, tied input/output embeddings.  The trainer pushes
``ARCH`` with every step, so every step the node commits carries this
description (``scalars.extra.model``) as an imported step does.
"""
from __future__ import annotations

import math

from flowcheck.restore.arch import ModelArch

TEXT = (
    "A checkpoint that looked fine and was not is the worst day of a training run. "
    "flowcheck keeps the latest state in memory, writes zarr shards to local disks, "
    "uploads safetensors with manifests to object storage, and audits the lineage of every step. "
)
CHARS = sorted(set(TEXT))
CONTEXT = 32
BATCH = 16
LR, WEIGHT_DECAY = 3e-3, 0.01  # AdamW, cosine decay to 0 over the run, no warmup

# Megatron-LM argument names.  make_vocab_size_divisible_by=4: at TP=1 the padded vocabulary is the true one
# (28 rows: what the trainer holds), at TP=2 it is 32, so a TP=2 restore shows Megatron's padding rows.
ARCH = ModelArch(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=len(CHARS),
    ffn_hidden_size=256,
    max_position_embeddings=CONTEXT,
    make_vocab_size_divisible_by=4,
)


def build(arch: ModelArch = ARCH):
    """A GPTModel-shaped torch module (its state_dict keys are megatron-core's canonical names)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h = arch.hidden_size

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # linear_proj before linear_qkv: megatron-core registers them in this order (named_parameters order)
            self.linear_proj = nn.Linear(arch.num_attention_heads * arch.head_dim, h)
            self.linear_qkv = nn.Linear(h, (arch.num_attention_heads + 2 * arch.groups) * arch.head_dim)

        def forward(self, x):
            b, t, _ = x.shape
            per, hd = arch.num_attention_heads // arch.groups, arch.head_dim
            # megatron-core's row order: per query group, its query heads, then its key, then its value
            qkv = self.linear_qkv(x).view(b, t, arch.groups, (per + 2) * hd)
            q, k, v = qkv.split([per * hd, hd, hd], dim=-1)
            q = q.reshape(b, t, arch.num_attention_heads, hd).transpose(1, 2)
            k = k.transpose(1, 2).repeat_interleave(per, dim=1)
            v = v.transpose(1, 2).repeat_interleave(per, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.linear_proj(y.transpose(1, 2).reshape(b, t, -1))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear_fc1 = nn.Linear(h, arch.ffn)
            self.linear_fc2 = nn.Linear(arch.ffn, h)

        def forward(self, x):
            return self.linear_fc2(F.gelu(self.linear_fc1(x)))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = nn.LayerNorm(h)
            self.self_attention = SelfAttention()
            self.pre_mlp_layernorm = nn.LayerNorm(h)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.self_attention(self.input_layernorm(x))
            return x + self.mlp(self.pre_mlp_layernorm(x))

    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = nn.Embedding(arch.padded_vocab(1), h)
            self.position_embeddings = nn.Embedding(arch.max_position_embeddings, h)

        def forward(self, idx):
            return self.word_embeddings(idx) + self.position_embeddings(torch.arange(idx.shape[1]))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(arch.num_layers))
            self.final_layernorm = nn.LayerNorm(h)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.final_layernorm(x)

    class GPTModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = Embedding()
            self.decoder = Decoder()
            _init(self, arch)

        def forward(self, idx):
            # tied embeddings (Megatron's default): the output layer is the word embedding
            return self.decoder(self.embedding(idx)) @ self.embedding.word_embeddings.weight.t()

    return GPTModel()


def _init(model, arch: ModelArch) -> None:
    """Megatron's initialisation: normal(0, 0.02) weights, output projections scaled by 1/sqrt(2 layers),
    zero biases, unit norms (torch's defaults would make the tied logits far too large at the start)."""
    import torch

    scaled = 0.02 / math.sqrt(2 * arch.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, scaled if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0.02)


def data():
    """The training text as token ids (one token per character)."""
    import torch

    return torch.tensor([CHARS.index(c) for c in TEXT * 8])


def batches(tokens, n: int = BATCH):
    import torch

    ix = torch.randint(0, len(tokens) - CONTEXT - 1, (n,))
    x = torch.stack([tokens[i:i + CONTEXT] for i in ix])
    y = torch.stack([tokens[i + 1:i + CONTEXT + 1] for i in ix])
    return x, y


def setup(total_steps: int):
    """Model, optimizer, scheduler and data of the demo trainer (deterministic on CPU)."""
    import torch

    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    return model, opt, sched, data()


def megatron_args(total_steps: int) -> dict:
    """The training job of ``setup``/``train_step`` as Megatron-LM's arguments name it: restore writes the data
    position (iteration x global batch) and rebuilds the learning-rate schedule from them."""
    return {"global_batch_size": BATCH, "micro_batch_size": BATCH, "seq_length": CONTEXT, "train_iters": total_steps,
            "lr": LR, "min_lr": 0.0, "lr_decay_style": "cosine", "lr_warmup_iters": 0, "weight_decay": WEIGHT_DECAY,
            "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "clip_grad": 1.0}


def train_step(model, opt, sched, tokens) -> float:
    import torch

    x, y = batches(tokens)
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
