"""``flowcheck import``: bring an existing checkpoint under management as a committed step (``source: import``).

Sources: a Megatron checkpoint directory (legacy ``mp_rank_*`` files or
``torch_dist``, any TP/PP/VPP, optimizer state where the format carries it in
a model-shaped form), a plain PyTorch DCP directory (``dcp.save``'s ``.metadata`` + ``*.distcp``:
restore/dcp_read.py) or a safetensors file of canonical names.  Every rank's
tensors are recorded as shards in the canonical index space with the same
rules restore cuts with, so a TP=4 import restores at TP=2.  Nothing is
unpickled beyond tensors, containers and ``argparse.Namespace`` (``.pt``) and
the DCP metadata classes (``.metadata``) unless the user passes ``--trust-pickle``
(see ``unpickle.py``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flowcheck.errors import FormatError, ManifestError
from flowcheck.manifest import ParentRef, parse_ref
from flowcheck.restore.arch import ModelArch, arch_from_metadata
from flowcheck.restore.dcp_read import METADATA, StoredTensor, load_tensors, read_index, snapshot_of
from flowcheck.restore.megatron_common import TRACKER, iter_dirname
from flowcheck.restore.megatron_dist import OPT_PREFIX as DIST_OPT, dist_key
from flowcheck.restore.megatron_map import Param, canonical_suffix, model_params, rank_tensors
from flowcheck.restore.megatron_optim import group_members, json_group, saved_groups
from flowcheck.restore.source import MEGATRON_KEY, MODEL_KEY, OPT
from flowcheck.restore.unpickle import load_pt
from flowcheck.state import ParallelLayout, Scalars, Shard, Snapshot, StateLayout, TensorSpec

if TYPE_CHECKING:
    from flowcheck.store import Store

log = logging.getLogger(__name__)
RESTORE_RECORD = "flowcheck_restore.json"  # written by restore: which stored step a directory came from
_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


@dataclass
class Collected:
    """Shards gathered from a source, keyed by canonical tensor, plus what the source says of itself."""

    arch: ModelArch
    layout: ParallelLayout
    shards: dict[Shard, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    optimizer_step: int | None = None
    megatron: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, offsets: tuple[int, ...], data: torch.Tensor) -> None:
        shard = Shard(name, offsets, tuple(data.shape))
        if shard in self.shards:
            return  # a replica (TP-replicated tensor, tied output layer): the first copy is kept
        self.dtypes[name] = data.dtype
        self.shards[shard] = _to_numpy(data)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    from flowcheck.torch.state import to_numpy

    return to_numpy(t.detach().contiguous().clone())


# ---- public entry -------------------------------------------------------------------
def import_checkpoint(path: str, run: str, step: int, *, arch: ModelArch | None = None, trust_pickle: bool = False) -> Snapshot:
    """A Snapshot (``source: import``, or ``restore`` for a directory flowcheck restore wrote) of ``path``.

    ``trust_pickle`` lifts the allow-lists of ``.pt`` files and the DCP ``.metadata`` (``--trust-pickle``);
    DCP tensor items are read ``weights_only`` always, as torch's own reader does.
    """
    if os.path.isfile(path) and path.endswith(".safetensors"):
        got = _from_safetensors(path, arch)
    elif os.path.isfile(os.path.join(path, METADATA)) and not os.path.exists(os.path.join(path, "metadata.json")):
        return snapshot_of(path, run, step, trust_pickle=trust_pickle)  # a plain DCP directory (dcp.save's)
    elif os.path.isdir(path):
        it_dir = _iteration_dir(path)
        if os.path.exists(os.path.join(it_dir, "metadata.json")):
            got = _from_dist(it_dir, arch, trust_pickle)
        else:
            got = _from_legacy(it_dir, arch, trust_pickle)
    else:
        raise FormatError(
            f"{path}: expected a Megatron checkpoint directory (with {TRACKER} or iter_*/), a DCP checkpoint "
            "directory (.metadata + *.distcp) or a .safetensors file, found none of them"
        )
    return _snapshot(got, run, step)


def import_into(store: Store, path: str, step: int, *, arch: ModelArch | None = None, tier: str = "local",
                trust_pickle: bool = False) -> Any:
    """Import ``path`` and commit it to ``tier`` of ``store``; returns the manifest.

    A directory written by ``flowcheck restore`` keeps its lineage: the step is
    committed with ``source: restore`` and the restored step as its parent.
    """
    from dataclasses import replace

    parent = restore_record(path) if os.path.isdir(path) else None  # read first: a bad record stops the import
    snap = import_checkpoint(path, store.config.run, step, arch=arch, trust_pickle=trust_pickle)
    if parent is not None:
        return store.write(replace(snap, source="restore"), tier, parent)
    return store.write(snap, tier, root=True)


def restore_record(path: str) -> ParentRef | None:
    """The stored step a directory ``flowcheck restore`` wrote came from (its record's step and manifest digest),
    if it has a record; a record that is not JSON or has a field of the wrong type is a ManifestError naming it."""
    p = os.path.join(path, RESTORE_RECORD)
    if not os.path.isfile(p):
        return None
    with open(p, "rb") as f:
        raw = f.read(1 << 20)
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{p}: not valid JSON ({e}); restore writes this record — delete it to import the "
                            "directory as a new lineage") from e
    return parse_ref(record, p)


def _snapshot(got: Collected, run: str, step: int) -> Snapshot:
    roles = {p.name: p.role for p in model_params(got.arch)}
    specs = []
    for name in sorted({s.tensor for s in got.shards}):
        base = name.split(".", 2)[2] if name.startswith(OPT) else name
        shape = _global_shape(got, name)
        dtype = str(got.dtypes[name]).replace("torch.", "")
        specs.append(TensorSpec(name, dtype, shape, roles.get(base, "replicated")))
    _check_complete(got, specs)
    extra = {MODEL_KEY: got.arch.to_json()}
    if got.megatron:
        extra[MEGATRON_KEY] = got.megatron
    groups = got.megatron.get("param_groups")
    scalars = Scalars(optimizer_step=got.optimizer_step, optimizer={"param_groups": groups} if groups else None, extra=extra)
    return Snapshot(run, step, StateLayout(tuple(specs), got.layout), dict(got.shards), scalars, source="import")


def _global_shape(got: Collected, name: str) -> tuple[int, ...]:
    base = name.split(".", 2)[2] if name.startswith(OPT) else name
    for p in model_params(got.arch):
        if p.name == base:
            return p.shape
    boxes = [s for s in got.shards if s.tensor == name]
    return tuple(max(o + n for o, n in zip(s.offsets, s.shape)) for s in boxes[:1]) if boxes else ()


def _check_complete(got: Collected, specs: list[TensorSpec]) -> None:
    names = {s.name for s in specs}
    missing = [p.name for p in model_params(got.arch) if p.name not in names]
    if missing:
        raise FormatError(
            f"the checkpoint lacks {len(missing)} tensor(s) its model description needs: {missing[:5]}; "
            "is the description (args / --arch) the model's?"
        )
    for spec in specs:
        covered = sum(int(np.prod(s.shape)) for s in got.shards if s.tensor == spec.name)
        if covered != int(np.prod(spec.shape)):
            raise FormatError(
                f"{spec.name}: the checkpoint's shards cover {covered} of {int(np.prod(spec.shape))} elements "
                "of the global tensor; ranks are missing"
            )


# ---- Megatron directories ---------------------------------------------------------------
def _iteration_dir(path: str) -> str:
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        name = "release" if text == "release" else (iter_dirname(int(text)) if text.isdigit() else None)
        if name is None:
            raise FormatError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
        it_dir = os.path.join(path, name)
        if not os.path.isdir(it_dir):
            raise FormatError(f"{tracker} names {name}, but {it_dir} does not exist")
        return it_dir
    if os.path.basename(os.path.normpath(path)).startswith("iter_") or os.path.exists(os.path.join(path, "metadata.json")):
        return path
    raise FormatError(f"{path}: no {TRACKER} and not an iter_* directory: not a Megatron checkpoint")


def _checkpoint_dict(path: str, trust_pickle: bool) -> dict[str, Any]:
    obj = load_pt(path, path, trust_pickle)
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: expected a dict (Megatron's checkpoint layout), found {type(obj).__name__}")
    return obj


def _args_dict(args: Any) -> dict[str, Any]:
    raw = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool, type(None)))}


def _arch_from_args(args: dict[str, Any], arch: ModelArch | None, where: str, vocab_rows: int | None = None) -> ModelArch:
    """The model from ``--arch``, else the checkpoint's args; without a vocabulary size in the args, the
    stored (padded) embedding rows stand in for it — the true vocabulary is then unknown, and said so."""
    if arch is not None:
        return arch
    if not args:
        raise FormatError(f"{where}: the checkpoint has no args; give the model with --arch FILE.yaml")
    if not args.get("vocab_size") and not args.get("padded_vocab_size") and vocab_rows:
        log.warning("%s: args name no vocab_size/padded_vocab_size; using the %d stored embedding rows "
                    "(give --arch with vocab_size to say which of them are Megatron's padding rows)", where, vocab_rows)
        args = dict(args, vocab_size=vocab_rows)
    elif not args.get("vocab_size") and args.get("padded_vocab_size"):
        log.warning("%s: args name no vocab_size; keeping all %d padded rows as the vocabulary", where,
                    args["padded_vocab_size"])
    return ModelArch.from_mapping(args, f"{where} args")


def _stored_rows(a: ModelArch, rows: int | None, where: str) -> ModelArch:
    """The description with every embedding row the checkpoint holds: Megatron's padding rows are trained state."""
    if rows is None:
        return a
    if rows < a.vocab_size:
        raise FormatError(f"{where}: embedding.word_embeddings.weight: expected at least vocab_size {a.vocab_size} "
                          f"rows, found {rows}; is the model description (args / --arch) the model's?")
    return a.with_stored_rows(rows, f"{where}: embedding.word_embeddings.weight")


def _from_legacy(it_dir: str, arch: ModelArch | None, trust_pickle: bool) -> Collected:
    ranks = {}
    for name in sorted(os.listdir(it_dir)):
        m = _RANK_RE.match(name)
        if m and os.path.isfile(os.path.join(it_dir, name, "model_optim_rng.pt")):
            ranks[int(m.group(1)), int(m.group(2) or 0)] = os.path.join(it_dir, name, "model_optim_rng.pt")
    if not ranks:
        raise FormatError(f"{it_dir}: no mp_rank_*/model_optim_rng.pt files (and no metadata.json for torch_dist)")
    tp, pp = max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1
    if len(ranks) != tp * pp:
        raise FormatError(f"{it_dir}: found {len(ranks)} rank files, expected TP*PP = {tp}*{pp}; the checkpoint is incomplete")
    got: Collected | None = None
    for (t, p), path in sorted(ranks.items()):
        obj = _checkpoint_dict(path, trust_pickle)
        args = _args_dict(obj.get("args"))
        chunks = sorted(k for k in obj if re.fullmatch(r"model\d*", k))
        vpp = len(chunks) if chunks != ["model"] else 1
        if got is None:
            emb = obj.get(chunks[0], {}).get("embedding.word_embeddings.weight")
            rows = emb.shape[0] * tp if isinstance(emb, torch.Tensor) and emb.dim() else None
            a = _stored_rows(_arch_from_args(args, arch, path, rows), rows, path)
            a.check_layout(tp, pp, vpp)
            got = Collected(a, ParallelLayout(tp=tp, pp=pp, vpp=vpp), megatron=_megatron_extra(obj, args))
        spec = _layer_spec(obj[chunks[0]])
        rts = {(rt.chunk, rt.key): rt for rt in rank_tensors(got.arch, tp, pp, vpp, t, p, spec)}
        for v, ck in enumerate(chunks):
            _collect(got, obj[ck], v, rts, path)
        if "optimizer" in obj:
            _legacy_optimizer(got, obj["optimizer"], rts, path)
    return got


def _layer_spec(state: dict[str, Any]) -> str:
    return "te" if any(".layer_norm_weight" in k for k in state) else "local"


def _collect(got: Collected, state: dict[str, Any], chunk: int, rts: dict, where: str, prefix: str = "") -> None:
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue  # _extra_state and other non-tensor entries
        rt = rts.get((chunk, key))
        if rt is None:
            raise FormatError(f"{where}: unexpected tensor {key!r} (chunk {chunk}) for the described model")
        if tuple(value.shape) != rt.shape:
            raise FormatError(f"{where}: {key}: expected local shape {list(rt.shape)}, found {list(value.shape)}")
        for part in rt.parts:
            if not part.pad:
                got.add(prefix + rt.param.name, tuple(s.start for s in part.src), value[part.dest])


def _legacy_optimizer(got: Collected, opt: dict[str, Any], rts: dict, where: str) -> None:
    inner = opt.get("optimizer", opt) if isinstance(opt, dict) else None
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        log.warning("%s: optimizer state is not the non-distributed form (distrib_optim.pt?): not imported", where)
        return
    groups = inner["param_groups"]
    members = group_members(sorted(rts.values(), key=lambda rt: rt.chunk), groups, where)
    masters = opt.get("fp32_from_fp16_params") or [[] for _ in groups]
    got.megatron.setdefault("param_groups", [json_group(g) for g in groups])
    if inner["state"]:  # torch AdamW keeps the step in every parameter's state, FusedAdam in its groups
        got.megatron.setdefault("adam", "torch" if any("step" in s for s in inner["state"].values()) else "fused")
    in_groups = {int(g["step"]) for g in groups if isinstance(g.get("step"), (int, float))}
    if len(in_groups) == 1:
        got.optimizer_step = in_groups.pop()  # FusedAdam's; torch's per-parameter step (below) says the same
    for group, held, group_masters in zip(groups, members, masters):
        for position, (idx, rt) in enumerate(zip(group["params"], held)):
            for slot, value in (inner["state"].get(idx) or {}).items():
                if slot == "step":
                    got.optimizer_step = int(value)
                    continue
                _collect(got, {rt.key: value}, rt.chunk, {(rt.chunk, rt.key): rt}, where, f"{OPT}{slot}.")
            if group_masters:
                _collect(got, {rt.key: group_masters[position]}, rt.chunk, {(rt.chunk, rt.key): rt}, where,
                         f"{OPT}fp32_param.")


def _megatron_extra(obj: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"args": args}
    for key in ("opt_param_scheduler", "num_floating_point_operations_so_far"):
        if key in obj:
            out[key] = json.loads(json.dumps(obj[key], default=lambda o: None))
    return out


def _from_dist(it_dir: str, arch: ModelArch | None, trust_pickle: bool) -> Collected:
    with open(os.path.join(it_dir, "metadata.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("sharded_backend") != "torch_dist":
        raise FormatError(f"{it_dir}/metadata.json: expected sharded_backend 'torch_dist', found {meta.get('sharded_backend')!r}")
    common_path = os.path.join(it_dir, "common.pt")
    common = _checkpoint_dict(common_path, trust_pickle) if os.path.isfile(common_path) else {}
    args = _args_dict(common.get("args"))
    stored = read_index(it_dir, trust_pickle)
    emb = stored.get("embedding.word_embeddings.weight")
    rows = emb.shape[0] if emb is not None and emb.shape else None
    a = _stored_rows(_arch_from_args(args, arch, it_dir, rows), rows, it_dir)
    src = ParallelLayout(tp=int(args.get("tensor_model_parallel_size") or 1), pp=int(args.get("pipeline_model_parallel_size") or 1),
                         vpp=int(args.get("virtual_pipeline_model_parallel_size") or 1))
    got = Collected(a, src, megatron=_megatron_extra(common, args))
    groups, step, adam = saved_groups(common.get("optimizer"))
    if groups:
        got.megatron["param_groups"], got.optimizer_step = groups, step
    if adam:
        got.megatron["adam"] = adam
    plan = _dist_plan(a, stored)
    state = load_tensors(it_dir, [stored[k] for k in dict.fromkeys(k for _, _, k in plan) if k in stored])
    for p, name, key in plan:
        _dist_take(got, p, name, state, key, it_dir)
    return got


def _dist_plan(a: ModelArch, stored: dict[str, StoredTensor]) -> list[tuple[Param, str, str]]:
    """(parameter, canonical name, torch_dist key) of each tensor to import: every weight, and every optimizer
    slot the checkpoint holds for it; only these are read (Megatron's other entries may be anything)."""
    plan = []
    for p in model_params(a):
        key = dist_key(p)
        plan.append((p, p.name, key))
        for k in stored:
            if k.startswith(DIST_OPT + ".") and k.endswith("." + key) and k[len(DIST_OPT) + 1:-len(key) - 1].isidentifier():
                slot = k[len(DIST_OPT) + 1:-len(key) - 1]
                if slot == "param" and key in stored and stored[key].dtype == torch.float32:
                    continue  # fp32 training: the master copy is the model tensor itself
                plan.append((p, f"{OPT}{'fp32_param' if slot == 'param' else slot}.{p.name}", k))
    return plan


def _dist_take(got: Collected, p: Param, name: str, state: dict[str, torch.Tensor], key: str, where: str) -> None:
    t = state.get(key)
    if t is None:
        if name == p.name and not (p.name == "output_layer.weight" and got.arch.tied):
            raise FormatError(f"{where}: torch_dist checkpoint lacks {key!r} that the model needs")
        return
    if p.layer is not None:
        if t.shape[0] != got.arch.num_layers:
            raise FormatError(f"{where}: {key}: expected {got.arch.num_layers} stacked layers, found shape {list(t.shape)}")
        t = t[p.layer]
    if p.role == "vocab":
        if t.shape[0] < p.shape[0]:
            raise FormatError(f"{where}: {key}: expected {p.shape[0]} vocabulary rows (as the embedding), found {t.shape[0]}")
        t = t[: p.shape[0]]
    if tuple(t.shape) != p.shape:
        raise FormatError(f"{where}: {key}: expected shape {list(p.shape)}, found {list(t.shape)}")
    got.add(name, (0,) * t.dim(), t)


# ---- safetensors ----------------------------------------------------------------------------
def _from_safetensors(path: str, arch: ModelArch | None) -> Collected:
    from safetensors import safe_open

    try:
        f = safe_open(path, "pt")
    except Exception as e:
        raise FormatError(f"{path}: not a readable safetensors file ({e})") from e
    meta = f.metadata() or {}
    a = arch or arch_from_metadata(meta, f"{path} __metadata__")
    if a is None:
        raise FormatError(f"{path}: no model description in __metadata__; give it with --arch FILE.yaml")
    emb = "embedding.word_embeddings.weight"
    a = _stored_rows(a, f.get_slice(emb).get_shape()[0] if emb in set(f.keys()) else None, path)
    params = {p.name: p for p in model_params(a)}
    got = Collected(a, ParallelLayout())
    if "optimizer_step" in meta and str(meta["optimizer_step"]).isdigit():
        got.optimizer_step = int(meta["optimizer_step"])
    for key in f.keys():
        slot_prefix, base = "", key
        if key.startswith(OPT):
            slot, base = key[len(OPT):].split(".", 1)
            slot_prefix = f"{OPT}{slot}."
        name = _canonical_name(base)
        p = params.get(name)
        if p is None:
            if name == "output_layer.weight" and a.tied:
                continue
            raise FormatError(f"{path}: tensor {key!r} is not part of the described model")
        t = f.get_tensor(key)
        if p.role == "vocab":
            t = t[: p.shape[0]]
        if tuple(t.shape) != p.shape:
            raise FormatError(f"{path}: {key}: expected shape {list(p.shape)}, found {list(t.shape)}")
        got.add(slot_prefix + name, (0,) * t.dim(), t)
    return got


def _canonical_name(key: str) -> str:
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", key)
    return f"decoder.layers.{m.group(1)}.{canonical_suffix(m.group(2))}" if m else key
