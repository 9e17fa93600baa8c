"""Issue 20's LoRA run: a frozen small GPT + rank-8 adapters pushed every step for 50 steps to a `flowcheck serve`
node process, snapshotted to the local tier and promoted to the object tier every step.  Per step, the push and each
tier's new bytes are the adapters + their optimizer state (not the frozen model); every step reads back bit for bit
from both tiers; an exported step is whole without the store."""
from __future__ import annotations

import shutil

import numpy as np
import torch
from click.testing import CliRunner

from flowcheck.cli import main
from flowcheck.demo.lora import lora_gpt as demo_lora_gpt
from flowcheck.demo.model import CHARS, CONTEXT, batches, data
from flowcheck.restore.arch import ModelArch
from flowcheck.store import open_store
from flowcheck.torch.checkpointer import Checkpointer
from flowcheck.torch.state import _flatten_optimizer, optimizer_param_names

STEPS = 50
RANK = 8
# the demo's GPT, wider: the frozen model is ~25x the adapters and their AdamW state
ARCH = ModelArch(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=len(CHARS), ffn_hidden_size=1024,
                 max_position_embeddings=CONTEXT, make_vocab_size_divisible_by=4)


def lora_gpt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return demo_lora_gpt(ARCH, RANK)


def state_copy(model, opt) -> dict[str, np.ndarray]:
    out = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    out.update({k: v.detach().clone().numpy()
                for k, v in _flatten_optimizer(opt.state_dict(), optimizer_param_names(model, opt))[0].items()})
    return out


def own_bytes(manifest) -> int:
    """Bytes a step's commit wrote in its tier: its own files (what it references was written before)."""
    return sum(f.bytes for f in manifest.files)


def test_lora_run_pushes_and_stores_only_the_adapters_each_step_and_every_step_reads_back(node, tmp_path):
    torch.set_num_threads(1)
    model, opt = lora_gpt()
    tokens = data()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    store = open_store(node.config)
    saved, pushed, local_new, object_new = {}, [], [], []
    with Checkpointer(model, opt, node=node.url, run="gpt", transport="tcp", timeout_s=30) as ck:
        for step in range(1, STEPS + 1):
            x, y = batches(tokens)
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            saved[step] = state_copy(model, opt)
            assert ck.save(step)
            assert ck.flush(30), ck.stats.last_error
            pushed.append(ck.stats.last_sent_bytes)
            node.wait_step(step)
            status, body = node.post("/snapshot")
            assert status == 200 and body["step"] == step, body
            local_new.append(own_bytes(store.local.manifest(step)))
            object_new.append(own_bytes(store.promote(step)))
        full = ck.stats.buffer_bytes
        assert ck.stats.resends == 0
    opt_bytes = sum(v.nbytes for k, v in saved[STEPS].items() if k.startswith("optimizer."))
    changed = trainable + opt_bytes  # adapters + their AdamW slots and step counts
    assert full == sum(v.nbytes for v in saved[STEPS].values())
    # the push: the whole state once, then exactly what changes
    assert pushed[0] == full and pushed[1:] == [changed] * (STEPS - 1), pushed
    # each tier: the first step whole, then the changed shards (and their zarr/safetensors metadata)
    for name, new in (("local", local_new), ("object", object_new)):
        assert new[0] >= full, (name, new[0], full)
        assert all(changed <= n <= full / 10 for n in new[1:]), (name, new)
    ratio = {"push": max(pushed[1:]) / full, "local": max(local_new[1:]) / local_new[0],
             "object": max(object_new[1:]) / object_new[0]}
    print(f"LoRA bytes per step / full step: {ratio} (full {full} bytes, changed {changed})")
    assert all(r <= 0.1 for r in ratio.values()), ratio
    node.stop()
    # every step, from both tiers, bit for bit what the trainer held
    fresh = open_store(node.config)
    for tier in (fresh.local, fresh.object):
        for step in range(1, STEPS + 1):
            snap = tier.load(step)
            got = {s.tensor: np.asarray(snap.array(s)) for s in snap.data}
            assert set(got) == set(saved[step]), (tier.name, step)
            for name, want in saved[step].items():
                assert got[name].tobytes() == want.tobytes(), (tier.name, step, name)
    # an exported step is whole on its own: export, delete the store, load the export
    outs = {step: str(tmp_path / f"step{step}.safetensors") for step in (1, 27, STEPS)}
    for step, out in outs.items():
        got = CliRunner().invoke(main, ["export", "--step", str(step), "--out", out, "--config", node.config])
        assert got.exit_code == 0, got.output
    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "object")
    from safetensors.numpy import load_file

    for step, out in outs.items():
        loaded = load_file(out)
        assert set(loaded) == set(saved[step])
        for name, want in saved[step].items():
            assert loaded[name].tobytes() == want.tobytes(), (step, name)
