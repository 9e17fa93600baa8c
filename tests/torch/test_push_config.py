"""PushConfig (flowcheck/torch/push_config.py): a Checkpointer's settings in one frozen value, checked on construction;
every keyword users' scripts pass to Checkpointer keeps working."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flowcheck.errors import ConfigError
from flowcheck.torch import Checkpointer, PushConfig

NODE = "tcp://127.0.0.1:7377"


@pytest.mark.parametrize("field,value,says", [
    ("node", "127.0.0.1:7377", "node: expected tcp://HOST:PORT"),
    ("node", "tcp://127.0.0.1", "node: expected tcp://HOST:PORT"),
    ("node", "tcp://127.0.0.1:port", "node: expected tcp://HOST:PORT"),
    ("run", "a/b", "run: run name 'a/b' is not allowed"),
    ("on_busy", "drop", "on_busy: expected 'wait' or 'coalesce', found 'drop'"),
    ("transport", "udp", "transport: expected 'auto', 'tcp' or 'shm', found 'udp'"),
    ("timeout_s", 0, "timeout_s: expected a positive number, found 0"),
    ("timeout_s", float("nan"), "timeout_s: expected a positive number"),
    ("budget_mib", -1, "budget_mib: expected a positive number or None (no cap), found -1"),
    ("hook", "yes", "hook: expected True or False, found 'yes'"),
    ("token", 123, "token: expected a string"),
])
def test_a_bad_field_is_a_config_error_naming_it_and_what_is_expected(field, value, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        PushConfig(**{"node": NODE, "run": "gpt", field: value})


def test_the_config_is_frozen_and_never_shows_the_token():
    cfg = PushConfig(node=NODE, run="gpt", token="s3cr3t-token-value")
    assert "s3cr3t" not in repr(cfg) and "s3cr3t" not in str(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = "other"
    assert cfg.address == ("127.0.0.1", 7377) and cfg.shm and not PushConfig(node=NODE, run="r", transport="tcp").shm


def test_every_existing_keyword_still_works_and_config_is_taken_as_given_or_overridden():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    old = Checkpointer(model, opt, None, node=NODE, run="gpt", extra={"a": 1}, budget_mib=64, on_busy="coalesce",
                       timeout_s=5, transport="tcp", hook=False, rng=False, token="t" * 20)
    assert old.config == PushConfig(NODE, "gpt", 64, "coalesce", 5, "tcp", False, False, "t" * 20)
    assert (old.run, old.on_busy, old.timeout_s, old.shm, old.budget, old.rng) == ("gpt", "coalesce", 5, False, 64 << 20,
                                                                                  False)
    cfg = PushConfig(node=NODE, run="gpt", on_busy="coalesce", hook=False)
    assert Checkpointer(model, opt, config=cfg).config is cfg
    assert Checkpointer(model, opt, config=cfg, run="other").config == dataclasses.replace(cfg, run="other")
    with pytest.raises(ConfigError, match="expected node= and run="):
        Checkpointer(model, opt, run="gpt")
    with pytest.raises(ConfigError, match="config: expected a flowcheck.torch.PushConfig"):
        Checkpointer(model, opt, config={"node": NODE, "run": "gpt"})


def test_an_unknown_keyword_is_refused_naming_what_checkpointer_takes():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"unexpected keyword budget_mb: expected config=.*budget_mib"):
        Checkpointer(model, node=NODE, run="gpt", budget_mb=64)
    every = Checkpointer(model, node=NODE, run="gpt", segments=3, skip_frozen=False, gpu_staging=0, hook=False)
    assert (every.config.segments, every.config.skip_frozen, every.config.gpu_staging) == (3, False, 0)
