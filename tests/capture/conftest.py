"""A checkpoint node in its own process (`flowcheck serve`), on free loopback ports, for the push suites.

Every test here runs with a node token in its environment (``FLOWCHECK_NODE_TOKEN``), as a deployment
would: the node process inherits it and the trainers' Checkpointers read it, so the push suites exercise
the authorised path; a NodeProcess may be given its own environment to run the node otherwise.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from flowcheck.capture.push.auth import DEFAULT_TOKEN_ENV
from flowcheck.node.client import control_request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def node_token(monkeypatch) -> str:
    """This test's node token, in its environment (nodes it starts inherit it; Checkpointers read it)."""
    token = "test-node-token-" + secrets.token_urlsafe(16)
    monkeypatch.setenv(DEFAULT_TOKEN_ENV, token)
    return token


class NodeProcess:
    """``env``: variables to set in the node's environment on top of this process's (None: remove one);
    ``serve``: more ``serve:`` fields of its config; ``nofile``: its file descriptor limit (``ulimit -n``);
    ``local``: its local root (default ``<root>/local``), ``name``: its config's ``node:``."""

    def __init__(self, root: str, run: str = "gpt", every_steps: int = 1000, part_timeout_s: float = 10.0,
                 env: dict[str, str | None] | None = None, serve: dict | None = None, nofile: int | None = None,
                 local: str | None = None, name: str | None = None) -> None:
        self.root, self.run, self.env, self.nofile = root, run, dict(env or {}), nofile
        self.push_port, self.http_port = free_port(), free_port()
        self.config = os.path.join(root, f"node-{self.push_port}.yaml" if name else "node.yaml")
        extra = "".join(f"  {k}: {v}\n" for k, v in (serve or {}).items())
        with open(self.config, "w") as f:
            f.write(
                (f"node: {name}\n" if name else "") +
                f"run: {run}\ntiers:\n  local:\n    root: {local or root + '/local'}\n  object:\n"
                f"    url: file://{root}/object\n"
                f"policy:\n  local:\n    every_steps: {every_steps}\n  object:\n    every_seconds: null\n"
                f"serve:\n  push: 127.0.0.1:{self.push_port}\n  http: 127.0.0.1:{self.http_port}\n"
                f"  part_timeout_s: {part_timeout_s}\n{extra}"
            )
        self.log_path = os.path.join(root, f"node-{self.push_port}.log" if name else "node.log")
        self.proc: subprocess.Popen | None = None
        self.token: str | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.push_port}"

    def start(self) -> NodeProcess:
        self.log = open(self.log_path, "ab")
        env = {k: v for k, v in {**os.environ, **self.env}.items() if v is not None}
        self.token = env.get(DEFAULT_TOKEN_ENV) or None  # what the node runs with; an authorised client knows it
        self.proc = subprocess.Popen([sys.executable, "-m", "flowcheck", "serve", "--config", self.config],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=self._limits if self.nofile is not None else None)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited {self.proc.returncode}: {self.tail()}")
            try:
                self.get("/status")
                return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"node did not answer in 60 s: {self.tail()}")

    def _limits(self) -> None:
        if self.nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def get(self, path: str) -> dict:
        req = control_request(f"http://127.0.0.1:{self.http_port}{path}", token=self.token)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read().decode()
        return json.loads(body) if body.startswith("{") else {"text": body}

    def post(self, path: str) -> tuple[int, dict]:
        req = control_request(f"http://127.0.0.1:{self.http_port}{path}", "POST", token=self.token)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_step(self, step: int, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.get("/status")
            if s["memory"]["step"] == step:
                return s
            time.sleep(0.05)
        raise AssertionError(f"node never reached step {step}: {self.get('/status')}")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(60)
        self.log.close()
        return code

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)


@pytest.fixture
def node(tmp_path):
    n = NodeProcess(str(tmp_path)).start()
    yield n
    n.stop()
