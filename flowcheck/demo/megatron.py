"""The demo's restore check: the last step as Megatron checkpoints at TP=2/PP=2, each read back and compared.

Both formats are read back in this one process the way Megatron reads them —
``torch.load`` of every ``mp_rank_TT_PPP/model_optim_rng.pt`` (legacy), the DCP
``.metadata`` index and ``*.distcp`` pieces of the ``torch_dist`` directory (through
flowcheck's allow-listed DCP reader: DCP's own would unpickle freely) — and put back together with
Megatron's layout rules stated here on their own (column- and row-parallel
linears, the padded vocabulary, stacked layers, stage-local layer numbers), not
with the rules flowcheck's restore used to write them.  Every tensor (weights,
Adam moments, fp32 masters, step counters) must equal the trainer's live state
bit for bit.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowcheck.errors import FlowcheckError

if TYPE_CHECKING:
    from flowcheck.store import Store

TP, PP = 2, 2
OPT = "optimizer."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron's tensor-parallel split: ColumnParallelLinear splits output rows, RowParallelLinear input columns,
# VocabParallelEmbedding vocabulary rows; everything else (norms, row-parallel biases) is replicated
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
           "mlp.linear_fc1.bias")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB = "embedding.word_embeddings.weight"
# torch_dist keys of the layer norms (Transformer Engine names, fused into the following linear)
_TE_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


@dataclass(frozen=True)
class RestoreCheck:
    """One ``flowcheck restore`` of the demo's last step, and what reading it back found."""

    fmt: str
    out: str
    step: int | None
    files: int
    nbytes: int
    seconds: float
    loader: str  # how the checkpoint was read back
    compared: int  # tensors found equal to the trainer's state
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems and self.compared > 0


def restore_and_check(store: Store, fmt: str, out: str, expected: dict[str, Any], last: int) -> RestoreCheck:
    """``flowcheck restore --step latest --tp 2 --pp 2 --format FMT --out OUT --force``, then read OUT back and
    compare every tensor with ``expected`` (the trainer's live state at step ``last``, by canonical name)."""
    from flowcheck.demo.model import ARCH
    from flowcheck.restore.megatron_common import Target
    from flowcheck.restore.service import restore

    loader = "the DCP index and pieces" if fmt == "megatron-dist" else "torch.load"
    try:
        rep = restore(store, "latest", Target(tp=TP, pp=PP, fmt=fmt), out, force=True)
    except FlowcheckError as e:
        return RestoreCheck(fmt, out, None, 0, 0, 0.0, loader, 0, (f"restore failed: {e}",))
    problems = [] if rep.step == last else [f"restored step {rep.step}, expected the trainer's last step {last}"]
    try:
        it_dir = _iteration_dir(out, rep.step)
        read = _read_dist(it_dir, rep.step) if fmt == "megatron-dist" else _read_legacy(it_dir, rep.step)
    except Exception as e:  # noqa: BLE001 - whatever reading back fails on is the check's finding
        problems.append(f"reading {out} back failed: {type(e).__name__}: {e}")
        return RestoreCheck(fmt, out, rep.step, len(rep.files), rep.bytes, rep.seconds, loader, 0, tuple(problems))
    tensors, found = read
    problems += found
    compared, found = _compare(tensors, expected, ARCH.vocab_size)
    return RestoreCheck(fmt, out, rep.step, len(rep.files), rep.bytes, rep.seconds, loader, compared,
                        tuple(problems + found))


def _iteration_dir(out: str, step: int) -> str:
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), encoding="utf-8") as f:
        tracked = f.read().strip()
    if tracked != str(step):
        raise FlowcheckError(f"the tracker file names iteration {tracked!r}, expected {step}")
    return os.path.join(out, f"iter_{step:07d}")


def _torch_load(path: str) -> Any:
    """A Megatron .pt file as Megatron loads it, tensors and containers plus its ``args`` Namespace only."""
    import argparse

    import torch

    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def _check_args(obj: dict, step: int, where: str) -> list[str]:
    """What Megatron-LM asserts of a checkpoint's args and iteration when it loads at TP=2/PP=2."""
    from flowcheck.demo.model import ARCH

    args = obj.get("args")
    want = {"tensor_model_parallel_size": TP, "pipeline_model_parallel_size": PP, "num_layers": ARCH.num_layers,
            "hidden_size": ARCH.hidden_size, "num_attention_heads": ARCH.num_attention_heads,
            "padded_vocab_size": ARCH.padded_vocab(TP)}
    bad = {k: getattr(args, k, None) for k, v in want.items() if getattr(args, k, None) != v}
    problems = [f"{where}: args {bad} differ from the layout and model (expected {want})"] if bad else []
    if obj.get("iteration") != step:
        problems.append(f"{where}: iteration {obj.get('iteration')!r}, expected {step}")
    return problems


# ---- legacy: one model_optim_rng.pt per (tp, pp) rank -------------------------------------------------
def _read_legacy(it_dir: str, step: int) -> tuple[dict[tuple[str, str], list], list[str]]:
    """{(label, canonical name): [the TP ranks' local tensors]} of every model and optimizer tensor."""
    from flowcheck.demo.model import ARCH

    per = ARCH.num_layers // PP
    pieces: dict[tuple[str, str], list] = {}
    problems: list[str] = []
    for p in range(PP):
        for t in range(TP):
            where = os.path.join(f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt")
            obj = _torch_load(os.path.join(it_dir, where))
            problems += _check_args(obj, step, where)
            model = obj["model"]
            names = {k: _global_name(k, p * per) for k in model}
            for k, v in model.items():
                pieces.setdefault(names[k], []).append(v)
            inner = obj["optimizer"].get("optimizer", obj["optimizer"])
            for group in inner["param_groups"]:
                # Megatron's param groups: weights (weight decay) and 1-D tensors (wd_mult 0), each in model order
                members = [k for k in model if (model[k].dim() > 1) == (group["wd_mult"] > 0)]
                if len(members) != len(group["params"]):
                    problems.append(f"{where}: a param group lists {len(group['params'])} parameters, the model "
                                    f"chunk has {len(members)} of its kind")
                for index, k in zip(group["params"], members):
                    label, name = names[k]
                    for slot, v in inner["state"][index].items():
                        pieces.setdefault((f"{OPT}{slot}.{label}", f"{OPT}{slot}.{name}"), []).append(v)
    return pieces, problems


def _global_name(key: str, first_layer: int) -> tuple[str, str]:
    """(label, canonical name) of a stage's key: stage-local layer numbers become global ones; the last
    stage's output_layer is its copy of the tied word embedding."""
    m = _LAYER.match(key)
    if m:
        name = f"decoder.layers.{first_layer + int(m.group(1))}.{m.group(2)}"
        return name, name
    if key == "output_layer.weight":
        return "output_layer.weight (tied copy, last stage)", _VOCAB
    return key, key


# ---- torch_dist: one DCP checkpoint of global, layer-stacked tensors -----------------------------------
def _read_dist(it_dir: str, step: int) -> tuple[dict[tuple[str, str], list], list[str]]:
    import torch

    from flowcheck.demo.model import ARCH
    from flowcheck.restore.dcp_read import load_tensors, read_index

    common = _torch_load(os.path.join(it_dir, "common.pt"))
    problems = _check_args(common, step, "common.pt")
    # DCP's own reader would unpickle .metadata freely: flowcheck reads it only through its allow-listed loader
    state = load_tensors(it_dir, read_index(it_dir).values())
    pieces: dict[tuple[str, str], list] = {}
    names = [_dist_names(k) for k in state]
    for key, (name, stacked) in zip(state, names):
        slot, base = ("", key)
        if key.startswith("optimizer.state."):
            slot, base = key[len("optimizer.state."):].split(".", 1)
            slot = "fp32_param" if slot == "param" else slot
        if not stacked:
            pieces[(key, f"{OPT}{slot}.{name}" if slot else name)] = [state[key]]
            continue
        for i in range(ARCH.num_layers):
            canonical = f"decoder.layers.{i}.{name}"
            pieces[(f"{key}[{i}]", f"{OPT}{slot}.{canonical}" if slot else canonical)] = [state[key][i]]
    groups = common.get("optimizer", {}).get("optimizer", {}).get("param_groups", [])
    steps = {g.get("step") for g in groups}
    for (label, name) in list(pieces):
        if name.startswith(OPT + "exp_avg."):  # Adam's step counter: one per param group in common.pt
            base = name[len(OPT + "exp_avg."):]
            pieces[(f"common.pt optimizer param_groups step ({base})", f"{OPT}step.{base}")] = [
                torch.tensor(float(s)) if isinstance(s, (int, float)) else s for s in steps]
    return pieces, problems


def _dist_names(key: str) -> tuple[str, bool]:
    """(canonical name, or layer-local name when stacked over layers; stacked?) of a torch_dist key."""
    base = key.split(".", 3)[3] if key.startswith("optimizer.state.") else key
    if not base.startswith("decoder.layers."):
        return base, False
    local = base[len("decoder.layers."):]
    for canonical, te in _TE_NAMES:
        if local.startswith(te):
            local = canonical + local[len(te):]
    return local, True


# ---- comparison ---------------------------------------------------------------------------------------
def _compare(pieces: dict[tuple[str, str], list], expected: dict[str, Any], vocab: int) -> tuple[int, list[str]]:
    """Put the TP pieces together, compare each with the trainer's tensor; every trainer tensor must be there."""
    problems, compared, seen = [], 0, set()
    for (label, name), parts in pieces.items():
        whole, why = _assemble(name, parts, vocab)
        want = expected.get(name)
        if name.startswith(OPT + "fp32_param."):  # the fp32 master of an fp32 run is the weight itself
            want = expected.get(name[len(OPT + "fp32_param."):])
        if why:
            problems.append(f"{label}: {why}")
        elif want is None:
            problems.append(f"{label}: not a tensor of the trainer's state")
        elif tuple(whole.shape) != tuple(want.shape) or whole.dtype != want.dtype:
            problems.append(f"{label}: {whole.dtype} {list(whole.shape)}, the trainer's is {want.dtype} {list(want.shape)}")
        elif whole.numpy().tobytes() != want.numpy().tobytes():
            differ = int((whole != want).sum())
            problems.append(f"{label}: {differ} of {want.numel()} elements differ from the trainer's state")
        else:
            compared += 1
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        problems.append(f"{len(missing)} of the trainer's tensors are not in the checkpoint: {missing[:3]}")
    return compared, problems


def _assemble(name: str, parts: list, vocab: int):
    """(the global tensor from the TP ranks' parts, None) or (None, why not)."""
    import torch

    base = name.split(".", 2)[2] if name.startswith(OPT) else name
    m = _LAYER.match(base)
    local = m.group(2) if m else base
    split = parts[0].dim() > 0  # a step counter is one number per parameter, the same on every rank
    if split and base == _VOCAB:
        whole = torch.cat(parts, 0)
        pad = whole[vocab:]
        if pad.shape[0] and not bool((pad == whole[vocab - 1]).all()):
            return None, f"the {pad.shape[0]} padding rows of the vocabulary do not repeat its last row"
        return whole[:vocab], None
    if split and local in _COLUMN:
        return torch.cat(parts, 0), None
    if split and local in _ROW:
        return torch.cat(parts, 1), None
    if any(p.shape != parts[0].shape or not torch.equal(p, parts[0]) for p in parts[1:]):
        return None, f"its {len(parts)} tensor-parallel copies differ"
    return parts[0], None
