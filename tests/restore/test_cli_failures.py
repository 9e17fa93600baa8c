"""Every failure of export, restore, import, show and audit is one line (expected / found / what to do), exit 2.

A full disk, a read-only or forbidden folder, a DCP writer thread that fails, memory that runs out: injected
where the write happens (the system call or file write fails with the errno a real disk returns), plus a real
full tmpfs where the container allows mounting one.  Forged manifests that keep a valid integrity hash: wrong
scalar types, a 2**40-element tensor over a few KiB of files.  And a restore record with a non-numeric step.
"""
from __future__ import annotations

import builtins
import errno
import io
import json
import os
import subprocess
import threading

import pytest
from click.testing import CliRunner

from flowcheck import _native
from flowcheck.cli import main
from flowcheck.digest import sha256
from flowcheck.errors import TooLargeError
from flowcheck.manifest import canonical_json
from flowcheck.restore.importer import RESTORE_RECORD
from flowcheck.state import ParallelLayout, StateLayout, TensorSpec
from flowcheck.tiers.base import allocate

from .conftest import store_config

FORMATS = [("export", "safetensors"), ("export", "torch"), ("restore", "megatron-dist"), ("restore", "megatron")]
STEP_DIR = "step-000000010"


def _cli(tmp_path, command: str, fmt: str, out) -> list[str]:
    args = [command, "--step", "10", "--format", fmt, "--out", str(out), "--config", store_config(tmp_path)]
    return args + (["--workers", "4"] if command == "restore" else [])


def one_error_line(result, *, code: int = 2) -> str:
    """The single line a failed command prints: 'error: ...', no traceback, nothing else."""
    lines = result.output.splitlines()
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def leftovers(folder) -> list[str]:
    """Names under ``folder`` a failed write could leave: temporaries, staging folders, outputs."""
    return sorted(n for n in os.listdir(folder) if n.startswith(".") or ".tmp-" in n or "out" in n or ".partial" in n)


# ---- a disk that refuses writes -------------------------------------------------------------
class Disk:
    """Writes to files under ``root`` fail with ``err`` once ``room`` bytes went in (ENOSPC: a full disk), or
    creating anything there does (``create=True``: EROFS, EACCES).  Both write paths are covered: fd-level
    (``os.open`` + ``_native.pwrite_all``: the safetensors writer) and Python files (``open``: torch.save, DCP);
    ``threads`` limits the failure to writes from threads other than the main one (a DCP writer thread)."""

    def __init__(self, monkeypatch, root, *, err: int = errno.ENOSPC, room: int = 1024, create: bool = False,
                 threads: bool = False) -> None:
        self.root, self.err, self.room, self.create, self.threads = str(root), err, room, create, threads
        self.lock = threading.Lock()
        self.fds: dict[int, str] = {}
        real_os_open, real_pwrite, real_open, real_mkdir = os.open, _native.pwrite_all, io.open, os.mkdir

        def os_open(path, flags, *a, **kw):
            if self._creating(path, flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                raise OSError(self.err, os.strerror(self.err), os.fsdecode(path))
            fd = real_os_open(path, flags, *a, **kw)
            self.fds[fd] = os.fsdecode(path)
            return fd

        def pwrite_all(fd, buffer, offset=0, flush_every=0):
            self.take(memoryview(buffer).nbytes, self.fds.get(fd, ""))
            return real_pwrite(fd, buffer, offset, flush_every)

        def open_(file, mode="r", *a, **kw):
            path = os.fsdecode(file) if isinstance(file, (str, bytes, os.PathLike)) else ""
            writing = any(c in mode for c in "wax+")
            if self._creating(path, writing):
                raise OSError(self.err, os.strerror(self.err), path)
            f = real_open(file, mode, *a, **kw)
            return _Limited(f, self, path) if writing and path.startswith(self.root) else f

        def mkdir(path, *a, **kw):
            if self._creating(path, True):
                raise OSError(self.err, os.strerror(self.err), os.fsdecode(path))
            return real_mkdir(path, *a, **kw)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(_native, "pwrite_all", pwrite_all)
        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)

    def _creating(self, path, writing) -> bool:
        return bool(self.create and writing and os.path.abspath(os.fsdecode(path)).startswith(self.root))

    def take(self, n: int, path: str) -> None:
        if self.create or not path.startswith(self.root):
            return
        if self.threads and threading.current_thread() is threading.main_thread():
            return
        with self.lock:
            if n > self.room:
                self.room = 0
                raise OSError(self.err, os.strerror(self.err), None)
            self.room -= n


class _Limited:
    """A file object whose writes draw on the Disk's room."""

    def __init__(self, f, disk: Disk, path: str) -> None:
        self._f, self._disk, self._path = f, disk, path

    def write(self, data) -> int:
        self._disk.take(len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes, self._path)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("command,fmt", FORMATS)
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, gqa_store, monkeypatch, command, fmt):
    target = tmp_path / "target"
    target.mkdir()
    Disk(monkeypatch, target, room=64 << 10)
    line = one_error_line(CliRunner().invoke(main, _cli(tmp_path, command, fmt, target / "out")))
    what = "the exported file" if command == "export" else "the restored checkpoint"
    assert f"cannot write {what} {target / 'out'}:" in line
    assert "No space left on device (ENOSPC)" in line and "expected room for about" in line and "free in" in line
    assert "nothing was left half-written" in line and "pass another --out" in line
    assert leftovers(target) == []


@pytest.mark.parametrize("err,name,words", [(errno.EROFS, "EROFS", "on a read-only one"),
                                            (errno.EACCES, "EACCES", "refuses writes")])
@pytest.mark.parametrize("command,fmt", [("export", "safetensors"), ("restore", "megatron")])
def test_a_read_only_or_forbidden_folder_is_one_line(tmp_path, gqa_store, monkeypatch, command, fmt, err, name, words):
    target = tmp_path / "target"
    target.mkdir()
    Disk(monkeypatch, target, err=err, create=True)
    line = one_error_line(CliRunner().invoke(main, _cli(tmp_path, command, fmt, target / "out")))
    assert f"{os.strerror(err)} ({name})" in line and words in line and "nothing was left half-written" in line
    assert leftovers(target) == []


def test_a_failing_dcp_writer_thread_fails_the_restore_instead_of_being_dropped(tmp_path, gqa_store, monkeypatch):
    """torch's DCP ends a writer thread on its exception, prints it, and saves the checkpoint without its
    files; the restore must fail as one line and leave no directory behind."""
    target = tmp_path / "target"
    target.mkdir()
    Disk(monkeypatch, target, room=0, threads=True)  # only the writer threads' files fail
    line = one_error_line(CliRunner().invoke(main, _cli(tmp_path, "restore", "megatron-dist", target / "out")))
    assert "No space left on device (ENOSPC)" in line
    assert leftovers(target) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 256 KiB tmpfs (needs CAP_SYS_ADMIN; skipped otherwise)."""
    path = tmp_path / "small"
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); the injected "
                    "variant covers the same path")
    yield path
    subprocess.run(["umount", str(path)], check=False, capture_output=True)


@pytest.mark.parametrize("command,fmt", FORMATS)
def test_a_real_full_tmpfs_is_one_line_and_leaves_nothing(tmp_path, gqa_store, small_tmpfs, command, fmt):
    line = one_error_line(CliRunner().invoke(main, _cli(tmp_path, command, fmt, small_tmpfs / "out")))
    assert "No space left on device (ENOSPC)" in line and "nothing was left half-written" in line
    assert leftovers(small_tmpfs) == []


# ---- memory that runs out ------------------------------------------------------------------------
def test_an_allocation_no_machine_can_make_is_a_too_large_error():
    # 1 PiB: more than any 47-bit address space, whatever the overcommit policy
    with pytest.raises(TooLargeError, match=r"step 1 tensor w: cannot allocate 1,125,899,906,842,624 bytes"):
        allocate((2**48,), "float32", "step 1 tensor w")


@pytest.mark.parametrize("command,fmt", FORMATS)
def test_memory_running_out_while_reading_is_one_line(tmp_path, gqa_store, monkeypatch, command, fmt):
    from flowcheck.tiers.local import LocalTier

    def no_memory(*a, **kw):
        raise MemoryError("Unable to allocate 4.00 TiB")

    monkeypatch.setattr(LocalTier, "_read_shard", no_memory)  # a shard of per-shard arrays
    monkeypatch.setattr(LocalTier, "_read_packed", no_memory)  # a shard in a pack
    line = one_error_line(CliRunner().invoke(main, _cli(tmp_path, command, fmt, tmp_path / "out")))
    assert "local tier step 10 tensor" in line and "cannot allocate" in line and "machine's memory" in line
    assert leftovers(tmp_path) == []


def test_memory_running_out_while_writing_a_checkpoint_is_one_line(tmp_path, gqa_store, monkeypatch):
    from flowcheck.restore.megatron_dist import DistWriter

    def no_memory(*a, **kw):
        raise MemoryError()

    monkeypatch.setattr(DistWriter, "add", no_memory)
    line = one_error_line(CliRunner().invoke(main, _cli(tmp_path, "restore", "megatron-dist", tmp_path / "out")))
    assert "out of memory" in line and "nothing was left half-written" in line
    assert leftovers(tmp_path) == []


# ---- forged manifests (integral: integrity and layout digest recomputed) ----------------------------
def forge(tmp_path, edit, tier: str = "local") -> None:
    """Edit step 10's manifest in ``tier`` and re-seal it as a careful forger would (layout digest, integrity)."""
    path = tmp_path / tier / "r1" / STEP_DIR / "manifest.json"
    raw = json.loads(path.read_bytes())
    raw.pop("integrity")
    edit(raw)
    specs = tuple(TensorSpec(n, t["dtype"], tuple(t["global_shape"]), t["role"])
                  for n, t in sorted(raw["tensors"].items()))
    raw["layout_digest"] = StateLayout(specs, ParallelLayout(**raw["source_layout"]),
                                       tuple(tuple(b) for b in raw.get("buckets", []))).digest()
    raw["integrity"] = sha256(canonical_json(raw))
    path.write_bytes(canonical_json(raw) + b"\n")


def _scalar(key, value):
    return lambda raw: raw["scalars"].__setitem__(key, value)


def _huge(raw, covered: bool = True):
    t = raw["tensors"]["decoder.final_layernorm.weight"]
    t["global_shape"] = [2**40]
    if covered:
        t["shards"][0]["shape"] = [2**40]


FORGED = {
    "rng-list": (_scalar("rng", ["a", "b"]), "field 'scalars.rng': expected an object of name -> base64 string"),
    "rng-value": (_scalar("rng", {"torch": 5}), "field 'scalars.rng.torch': expected a base64 string, found 5"),
    "optimizer_step": (_scalar("optimizer_step", "x"), "field 'scalars.optimizer_step': expected an integer or null"),
    "lr_scheduler": (_scalar("lr_scheduler", "s"), "field 'scalars.lr_scheduler': expected an object or null"),
    "extra": (_scalar("extra", [1]), "field 'scalars.extra': expected an object, found [1]"),
    # a 2**40-element tensor over the same few KiB of zarr files: the reader refuses it before allocating
    "huge-shape": (_huge, "1099511627776 lie past the pack's"),
    "huge-hole": (lambda raw: _huge(raw, covered=False), "the stored shards cover less than its global shape"),
}


def _failed_once(result, name: str) -> str:
    """A command that failed on a forged manifest: exit 2, its last line the one error line, no traceback; the
    only other lines are the store's warning, while it lists the run, about the same unreadable manifest."""
    lines = result.output.splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.output, (name, result.output)
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], (name, result.output)
    assert all("WARNING" in line and "manifest unreadable" in line for line in lines[:-1]), (name, result.output)
    return errors[0]


@pytest.mark.parametrize("kind", sorted(FORGED))
def test_a_forged_but_integral_manifest_is_one_line_in_every_command(tmp_path, gqa_store, kind):
    edit, words = FORGED[kind]
    forge(tmp_path, edit)
    cfg = ["--config", store_config(tmp_path)]
    huge = kind.startswith("huge")
    runs = {"export": ["export", "--step", "10", "--out", str(tmp_path / "out.safetensors")],
            "export-torch": ["export", "--step", "10", "--format", "torch", "--out", str(tmp_path / "out.pt")],
            "restore": ["restore", "--step", "10", "--out", str(tmp_path / "out")]}
    if not huge:
        runs["show"] = ["show", "--step", "10"]
    for name, args in runs.items():
        line = _failed_once(CliRunner().invoke(main, args + cfg), name)
        # restore checks the step against its model before reading a byte
        want = "expected shape [32], found [1099511627776]" if huge and name == "restore" else words
        assert want in line, (name, line)
        assert leftovers(tmp_path) == [], name
    if kind == "huge-hole":
        return  # audit re-reads every shard, each intact; the hole shows when the tensor is assembled (above)
    audit = CliRunner().invoke(main, ["audit", *cfg])
    assert audit.exit_code == 1 and "Traceback" not in audit.output, audit.output
    assert words in audit.output and "audit FAILED" in audit.output.splitlines()[-1]
    if huge:  # the manifest itself parses (zarr files may be sparse): show lists it, --verify finds the damage
        show = CliRunner().invoke(main, ["show", "--step", "10", "--verify", *cfg])
        assert show.exit_code == 1 and "Traceback" not in show.output and "FAILED" in show.output, show.output


def test_a_forged_shape_in_the_object_tier_is_refused_by_the_parser(tmp_path, gqa_store):
    """safetensors files hold their tensors densely: a manifest claiming more bytes than a file holds is forged."""
    store, _, _ = gqa_store
    store.promote(10)
    forge(tmp_path, _huge, "object")
    result = CliRunner().invoke(main, ["export", "--step", "10", "--from", "object", "--format", "torch",
                                       "--out", str(tmp_path / "out.pt"), "--config", store_config(tmp_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    last = result.output.splitlines()[-1]
    assert last.startswith("error: object tier r1/step-000000010/manifest.json: field 'files[0].bytes': expected at "
                           "least 4,398,0") and "forged" in last, last


# ---- a restore record that is not what restore writes ----------------------------------------------
@pytest.mark.parametrize("field,value,words", [
    ("step", "abc", "field 'step': expected a non-negative integer, found 'abc'"),
    ("step", -1, "field 'step': expected a non-negative integer, found -1"),
    ("manifest_digest", "sha256:zz", "field 'manifest_digest': expected a 'sha256:<64 hex digits>' digest"),
    (None, None, "field '<root>': expected an object {step, manifest_digest}, found [1]"),
])
def test_a_malformed_restore_record_is_one_line_naming_the_file_and_field(tmp_path, gqa_store, field, value, words):
    cfg = store_config(tmp_path)
    out = tmp_path / "ckpt"
    assert CliRunner().invoke(main, ["restore", "--step", "10", "--format", "megatron", "--out", str(out),
                                     "--config", cfg]).exit_code == 0
    record = out / RESTORE_RECORD
    raw = json.loads(record.read_text())
    if field is None:
        raw = [1]
    else:
        raw[field] = value
    record.write_text(json.dumps(raw))
    line = one_error_line(CliRunner().invoke(main, ["import", "--step", "20", str(out), "--config", cfg]))
    assert line == f"error: {record}: {words}" or line.startswith(f"error: {record}: {words}"), line
    store, _, _ = gqa_store
    assert 20 not in store.local.steps()


# ---- the last resort --------------------------------------------------------------------------------
def test_an_unexpected_exception_is_one_line_and_its_traceback_comes_with_v(tmp_path, gqa_store, monkeypatch):
    import flowcheck.restore.source as source

    def bug(*a, **kw):
        raise KeyError("surprise")

    monkeypatch.setattr(source, "open_step", bug)
    args = ["show", "--step", "10", "--config", store_config(tmp_path)]
    line = one_error_line(CliRunner().invoke(main, args))
    assert line.startswith("error: unexpected KeyError: 'surprise'") and "re-run with -v for the traceback" in line
    verbose = CliRunner().invoke(main, ["-v", *args])
    assert verbose.exit_code == 2 and "Traceback" in verbose.output
    assert verbose.output.splitlines()[-1].startswith("error: unexpected KeyError")


def test_a_read_that_fails_with_a_bare_oserror_is_not_taken_for_the_output_failing(tmp_path, gqa_store, monkeypatch):
    from flowcheck.tiers.local import LocalTier

    def eio(*a, **kw):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(LocalTier, "_read_shard", eio)
    monkeypatch.setattr(LocalTier, "_read_packed", eio)
    line = one_error_line(CliRunner().invoke(main, _cli(tmp_path, "export", "safetensors", tmp_path / "out")))
    assert "local tier: cannot read step 10 tensor" in line and "cannot write" not in line
    assert leftovers(tmp_path) == []
