"""Megatron ranks (TP/PP layouts) push their frozen parameters' boxes once: later pushes carry them as "kept" while the
node's RAM state holds them, and the frozen parameters' optimizer state (there is none) is neither declared nor sent.
A restarted node asks for them again; a frozen parameter changed in place or named to ``mark_changed`` is sent again;
what the node stores is bit for bit the trainer's state, and restores at another layout.  The trainer ranks are
Checkpointers in this process (TP=2) or real processes with a gloo group (PP=2: the stages gather which parameters
are frozen); the node is a real ``flowcheck serve`` process."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from flowcheck.demo.ranks import leave_group
from flowcheck.restore.arch import ModelArch
from flowcheck.restore.importer import import_into
from flowcheck.restore.megatron_common import Target, cut
from flowcheck.restore.megatron_map import model_params, rank_tensors
from flowcheck.restore.service import restore
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer, Coordinates

from ..restore.conftest import make_store
from .conftest import NodeProcess, free_port

# tied embeddings (at PP=2 the last stage holds a copy it does not send), a vocabulary padded at TP=2, gated fc1
ARCH = ModelArch(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=2, vocab_size=300,
                 ffn_hidden_size=64, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                 untie_embeddings_and_output_weights=False, add_bias_linear=False, max_position_embeddings=16)
FROZEN = ("embedding.", "decoder.layers.0.")  # canonical names frozen: the embedding and the first layer
SLOTS = ("exp_avg", "exp_avg_sq")


def trained(tp: int) -> ModelArch:
    """The model as a TP=``tp`` trainer holds it: every padding row of the vocabulary is trained state."""
    return replace(ARCH, padded_vocab_size=ARCH.padded_vocab(tp))


class RankModule(torch.nn.Module):
    """One Megatron rank's model chunk: its local (TP-cut, padded) tensors as parameters under their local keys."""

    def __init__(self, local: dict[str, torch.Tensor], frozen: set[str]) -> None:
        super().__init__()
        for key, t in local.items():
            *path, leaf = key.split(".")
            mod = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]
            mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=key not in frozen))


class Rank:
    """A trainer rank: its model chunk, AdamW over its trainable parameters, and the grads it trains with (cut from
    one canonical gradient per step, so TP replicas stay equal as an all-reduce would keep them)."""

    def __init__(self, canonical: dict[str, torch.Tensor], tp: int, pp: int, t: int, p: int) -> None:
        self.tp, self.pp, self.t, self.p = tp, pp, t, p
        self.rts = {rt.key: rt for rt in rank_tensors(trained(tp), tp, pp, 1, t, p)}
        local = {k: cut(canonical[rt.param.name], rt) for k, rt in self.rts.items()}
        self.model = RankModule(local, {k for k, rt in self.rts.items() if rt.param.name.startswith(FROZEN)})
        self.params = dict(self.model.named_parameters())
        self.opt = torch.optim.AdamW([q for q in self.params.values() if q.requires_grad], lr=1e-2)
        self.coords = Coordinates(tp_rank=t, tp=tp, pp_rank=p, pp=pp)

    def train(self, step: int) -> None:
        for key, q in self.params.items():
            if q.requires_grad:
                rt = self.rts[key]
                g = torch.Generator().manual_seed(step * 7919 + sum(map(ord, rt.param.name)))
                q.grad = cut(torch.randn(rt.param.shape, generator=g), rt)
        self.opt.step()
        self.opt.zero_grad()

    def frozen_bytes(self) -> int:
        """What this rank sends of the frozen parameters: its boxes of them (TP replicas by TP rank 0; never the tied
        output layer's copy)."""
        total = 0
        for key, rt in self.rts.items():
            if not rt.param.name.startswith(FROZEN) or (key == "output_layer.weight" and ARCH.tied):
                continue
            if rt.param.role == "replicated" and self.t != 0:
                continue
            total += sum(self.params[key][p.dest].numel() * 4 for p in rt.parts if not p.pad)
        return total

    def fill(self, out: dict[str, np.ndarray]) -> None:
        """Write this rank's boxes of the weights and AdamW moments into the canonical tensors ``out``."""
        for key, rt in self.rts.items():
            q = self.params[key]
            tensors = {rt.param.name: q.detach()}
            tensors.update({f"optimizer.{s}.{rt.param.name}": v for s, v in self.opt.state.get(q, {}).items()
                            if s in SLOTS})
            for name, t in tensors.items():
                arr = out.setdefault(name, np.zeros(rt.param.shape, np.float32))
                for p in rt.parts:
                    if not p.pad:
                        arr[p.src] = t[p.dest].numpy()


def _stored(node: NodeProcess, step: int) -> dict[str, np.ndarray]:
    node.wait_step(step)
    status, body = node.post("/snapshot")
    assert status == 200 and body["step"] == step, body
    store = open_store(node.config)
    m = store.local.manifest(step)
    return {n: store.read(step, n) for n in m.tensors}


def _expected(ranks: list[Rank]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for r in ranks:
        r.fill(out)
    return out


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, arr in want.items():
        assert np.array_equal(got[name], arr), name


def _push(ranks: list[Rank], ckpts: list[Checkpointer], step: int) -> list[int]:
    for r in ranks:
        r.train(step)
    for ck in ckpts:
        ck.save(step)
    for ck in ckpts:
        assert ck.flush(20), ck.stats.last_error
    return [ck.stats.last_sent_bytes for ck in ckpts]


def _canonical(tp: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {p.name: torch.randn(p.shape, generator=g) for p in model_params(trained(tp))}


def test_tp_ranks_keep_frozen_boxes_resend_to_a_restarted_node_and_restore_bit_exact(tmp_path):
    node = NodeProcess(str(tmp_path)).start()
    try:
        ranks = [Rank(_canonical(2), 2, 1, t, 0) for t in range(2)]
        ckpts = [Checkpointer(r.model, r.opt, node=node.url, run="gpt", arch=ARCH, coords=r.coords, transport="tcp",
                              timeout_s=10) for r in ranks]
        frozen = [r.frozen_bytes() for r in ranks]
        assert all(frozen)
        first = _push(ranks, ckpts, 1)
        full = [ck.stats.buffer_bytes for ck in ckpts]
        assert first == full
        kept = [f - z for f, z in zip(full, frozen)]
        assert _push(ranks, ckpts, 2) == kept
        node.wait_step(2)
        _assert_equal(_stored(node, 2), _expected(ranks))
        assert not any(n.startswith("optimizer.") and n.split(".", 2)[2].startswith(FROZEN)
                       for n in open_store(node.config).local.manifest(2).tensors)  # no state declared for them

        node.kill()
        node.start()  # same ports, empty RAM: it must not take "kept" boxes it never received
        assert _push(ranks, ckpts, 3) == full
        assert [ck.stats.resends for ck in ckpts] == [1, 1]
        assert _push(ranks, ckpts, 4) == kept  # the new node state holds them now
        _assert_equal(_stored(node, 4), _expected(ranks))

        # a frozen parameter changed in place is sent again, once; a .data write once named to mark_changed
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        w = ranks[0].params[qkv]
        box = w.numel() * 4  # TP-split (not replicated): rank 0 sends all of its local piece
        with torch.no_grad():
            w.mul_(0.5)
        assert _push(ranks, ckpts, 5) == [kept[0] + box, kept[1]]
        assert _push(ranks, ckpts, 6) == kept
        ranks[1].params[qkv].data[0, 0] = 7.0
        ckpts[1].mark_changed(qkv)
        assert _push(ranks, ckpts, 7) == [kept[0], kept[1] + box]
        _assert_equal(_stored(node, 7), _expected(ranks))
        for ck in ckpts:
            ck.close()
    finally:
        node.stop()
    # the stored step restores at another layout, frozen and trained tensors alike (TP1 pads to 384 rows, not 512)
    store = open_store(node.config)
    out = restore(store, 7, Target(1, 1, 1, "megatron"), str(tmp_path / "tp1")).out
    back = make_store(tmp_path, "back")
    import_into(back, out, 7)
    for name, arr in _expected(ranks).items():
        if not name.startswith("optimizer."):
            rows = ARCH.padded_vocab(1) if arr.shape[0] == ARCH.padded_vocab(2) else None
            assert np.array_equal(back.read(7, name), arr[:rows]), name


def _pp_rank(rank: int, world: int, port: int, node_url: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    r = Rank(_canonical(1), 1, 2, 0, rank)
    ck = Checkpointer(r.model, r.opt, node=node_url, run="gpt", arch=ARCH, coords=r.coords, transport="tcp",
                      timeout_s=30)  # gathers which parameters every stage has frozen: a collective
    sent = []
    for step in range(1, 4):
        r.train(step)
        ck.save(step)
        assert ck.flush(30), ck.stats.last_error
        sent.append(ck.stats.last_sent_bytes)
        torch.distributed.barrier()  # the stages push the same step together, as Megatron's would
    expected: dict[str, np.ndarray] = {}
    r.fill(expected)
    torch.save({"sent": sent, "full": ck.stats.buffer_bytes, "frozen": r.frozen_bytes(),
                "state": {k: torch.from_numpy(v) for k, v in expected.items()}}, f"{out}/rank{rank}.pt")
    ck.close()
    leave_group()


def test_pipeline_stages_agree_on_which_parameters_have_no_optimizer_state(tmp_path):
    """At PP=2 the embedding and layer 0 (frozen) live on stage 0 only: stage 1 learns they are frozen from the
    gather, so both stages declare the same layout (no optimizer state for them) and the node takes the step."""
    import torch.multiprocessing as mp

    node = NodeProcess(str(tmp_path)).start()
    try:
        mp.start_processes(_pp_rank, args=(2, free_port(), node.url, str(tmp_path)), nprocs=2, join=True,
                           start_method="spawn")
        ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
        assert ranks[0]["frozen"] > 0
        for r in ranks:
            assert r["sent"] == [r["full"]] + [r["full"] - r["frozen"]] * 2, r["sent"]
        want: dict[str, np.ndarray] = {}
        for r in ranks:  # stage 1's tied output-layer copy is a box of the (frozen) embedding: stage 0's is sent
            for k, v in r["state"].items():
                want.setdefault(k, v.numpy())
        _assert_equal(_stored(node, 3), want)
    finally:
        node.stop()
