"""Run untrusted Python (a model's program) against tests in a sandboxed subprocess.

Each test runs in its own fresh interpreter (`python -I -S -`: isolated mode, no site, the source
on stdin so no file names it), in an empty temporary directory, with an empty environment, no
stdin, and limits set before exec: CPU seconds, address space, file size, open files, and a new
session so the whole process group is killed on the wall-clock timeout. A test passes when the
process exits 0 and its last output line is a per-run random token printed after the test's
asserts (a program that exits early, or crashes, does not pass).

This bounds the damage (time, memory, disk, stray processes); it is not a security boundary
against a determined attacker (no network or filesystem namespace: run graders of code from
unknown sources in a container or a sandbox service behind task.reward_url).
"""
from __future__ import annotations

import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile


def _limits(cpu_s: int, memory_mb: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_test(program: str, test: str, timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 256) -> bool:
    """True iff `program` followed by `test` (asserts) runs to the end within the limits."""
    token = secrets.token_hex(16)
    source = f"{program}\n\n{test}\nprint({token!r})\n"
    with tempfile.TemporaryDirectory(prefix="cadence-sandbox-") as cwd, \
            tempfile.TemporaryFile() as stdout:  # a file, not a pipe: a leftover child cannot hold us
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-"], cwd=cwd, env={},
                                stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: _limits(cpu_s, memory_mb))
        try:
            proc.stdin.write(source.encode())
            proc.stdin.close()
            proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it left running
            except ProcessLookupError:
                pass
            proc.wait()
        stdout.seek(0, os.SEEK_END)
        stdout.seek(max(stdout.tell() - 4096, 0))
        out = stdout.read()
    lines = out.decode(errors="replace").strip().splitlines()
    return proc.returncode == 0 and bool(lines) and lines[-1] == token


def pass_rate(program: str, tests: list[str], **limits) -> float:
    """Fraction of tests passed (0.0 for no tests)."""
    return sum(run_test(program, t, **limits) for t in tests) / len(tests) if tests else 0.0
