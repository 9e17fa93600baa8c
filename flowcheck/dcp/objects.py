"""DCP's non-tensor items: stored as the raw bytes DCP gives, never unpickled by flowcheck unless the user trusts them.

Where unpickling happens, exactly:

* **Save.** DCP's planner pickles each non-tensor value itself (``DefaultSavePlanner.transform_object``:
  ``torch.save(value, BytesIO)``); ``Writer`` stores those bytes unchanged as a uint8 tensor (digest in the
  manifest, like every tensor).  Nothing is loaded.
* **Load.** ``Reader.read_data`` gives DCP's planner a ``BytesIO`` and the planner unpickles it
  (``DefaultLoadPlanner.load_bytes``: ``torch.load(value, weights_only=False)`` — DCP's own behaviour, in the
  training process).  So that no stored pickle reaches that call, ``for_planner`` first loads the stored bytes with
  torch's ``weights_only`` loader (restore/unpickle.py: tensors, containers, numbers, strings — no code runs) and
  hands the planner a pickle flowcheck wrote (``torch.save``) of the object that loader accepted.  A refused
  global is a FormatError naming the item and the global; ``trust_pickle=True`` hands the stored bytes over as
  they are (then DCP's planner runs whatever they name), ``safe_globals=[...]`` allows more classes by name.
* ``flowcheck import`` of a DCP directory stores bytes items only with ``--trust-pickle`` and never loads them.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from flowcheck.restore.unpickle import load_pt

HINT = ("if you trust this checkpoint, pass trust_pickle=True to flowcheck.dcp.Reader (or safe_globals=[the class] "
        "to allow one class)")


def for_planner(raw: bytes, key: str, where: str, *, trust_pickle: bool = False,
                safe_globals: Sequence[Any] = ()) -> io.BytesIO:
    """The ``BytesIO`` DCP's planner unpickles for bytes item ``key``: re-pickled from what the allow-listed loader
    read out of ``raw`` (or ``raw`` itself when the user trusts the checkpoint)."""
    if trust_pickle:
        return io.BytesIO(raw)
    with torch.serialization.safe_globals(list(safe_globals)):
        value = load_pt(raw, f"{where}: DCP item {key!r}", hint=HINT)
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def saved(value: Any) -> bytes:
    """The bytes DCP's planner would have stored for ``value`` (a push step's rebuilt param group fields)."""
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()
