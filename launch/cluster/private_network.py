"""A private network namespace for tests and benchmarks of cluster launchers: only loopback.

Ray and SLURM's daemons listen on all interfaces; a test may only talk to loopback. Called once,
`enter_private_network()` moves this process (and every process it starts afterwards) into a new
network namespace holding only `lo` (root or CAP_SYS_ADMIN needed).

    enter_private_network()
    listening_sockets()          # `ss -tlnp` lines of this namespace: what listens, where
"""
from __future__ import annotations

import ctypes
import os
import subprocess

CLONE_NEWNET = 0x40000000


def enter_private_network() -> None:
    """This process's network namespace becomes a new one with only loopback (idempotent)."""
    if os.environ.get("CADENCE_PRIVATE_NETNS") == str(os.getpid()):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise PermissionError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} (cluster tests need root: they "
                              "run Ray or SLURM inside a private network namespace so it listens on loopback only)")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ["CADENCE_PRIVATE_NETNS"] = str(os.getpid())


def listening_sockets() -> list[str]:
    """`ss -tlnp` of the current namespace: what listens, on which address (for checks)."""
    return subprocess.run(["ss", "-tlnp"], capture_output=True, text=True).stdout.splitlines()[1:]
