"""What runs on this machine now, read from /proc (tests that kill processes check what is left)."""
from __future__ import annotations

import os


def processes() -> dict[int, tuple[int, int, list[str], str]]:
    """{pid: (ppid, process group, argv, state)} of every process now."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
        except OSError:
            continue
        out[int(pid)] = (int(fields[1]), int(fields[2]), argv, fields[0])
    return out
