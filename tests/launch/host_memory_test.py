"""glibc's mmap threshold fixed at start: freed large blocks go back to the OS (launch/host_memory.py).

Each case runs in a fresh interpreter, since the threshold is process-wide and one-way. The block
pattern is the one a training step makes: a large block freed (glibc then raises its threshold to
that size), then many 1 MB activation-sized blocks, all freed but the last (so the heap cannot
shrink from its top).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# malloc/free straight from glibc, and the resident size, in the child
LIBC = r"""
import ctypes, json, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
"""
PROGRAM = LIBC + r"""
fix = sys.argv[1] == "fix"
if fix:
    from cadence.launch.host_memory import fix_mmap_threshold
    assert fix_mmap_threshold()
def touch(p, n):
    ctypes.memset(p, 1, n)
big = libc.malloc(8 << 20); touch(big, 8 << 20); libc.free(big)  # glibc: threshold -> 8 MB
blocks = [libc.malloc(1 << 20) for _ in range(300)]
for b in blocks:
    touch(b, 1 << 20)
held = rss_mb()
for b in blocks[:-1]:
    libc.free(b)
print(json.dumps({"held": held, "after_free": rss_mb()}))
"""


def _run(program: str, *args: str) -> dict:
    """The program's last line of output (JSON), run in a fresh interpreter without MALLOC_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", program, *args], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_return_to_the_os_only_with_the_threshold_fixed():
    default, fixed = _run(PROGRAM, "default"), _run(PROGRAM, "fix")
    assert default["held"] > 280 and fixed["held"] > 280  # 300 MB were really written
    # glibc as it comes keeps the freed 299 MB in its heap; fixed, they are unmapped on free
    assert default["after_free"] > default["held"] - 50
    assert fixed["after_free"] < fixed["held"] - 250


def test_an_explicit_environment_setting_wins(monkeypatch):
    from cadence.launch.host_memory import fix_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert fix_mmap_threshold() is False


TRIM_PROGRAM = LIBC + r"""
from cadence.launch.host_memory import HeapTrimmer, fix_mmap_threshold
assert fix_mmap_threshold()  # as a run has it: blocks under 256 KB stay in the heaps
trim = HeapTrimmer(min_growth=64 << 20)  # before the writer: the resident size it grows from
kept, out = [], {}
def writer():  # a checkpoint writer's pattern: 64 KB buffers freed, small ones kept between them
    blocks = []
    for _ in range(3200):
        b = libc.malloc(64 << 10); ctypes.memset(b, 1, 64 << 10); blocks.append(b)
        kept.append(libc.malloc(64))
    out["held"] = rss_mb()
    for b in blocks:
        libc.free(b)
t = threading.Thread(target=writer); t.start(); t.join()
out["after_free"] = rss_mb()
out["released"] = trim()
out["after_release"] = rss_mb()
out["again"] = trim()  # nothing grew since: not even tried
out["trims"] = trim.trims
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_trimmer_returns_what_another_thread_freed_once_it_grew():
    out = _run(TRIM_PROGRAM)
    assert out["held"] > 190  # 200 MB were really written
    assert out["after_free"] > out["held"] - 50  # freed, but still resident in the thread's heap
    assert out["released"] and out["after_release"] < out["held"] - 150
    assert out["again"] is False and out["trims"] == 1
