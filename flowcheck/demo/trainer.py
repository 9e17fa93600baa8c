"""The demo's trainer process (``python -m flowcheck.demo.trainer``): train, push every step, print each loss.

Its tensors already carry megatron-core's canonical names (it is a TP=1/PP=1
GPTModel layout), and every push carries the model description in
``scalars.extra.model``, so ``flowcheck restore --tp 2 --pp 2`` can reshard any
step the node commits.
"""
from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    from flowcheck import config as config_mod
    from flowcheck.simulate.trainer import one_thread

    p = argparse.ArgumentParser(prog="python -m flowcheck.demo.trainer")
    p.add_argument("--config", required=True)
    p.add_argument("--first", type=int, required=True, help="first step to train (ignored with --resume)")
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--resume", action="store_true", help="continue from the newest committed step")
    p.add_argument("--final", help="write the final state here (safetensors) for the demo's checks")
    args = p.parse_args(argv)
    cfg = config_mod.load(args.config)
    with one_thread():
        return _train(cfg, args)


def _train(cfg, args: argparse.Namespace) -> int:
    from flowcheck.capture.push.auth import read_token
    from flowcheck.demo.model import ARCH, megatron_args, setup, train_step
    from flowcheck.torch.checkpointer import Checkpointer

    model, opt, sched, tokens = setup(args.last)
    # the model and the job in Megatron-LM's terms, where restore reads them (scalars.extra.model / .megatron.args,
    # as `flowcheck import` stores them); not arch=: that is for megatron-core trainers, which push TP/PP boxes
    ck = Checkpointer(model, opt, sched, node=f"tcp://{cfg.serve.push}", run=cfg.run, timeout_s=10,
                      extra={"model": ARCH.to_json(), "megatron": {"args": megatron_args(args.last)}},
                      token=read_token(cfg.serve.auth_token_env),
                      parent="auto" if args.resume else None)  # without --resume it trains a fresh model: a new root
    first = args.first
    if args.resume:
        first = ck.load("latest", config=args.config) + 1
        print(f"resumed {first - 1}", flush=True)
    for step in range(first, args.last + 1):
        loss = train_step(model, opt, sched, tokens)
        ck.save(step)
        print(f"step {step} loss {loss!r}", flush=True)
    ck.flush()
    ck.close()
    if args.final:
        _write_final(model, opt, args.final)
    print(json.dumps({"pushed": ck.stats.sent, "failures": ck.stats.failures, "blocked_s": ck.stats.blocked_s}),
          flush=True)
    return 0


def _write_final(model, opt, path: str) -> None:
    """The live state as the trainer holds it (model and optimizer tensors under their stored names)."""
    from safetensors.torch import save_file

    from flowcheck.torch.state import _flatten_optimizer, param_names_of

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state.update(_flatten_optimizer(opt.state_dict(), param_names_of(model))[0])
    save_file(state, path)


if __name__ == "__main__":
    raise SystemExit(main())
