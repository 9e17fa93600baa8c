"""First 1/8-row read of every tensor by a *fresh* tier object (no kept verdict) vs a whole read, cold cache.

    python benchmarks/first_slice_read.py   (0.374 GB state; needs root for drop_caches)
"""
import os, shutil, subprocess, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c
from flowcheck.config import LocalConfig, ObjectConfig
from flowcheck.tiers.local import LocalTier
from flowcheck.tiers.object import ObjectTier
work = tempfile.mkdtemp(prefix="fc-first-")
state = c.build_state(0.3)
run, step = state.snapshot.run, state.snapshot.step
shapes = {n: tuple(t.shape) for n, t in state.tensors.items()}
mk = {"local": lambda: LocalTier(LocalConfig(root=os.path.join(work, "local"), codec="none"), run=run),
      "object file://": lambda: ObjectTier(ObjectConfig(url="file://" + os.path.join(work, "object")), run, staging_dir=os.path.join(work, "st"))}
for f in mk.values():
    f().write(state.snapshot)
del state
def drop():
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True)
for name, f in mk.items():
    res = {"whole": [], "slice": []}
    for _ in range(3):
        for kind in ("whole", "slice"):
            t = f(); m = t.manifest(step); drop(); t0 = time.perf_counter()
            for n, s in shapes.items():
                t.read(step, n, None if kind == "whole" else (slice(0, max(1, s[0] // 8)),), manifest=m)
            res[kind].append(time.perf_counter() - t0)
    w, sl = sorted(res["whole"])[1], sorted(res["slice"])[1]
    print(f"{name}: whole {w:.3f}s, first 1/8-row read by a fresh tier {sl:.3f}s, whole/slice {w/sl:.2f}x")
shutil.rmtree(work, ignore_errors=True)
