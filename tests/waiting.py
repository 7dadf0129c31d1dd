"""One way for tests to wait on real processes: poll a condition, fail early if the process died."""
from __future__ import annotations

import subprocess
import time


def wait_for(cond, timeout: float = 300.0, what: str = "", proc: subprocess.Popen | None = None,
             interval: float = 0.2):
    """The first truthy value of cond(), polled every `interval` seconds.

    Raises AssertionError when `proc` exits before cond() holds (with its output, if piped) or when
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited with {proc.returncode} while waiting for {what}"
                                 f"{_output(proc)}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def _output(proc: subprocess.Popen) -> str:
    try:  # children it left may hold the pipes open: do not wait on them for long
        out, err = proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        return ""
    text = "\n".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err) if x)
    return f":\n{text[-3000:]}" if text else ""
