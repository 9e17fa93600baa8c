"""Live capture on a veth pair between two network namespaces this test creates (root only):
RoCE frames sent on one end arrive byte-identical, VLAN tag included, and parse as RoCE."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import pytest

from flowcheck.capture.mirror import roce
from flowcheck.capture.mirror.frames import Endpoint, ack_frame, ud_frame, write_frames
from flowcheck.capture.mirror.live import live_frames
from flowcheck.capture.mirror.packet_ring import RingConfig
from flowcheck.capture.mirror.pcap import Frames
from flowcheck.errors import CaptureError

CLONE_NEWNET = 0x40000000


class InNetns(threading.Thread):
    """Runs fn in a thread that entered namespace ns (setns is per thread: the test's other
    threads stay in the host namespace); result() joins and re-raises."""

    def __init__(self, ns: str, fn, *args, **kwargs) -> None:
        super().__init__(daemon=True)
        self.ns, self.call, self.value, self.error = ns, lambda: fn(*args, **kwargs), None, None
        self.start()

    def run(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{self.ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({self.ns})")
            finally:
                os.close(fd)
            self.value = self.call()
        except BaseException as e:  # handed to result()
            self.error = e

    def result(self, timeout: float = 30):
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"thread in {self.ns} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.value


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def veth():
    """Two namespaces joined by a veth pair; both (and with them the pair) removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:8]
    rx, tx = f"fc-rx-{tag}", f"fc-tx-{tag}"
    made = []
    try:
        for ns in (rx, tx):
            ip("netns", "add", ns)
            made.append(ns)
        ip("link", "add", "fcrx0", "netns", rx, "type", "veth", "peer", "name", "fctx0", "netns", tx)
        ip("-n", rx, "link", "set", "fcrx0", "up")
        ip("-n", tx, "link", "set", "fctx0", "up")
        ip("-n", rx, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create namespaces / veth here: {getattr(e, 'stderr', e)}")
    try:
        yield rx, tx
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def sample() -> list[bytes]:
    a = Endpoint("0c:42:a1:9f:58:f8", "fe80::e42:a1ff:fe9f:58f8")
    b = Endpoint("08:c0:eb:8c:28:2c", "fe80::ac0:ebff:fe8c:282c")
    a4, b4 = Endpoint("02:00:00:00:00:01", "10.0.0.1", vlan=7), Endpoint("02:00:00:00:00:02", "10.0.0.2", vlan=7)
    out = write_frames(a, b, sport=4000, dqpn=0x71D, psn=0, va=0x604000000, data=bytes(range(256)) * 12, imm=3072,
                       mtu=1024)
    out += write_frames(a4, b4, sport=4000, dqpn=0x71D, psn=3, va=0x1000, data=b"\x07" * 100, imm=None, mtu=1024)
    return out + [ack_frame(b, a, sport=4000, dqpn=0x836, psn=2), ud_frame(a, b, sport=5000)]


def send(interface: str, frames: list[bytes], go: threading.Event) -> None:
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((interface, 0))
        probe = bytes(12) + b"\x88\xb5" + b"flowcheck probe"  # local experimental EtherType
        deadline = time.monotonic() + 20
        while not go.wait(0.05):  # until the reader has seen a probe: it is listening
            if time.monotonic() > deadline:
                raise TimeoutError("the reader never saw a probe frame")
            s.send(probe)
        for f in frames:
            s.send(f)


def receive(interface: str, want: list[bytes], go: threading.Event, ring=RingConfig()) -> list[bytes]:
    """The frames of `want` as they arrive; the kernel's own IPv6 neighbour discovery is ignored."""
    got = []
    for batch in live_frames(interface, duration_s=20, batch=4, ring=ring):
        for i in range(len(batch)):
            f = batch.frame(i)
            if f[12:14] == b"\x88\xb5":
                go.set()
            elif f in want:
                got.append(f)
        if len(got) >= len(want):
            break
    return got


SAMPLE = sample()


READERS = {"recvmsg": None, "ring": RingConfig(block_size=1 << 16, block_count=4, block_timeout_ms=2),
           "ring-fanout-2": RingConfig(block_size=1 << 16, block_count=4, block_timeout_ms=2, workers=2)}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_live_reader_gets_roce_frames_byte_identical(veth, reader):
    rx, tx = veth
    go = threading.Event()
    reader = InNetns(rx, receive, "fcrx0", SAMPLE, go, READERS[reader])
    sender = InNetns(tx, send, "fctx0", SAMPLE, go)
    sender.result()
    got = reader.result()
    if sorted(got) == sorted(SAMPLE) and got != SAMPLE:  # fanout: one flow per ring, flows interleave at will
        got = sorted(got, key=SAMPLE.index)
    assert got == SAMPLE
    packets = roce.parse(Frames.from_list(got))
    assert packets.status_counts["OK"] == len(SAMPLE)
    assert sorted(set(packets["vlan"])) == [-1, 7]


@pytest.mark.parametrize("reader", sorted(READERS))
def test_quiet_interface_ends_on_duration_and_on_stop(veth, reader):
    rx, _ = veth

    def listen(**kw):
        kw["ring"] = READERS[reader]
        start = time.monotonic()
        batches = list(live_frames("lo", **kw))
        return time.monotonic() - start, batches

    elapsed, batches = InNetns(rx, listen, duration_s=0.3).result()
    assert batches == [] and 0.25 < elapsed < 3
    stop = threading.Event()
    stop.set()
    elapsed, batches = InNetns(rx, listen, stop=stop).result()
    assert batches == [] and elapsed < 1


@pytest.mark.parametrize("reader", sorted(READERS))
def test_interface_down_is_a_capture_error(veth, reader):
    rx, _ = veth
    ip("-n", rx, "link", "set", "lo", "down")
    with pytest.raises(CaptureError, match="Network is down"):
        InNetns(rx, lambda: list(live_frames("lo", duration_s=1, ring=READERS[reader]))).result()


def test_unknown_interface_is_a_capture_error():
    with pytest.raises(CaptureError, match="no network interface named 'fc-no-such-nic'"):
        next(live_frames("fc-no-such-nic"))


@pytest.mark.skipif(os.geteuid() == 0, reason="runs as root: the permission error cannot happen")
def test_capture_without_privileges_is_a_capture_error():
    with pytest.raises(CaptureError, match="root or CAP_NET_RAW"):
        next(live_frames("lo"))


def simulated_frames(tmp_path, iters: int, seed: int):
    """A simulated training (N=4) and its mirrored frames merged in capture order, as the mirror NIC gets them."""
    import numpy as np

    from flowcheck.capture.mirror.decode import read_all
    from flowcheck.simulate import SimOptions, simulate

    sim = simulate(SimOptions(out=str(tmp_path / "sim"), dp=4, iters=iters, seed=seed))
    merged = read_all(sorted(sim.pcaps.values()))
    return sim, [merged.frame(int(i)) for i in np.argsort(merged.ts_ns, kind="stable")]


def send_paced(interface: str, frames: list[bytes]) -> None:
    """Send the frames in order; a veth has no flow control, so the reader gets its turn every 64."""
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((interface, 0))
        for k, f in enumerate(frames):
            s.send(f)
            if k % 64 == 63:
                time.sleep(0.002)


def test_capture_command_decodes_a_live_interface_into_the_trainers_state(veth, tmp_path):
    """`flowcheck capture --interface` in the receiving namespace, a simulated training's mirrored frames sent on
    the veth in capture order, then SIGTERM: the replica reaches the last step bit for bit, no iteration stale."""
    import json
    import sys

    rx, tx = veth
    sim, frames = simulated_frames(tmp_path, iters=4, seed=11)
    cfg = tmp_path / "flowcheck.yaml"
    cfg.write_text("run: live\ntiers: {local: {root: ./local}, object: {url: file://./object}}\n"
                   "policy: {local: {every_steps: 1, keep_last: 10}, object: {every_seconds: 3600}}\n")
    cmd = ["ip", "netns", "exec", rx, sys.executable, "-m", "flowcheck", "capture", "--config", str(cfg),
           "--job", sim.job_path, "--interface", "fcrx0", "--duration", "120", "--settle", "0.2", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "capturing live on fcrx0" not in line:  # the socket is bound: what is sent now is captured
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"capture exited early: {proc.stderr.read()}"

        InNetns(tx, send_paced, "fctx0", frames).result(60)
        time.sleep(1)  # the last frames reach the reader
        proc.send_signal(signal.SIGTERM)  # stops the capture; what it holds is decoded as the end
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["stale"] == [] and report["iterations_applied"] == 4 and report["final_step"] == 4, report
    assert report["kernel_drops"] == 0
    diff = subprocess.run([sys.executable, "-m", "flowcheck", "diff", "--config", str(cfg), "--step", "4", "--against",
                           str(tmp_path / "sim" / "truth" / "step-4.safetensors")], capture_output=True, text=True)
    assert diff.returncode == 0, diff.stdout + diff.stderr


def test_node_captures_its_mirror_interface_live(veth, tmp_path):
    """`flowcheck serve` with serve.mirror_interface (the node started inside the receiving namespace, so its
    capture thread is there too): the steps reach RAM as the frames arrive, none stale, and are snapshotted."""
    from flowcheck import config as config_mod
    from flowcheck.node.service import Node

    rx, tx = veth
    sim, frames = simulated_frames(tmp_path, iters=3, seed=12)
    path = tmp_path / "node.yaml"
    path.write_text("run: live\ntiers: {local: {root: ./local}, object: {url: file://./object}}\n"
                    "policy: {local: {every_steps: 1, keep_last: 10}, object: {every_seconds: 3600}}\n"
                    f"serve: {{push: 127.0.0.1:0, http: 127.0.0.1:0, mirror_job: {sim.job_path}, "
                    "mirror_interface: fcrx0, mirror_settle_s: 0.2}\n")
    node = InNetns(rx, lambda: Node(config_mod.load(str(path))).start()).result()
    try:
        deadline = time.time() + 30
        while node.mirror is None or node.mirror_stats.frames == 0:  # the socket is up once frames are counted
            assert time.time() < deadline, node.mirror
            InNetns(tx, send_one, "fctx0").result()
            time.sleep(0.1)

        InNetns(tx, send_paced, "fctx0", frames).result(60)
        deadline = time.time() + 30
        while node.store.memory.step != 3 and time.time() < deadline:  # settled by the clock, link quiet
            time.sleep(0.1)
        assert node.store.memory.step == 3 and not node.store.memory.stale, (node.mirror, node.mirror_stats, node.mirror_report)
        assert node.mirror["state"] == "running" and node.mirror["interface"] == "fcrx0"
        node.policy.drain()
    finally:
        node.stop()
    assert node.store.local.steps()  # snapshotted by the policy (steps published while one is in flight coalesce)
    assert node.mirror_stats.allreduces_complete == sum(len(sim.job.plan(i)) for i in (1, 2, 3))
    assert node.mirror_stats.elements_lost == 0 and node.mirror_stats.packets["OK"] > 0


def send_one(interface: str) -> None:
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((interface, 0))
        s.send(bytes(12) + b"\x88\xb5" + b"flowcheck probe")


@pytest.mark.parametrize("reader", ["recvmsg", "ring"])
def test_live_reader_reports_the_frames_the_kernel_dropped(veth, monkeypatch, reader):
    """A reader that falls behind a small socket buffer (or ring): the kernel's drops are reported, and with what
    was read they account for every frame sent."""
    from flowcheck.capture.mirror import live

    rx, tx = veth
    monkeypatch.setattr(live, "RCVBUF_BYTES", 4096)
    ring = RingConfig(block_size=4096, block_count=2, block_timeout_ms=2) if reader == "ring" else None
    opened, sent, drops = threading.Event(), threading.Event(), []
    marker = b"\x88\xb6"  # local experimental EtherType 2

    def on_open() -> None:  # bound, but not reading until everything was sent
        opened.set()
        sent.wait(20)

    def receive() -> int:
        got = 0
        for batch in live_frames("fcrx0", duration_s=2, idle=True, on_open=on_open, on_drops=drops.append, ring=ring):
            got += sum(batch.frame(i)[12:14] == marker for i in range(len(batch)))
        return got

    reader = InNetns(rx, receive)
    assert opened.wait(20)
    InNetns(tx, send_paced, "fctx0", [bytes(12) + marker + bytes(1000)] * 500).result(60)
    sent.set()
    got = reader.result()
    assert got < 500 and sum(drops) > 0 and got + sum(drops) >= 500, (got, drops)
