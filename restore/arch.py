"""The model architecture, in Megatron-LM argument names: what tensor shapes alone cannot tell restore.

Head counts, KV groups, GLU and tied embeddings decide how a tensor splits
across TP ranks and which layouts a model can take at all; flowcheck stores
this description in every manifest (``scalars.extra["model"]``) so a step can
be restored without the trainer's command line.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from flowcheck.errors import ConfigError, FlowcheckError

LAYER_SPECS = ("local", "te")


class LayoutError(FlowcheckError, ValueError):
    """The model cannot take the asked parallel layout (heads, groups, layers or vocab do not divide)."""


@dataclass(frozen=True)
class ModelArch:
    """A GPT model as Megatron-LM's arguments describe it (names kept exactly)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # the true vocabulary; the embedding is padded per TP (see padded_vocab)
    ffn_hidden_size: int | None = None  # default 4*hidden
    num_query_groups: int | None = None  # None = MHA (groups == heads)
    kv_channels: int | None = None  # default hidden/heads
    swiglu: bool = False
    normalization: str = "LayerNorm"  # or "RMSNorm"
    position_embedding_type: str = "learned_absolute"  # or "rope"
    add_position_embedding: bool | None = None  # default: position_embedding_type == learned_absolute
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    max_position_embeddings: int = 4096
    make_vocab_size_divisible_by: int = 128
    layer_spec: str = "local"  # key names of the trainer: megatron-core local spec or Transformer Engine
    # the embedding rows the step stores: Megatron's padded vocabulary at the layout it was pushed or saved at (the
    # padding rows are trained state: their logits are in the softmax); None: the true vocabulary only (older steps)
    padded_vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            _positive(name, getattr(self, name))
        for name in ("ffn_hidden_size", "num_query_groups", "kv_channels", "padded_vocab_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"model: normalization: expected 'LayerNorm' or 'RMSNorm', found {self.normalization!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ConfigError(
                "model: position_embedding_type: expected 'learned_absolute', 'rope' or 'none', "
                f"found {self.position_embedding_type!r}"
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"model: padded_vocab_size: expected at least vocab_size {self.vocab_size}, found "
                              f"{self.padded_vocab_size}")
        if self.layer_spec not in LAYER_SPECS:
            raise ConfigError(f"model: layer_spec: expected one of {LAYER_SPECS}, found {self.layer_spec!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; give kv_channels"
            )
        if self.num_attention_heads % self.groups:
            raise ConfigError(
                f"model: num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {self.groups}"
            )

    # ---- derived sizes --------------------------------------------------
    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def learned_positions(self) -> bool:
        if self.add_position_embedding is not None:
            return bool(self.add_position_embedding) and self.position_embedding_type == "learned_absolute"
        return self.position_embedding_type == "learned_absolute"

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def norm_bias(self) -> bool:
        return self.normalization == "LayerNorm"

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padded vocabulary for a TP size: a multiple of divisible_by * TP."""
        m = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / m) * m

    @property
    def stored_vocab(self) -> int:
        """The rows of the canonical embedding and output layer: the padded rows when the step keeps them."""
        return self.padded_vocab_size or self.vocab_size

    def with_stored_rows(self, rows: int, where: str) -> ModelArch:
        """This description with ``rows`` stored vocabulary rows (what a pushed or imported tensor holds)."""
        if rows < self.vocab_size or self.padded_vocab_size not in (None, rows):
            expected = self.padded_vocab_size or f"at least vocab_size {self.vocab_size}"
            raise LayoutError(f"{where}: vocabulary rows: expected {expected}, found {rows}; is the model description "
                              "(vocab_size, padded_vocab_size, make_vocab_size_divisible_by) the trainer's?")
        return replace(self, padded_vocab_size=rows)

    def check_layout(self, tp: int, pp: int, vpp: int = 1) -> None:
        """Refuse, with the reason, a layout Megatron cannot build for this model."""
        for name, v in (("tp", tp), ("pp", pp), ("vpp", vpp)):
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"--{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % tp:
            raise LayoutError(f"TP={tp} does not divide num_attention_heads={self.num_attention_heads}")
        if self.groups % tp and tp % self.groups:
            raise LayoutError(
                f"TP={tp} and num_query_groups={self.groups}: neither divides the other, "
                "so KV groups cannot be split or shared evenly across TP ranks"
            )
        qkv_rows = (self.num_attention_heads + 2 * self.groups) * self.head_dim
        if qkv_rows % tp:
            raise LayoutError(f"TP={tp} does not divide the {qkv_rows} rows of linear_qkv")
        if self.ffn % tp:
            raise LayoutError(f"TP={tp} does not divide ffn_hidden_size={self.ffn}")
        if self.num_layers % (pp * vpp):
            raise LayoutError(
                f"num_layers={self.num_layers} is not divisible by PP*VPP={pp}*{vpp}: uneven pipeline "
                "stages are not supported by flowcheck restore"
            )
        if vpp > 1 and pp < 2:
            raise LayoutError(f"--vpp {vpp} needs --pp >= 2 (Megatron's interleaved schedule)")

    # ---- (de)serialisation ----------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if out["padded_vocab_size"] is None:
            del out["padded_vocab_size"]  # a step without padding rows is described as before
        return out

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "model description") -> ModelArch:
        """Build from Megatron argument names; unknown names are ignored (args carry many)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping of Megatron argument names, found {type(raw).__name__}")
        known = {f.name: f for f in fields(cls)}
        values = {k: raw[k] for k in known if k in raw and raw[k] is not None}
        missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in values]
        if missing and "padded_vocab_size" in raw and missing == ["vocab_size"]:
            values["vocab_size"] = raw["padded_vocab_size"]
            missing = []
        if missing:
            raise ConfigError(f"{where}: missing {missing} (Megatron argument names are expected)")
        if "swiglu" not in values and raw.get("gated_linear_unit"):
            values["swiglu"] = True
        if values.get("num_query_groups") and not raw.get("group_query_attention", True):
            values.pop("num_query_groups")  # Megatron ignores num_query_groups without --group-query-attention
        if raw.get("transformer_impl") == "transformer_engine" and "layer_spec" not in raw:
            values["layer_spec"] = "te"
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from e


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"model: {name}: expected a positive integer, found {value!r}")


def load_arch(path: str) -> ModelArch:
    """``--arch FILE``: YAML or JSON with Megatron argument names (optionally under a ``model:`` key)."""
    from flowcheck.config import read_yaml

    raw = read_yaml(path, ConfigError, "--arch")
    if isinstance(raw, Mapping) and isinstance(raw.get("model"), Mapping):
        raw = raw["model"]
    return ModelArch.from_mapping(raw, f"--arch {path}")


def arch_from_metadata(meta: Mapping[str, str], where: str) -> ModelArch | None:
    """The description in a safetensors ``__metadata__`` (values JSON-encoded), or None when absent."""
    if "num_layers" not in meta:
        return None
    decoded = {}
    for k, v in meta.items():
        try:
            decoded[k] = json.loads(v)
        except (TypeError, ValueError):
            decoded[k] = v
    return ModelArch.from_mapping(decoded, where)
