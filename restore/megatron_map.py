"""Canonical global tensors <-> the shards of a Megatron rank (tp, pp, vpp): one set of rules, used both ways.

Canonical names are megatron-core local-spec names with *global* layer indices
(``decoder.layers.7.mlp.linear_fc1.weight``); vocabulary tensors hold the rows
the trainer had — Megatron's padded vocabulary at the layout the step was pushed
or saved at (``ModelArch.padded_vocab_size``), or the true vocabulary ``V`` for
steps stored before padding rows were kept.  A layout that pads to another size
drops the extra padding rows or appends copies of the last stored row, as
Megatron-LM's checkpoint converter does.  A rank's tensor is a list of
``Part``s — boxes of the canonical tensor placed at boxes of the local tensor —
so restore cuts with them and import/capture records shards with them
(specs/megatron.md).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from flowcheck.restore.arch import ModelArch

# layer-local names whose TE form fuses the norm into the following linear
_TE_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Param:
    """One canonical model tensor."""

    name: str
    shape: tuple[int, ...]
    role: str  # replicated | column | row | vocab | qkv | swiglu_fc1
    layer: int | None = None  # global layer index for decoder layers
    suffix: str = ""  # name inside the layer (local spec), e.g. "mlp.linear_fc1.weight"


@dataclass(frozen=True)
class Part:
    """``local[dest] = canonical[src]``; ``pad`` parts (rows past the stored ones) repeat the last stored row."""

    dest: tuple[slice, ...]
    src: tuple[slice, ...]
    pad: bool = False


@dataclass(frozen=True)
class RankTensor:
    """Where one canonical tensor lands on one rank: model chunk, local key, local shape, parts."""

    param: Param
    chunk: int  # virtual pipeline chunk (0 without VPP)
    key: str  # key in the chunk's state dict
    shape: tuple[int, ...]
    parts: tuple[Part, ...]


def model_params(arch: ModelArch) -> list[Param]:
    """Every canonical tensor of the model, in megatron-core's ``named_parameters()`` order."""
    h, V = arch.hidden_size, arch.stored_vocab
    out = [Param("embedding.word_embeddings.weight", (V, h), "vocab")]
    if arch.learned_positions:
        out.append(Param("embedding.position_embeddings.weight", (arch.max_position_embeddings, h), "replicated"))
    qkv_rows = (arch.num_attention_heads + 2 * arch.groups) * arch.head_dim
    fc1_rows = arch.ffn * (2 if arch.swiglu else 1)
    fc1_role = "swiglu_fc1" if arch.swiglu else "column"
    per_layer: list[tuple[str, tuple[int, ...], str, bool]] = [
        ("input_layernorm.weight", (h,), "replicated", True),
        ("input_layernorm.bias", (h,), "replicated", arch.norm_bias),
        # Attention registers linear_proj before SelfAttention adds linear_qkv: named_parameters() order,
        # which the legacy (non-distributed) optimizer's parameter indices follow
        ("self_attention.linear_proj.weight", (h, arch.num_attention_heads * arch.head_dim), "row", True),
        ("self_attention.linear_proj.bias", (h,), "replicated", arch.add_bias_linear),
        ("self_attention.linear_qkv.weight", (qkv_rows, h), "qkv", True),
        ("self_attention.linear_qkv.bias", (qkv_rows,), "qkv", arch.qkv_bias),
        ("pre_mlp_layernorm.weight", (h,), "replicated", True),
        ("pre_mlp_layernorm.bias", (h,), "replicated", arch.norm_bias),
        ("mlp.linear_fc1.weight", (fc1_rows, h), fc1_role, True),
        ("mlp.linear_fc1.bias", (fc1_rows,), fc1_role, arch.add_bias_linear),
        ("mlp.linear_fc2.weight", (h, arch.ffn), "row", True),
        ("mlp.linear_fc2.bias", (h,), "replicated", arch.add_bias_linear),
    ]
    for i in range(arch.num_layers):
        for suffix, shape, role, present in per_layer:
            if present:
                out.append(Param(f"decoder.layers.{i}.{suffix}", shape, role, i, suffix))
    out.append(Param("decoder.final_layernorm.weight", (h,), "replicated"))
    if arch.norm_bias:
        out.append(Param("decoder.final_layernorm.bias", (h,), "replicated"))
    if not arch.tied:
        out.append(Param("output_layer.weight", (V, h), "vocab"))
    return out


def tp_parts(arch: ModelArch, param: Param, tp: int, rank: int) -> tuple[tuple[int, ...], tuple[Part, ...]]:
    """The local shape of ``param`` on TP rank ``rank`` and the canonical boxes it is made of."""
    shape = param.shape
    full = tuple(slice(0, s) for s in shape)
    if param.role == "replicated" or tp == 1 and param.role != "vocab":
        return shape, (Part(full, full),)
    if param.role == "vocab":
        n = arch.padded_vocab(tp) // tp
        lo, hi = rank * n, (rank + 1) * n
        real = max(0, min(hi, shape[0]) - lo)
        rest = full[1:]
        parts = []
        if real:
            parts.append(Part((slice(0, real), *rest), (slice(lo, lo + real), *rest)))
        if real < n:
            parts.append(Part((slice(real, n), *rest), (slice(shape[0] - 1, shape[0]), *rest), pad=True))
        return (n, *shape[1:]), tuple(parts)
    if param.role in ("column", "qkv"):
        n = shape[0] // tp
        return (n, *shape[1:]), (Part((slice(0, n), *full[1:]), (slice(rank * n, (rank + 1) * n), *full[1:])),)
    if param.role == "row":
        n = shape[1] // tp
        local = (shape[0], n, *shape[2:])
        return local, (Part((full[0], slice(0, n), *full[2:]), (full[0], slice(rank * n, (rank + 1) * n), *full[2:])),)
    if param.role == "swiglu_fc1":
        half = shape[0] // 2
        n = half // tp
        rest = full[1:]
        gate = Part((slice(0, n), *rest), (slice(rank * n, (rank + 1) * n), *rest))
        up = Part((slice(n, 2 * n), *rest), (slice(half + rank * n, half + (rank + 1) * n), *rest))
        return (2 * n, *shape[1:]), (gate, up)
    raise ValueError(f"{param.name}: no TP rule for role {param.role!r}")


def stage_of_layer(arch: ModelArch, pp: int, vpp: int, layer: int) -> tuple[int, int, int]:
    """(pp rank, virtual chunk, local index) of a global layer (even stages)."""
    per = arch.num_layers // (pp * vpp)
    chunk = layer // per
    return chunk % pp, chunk // pp, layer % per


def local_suffix(suffix: str, layer_spec: str) -> str:
    if layer_spec == "te":
        for local, te in _TE_NORMS:
            if suffix.startswith(local):
                return te + suffix[len(local):]
    return suffix


def canonical_suffix(suffix: str) -> str:
    """The local-spec name of a layer-local key written with either spec's names."""
    for local, te in _TE_NORMS:
        if suffix.startswith(te):
            return local + suffix[len(te):]
    return suffix


def rank_tensors(
    arch: ModelArch, tp: int, pp: int, vpp: int, tp_rank: int, pp_rank: int, layer_spec: str = "local"
) -> Iterator[RankTensor]:
    """Every tensor rank (tp_rank, pp_rank) holds, with its chunk, key and parts."""
    first, last = (pp_rank == 0), (pp_rank == pp - 1)
    tied_output = None
    for param in model_params(arch):
        shape, parts = tp_parts(arch, param, tp, tp_rank)
        if param.layer is not None:
            p, v, i = stage_of_layer(arch, pp, vpp, param.layer)
            if p == pp_rank:
                yield RankTensor(param, v, f"decoder.layers.{i}.{local_suffix(param.suffix, layer_spec)}", shape, parts)
        elif param.name.startswith("embedding."):
            if first:
                yield RankTensor(param, 0, param.name, shape, parts)
            if param.name == "embedding.word_embeddings.weight" and arch.tied and pp > 1 and last:
                # tied embeddings at PP>1: the last stage keeps its own copy as the output layer (its last module)
                tied_output = RankTensor(param, vpp - 1, "output_layer.weight", shape, parts)
        elif last:
            yield RankTensor(param, vpp - 1, param.name, shape, parts)
    if tied_output is not None:
        yield tied_output


def parse_layer_key(key: str) -> tuple[int, str] | None:
    """(local index, layer-local suffix) of ``decoder.layers.<i>.<suffix>``, else None."""
    m = _LAYER_RE.match(key)
    return (int(m.group(1)), m.group(2)) if m else None


def chunk_key(vpp: int, chunk: int) -> str:
    """The state-dict key holding a model chunk in Megatron's checkpoints."""
    return "model" if vpp == 1 else f"model{chunk}"


@dataclass(frozen=True)
class VocabRows:
    """What a restore does with the embedding and output-layer rows: the true vocabulary, the rows the step stores
    (``recorded``: its description names them), and the rows Megatron pads to at the target TP."""

    vocab_size: int
    stored: int
    target: int
    recorded: bool = True

    @classmethod
    def of(cls, arch: ModelArch, tp: int) -> VocabRows:
        return cls(arch.vocab_size, arch.stored_vocab, arch.padded_vocab(tp), arch.padded_vocab_size is not None)

    @property
    def exact(self) -> bool:
        """Every row is restored as stored, the padding rows included: training resumes bit for bit."""
        return self.stored == self.target

    def note(self) -> str:
        """One line for the restore report and record: which rows are kept, dropped or new, and what that means."""
        pad = f"{self.target} rows (vocab_size {self.vocab_size} + {self.target - self.vocab_size} padding)"
        if self.exact:
            return f"{pad}: every row as stored"
        if self.stored > self.target:
            done = f"the step stores {self.stored}; padding rows {self.target}..{self.stored - 1} are dropped"
        else:
            kept = f"{self.stored} rows" if self.recorded or self.stored > self.vocab_size else \
                "only the true vocabulary (stored before flowcheck kept padding rows)"
            done = (f"the step stores {kept}, kept as stored; new rows {self.stored}..{self.target - 1} are copies of "
                    f"row {self.stored - 1}, the last stored one, weights and optimizer state (as Megatron-LM's "
                    "checkpoint converter pads)")
        return (f"{pad}: {done}; Megatron's softmax runs over every padded row, so the resumed losses differ from a "
                f"run at {self.stored} rows")

    def to_json(self) -> dict[str, int | str]:
        return {"vocab_size": self.vocab_size, "stored_rows": self.stored, "restored_rows": self.target,
                "rows": self.note()}
