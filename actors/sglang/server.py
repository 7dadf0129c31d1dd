"""A server process Cadence launches and owns: start on a checkpoint, wait until healthy, kill, restart.

    server = ServerProcess(python="/venv/bin/python", module="sgl_jax.launch_server",
                           extra_args=CPU_ARGS, host="127.0.0.1", port=0, log_dir="/run/sglang")
    server.start("/run/sglang/v0")        # returns at once; wait_healthy() blocks until it serves
    server.restart("/run/sglang/v3")      # weight sync for engines without an update endpoint

The process gets its own session (process group), so kill() takes its workers with it, and the
group dies with the process that launched it (die_with_parent): a `kill -9` of an actor process
leaves no server or worker holding its port and memory.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

# What runs sglang-jax 0.1.0rc0 on a CPU (see BUILD.md): its native attention, fp32, small paddings.
# --skip-tokenizer-init: Cadence sends and reads token ids only, and with a tokenizer sglang-jax's
# output_ids come from its incremental detokenizer, which drops ids (measured: 46 of 49).
# --disable-overlap-schedule: with the overlap scheduler, groups of identical prompts sent at once
# came back with wrong logprobs at scattered positions (measured: 223 of 288 rows had some logprob
# 0.02-0.5 off Cadence's model on the same tokens; without it 0 of 288).
# --skip-server-warmup: the server's own warm-up generation (no logprobs) is still decoding when
# /health_generate first answers; Cadence's requests (output logprobs only) then share its batch,
# and sglang-jax's scheduler dies on the mix (UnboundLocalError 'next_token_logprobs'; seen with a
# 170M model, where the warm-up is slower). Cadence's own health wait already runs a generation.
CPU_ARGS = ("--device", "cpu", "--attention-backend", "native", "--dtype", "float32",
            "--grammar-backend", "none", "--max-total-tokens", "4096", "--max-running-requests", "16",
            "--precompile-token-paddings", "64", "128", "--precompile-bs-paddings", "1", "4", "8", "16",
            "--skip-tokenizer-init", "--disable-overlap-schedule", "--skip-server-warmup")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# A watcher in the server's python, leader of the server's process group: it starts the server as
# its child and exits with its status. When the thread that launched it dies (even by SIGKILL) the
# kernel sends it SIGTERM (PR_SET_PDEATHSIG, 1), and on SIGTERM it SIGKILLs its whole group: the
# server and every worker it started, also those still starting (sglang's workers arm their own
# parent-death signal only once their imports are done, and its resource tracker ignores SIGTERM).
# A launcher already gone before prctl ran is caught by the getppid() check; the server dies with
# the watcher too (the watcher is single-threaded, so its preexec_fn is safe).
_WATCHER = """import ctypes, os, signal, subprocess, sys
prctl = ctypes.CDLL(None, use_errno=True).prctl
def end(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
prctl(1, signal.SIGTERM, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    end()
server = subprocess.Popen(sys.argv[2:], preexec_fn=lambda: prctl(1, signal.SIGKILL, 0, 0, 0))
code = server.wait()
os._exit(code if code >= 0 else 128 - code)
"""


def die_with_parent(command: list[str]) -> list[str]:
    """command, run under a watcher that kills its process group when the THREAD that starts it dies
    (Linux's parent-death signal belongs to the forking thread: SGLangEngine starts servers on its
    event loop's executor threads, which live until close()). Elsewhere than Linux: the command as it is."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [command[0], "-c", _WATCHER, str(os.getpid()), *command]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time (the message ends with its log tail)."""


class ServerProcess:
    """One launched server. Not thread-safe: the engine's supervisor is its only caller."""

    def __init__(self, python: str, module: str, extra_args: tuple[str, ...] = (), host: str = "127.0.0.1",
                 port: int = 0, log_dir: str = ".", env: tuple[str, ...] = ("JAX_PLATFORMS=cpu",)):
        self.python, self.module, self.extra_args = python, module, tuple(extra_args)
        self.host = host
        self.port = port or free_port(host)
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        self.env = dict(e.split("=", 1) for e in env)
        self.model_dir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, model_dir: str) -> list[str]:
        return [self.python, "-m", self.module, "--model-path", model_dir, "--host", self.host,
                "--port", str(self.port), *self.extra_args]

    def start(self, model_dir: str) -> None:
        """Launches the server on model_dir (returns at once)."""
        if self.alive():
            raise RuntimeError(f"{self.url}: already running (pid {self.proc.pid})")
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self.model_dir = model_dir
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {self.starts}: {' '.join(self.command(model_dir))}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(die_with_parent(self.command(model_dir)), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                     start_new_session=True)
        log.close()
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float) -> None:
        """Blocks until /health_generate answers 200; raises ServerStartError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerStartError(f"{self.url}: server exited with code "
                                       f"{self.proc.returncode if self.proc else None}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerStartError(f"{self.url}: not healthy after {timeout_s:.0f} s\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends sig to the server's whole process group and reaps it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        # Workers left in the group (some ignore SIGTERM, e.g. multiprocessing's resource tracker) go too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit."""
        self.kill(signal.SIGTERM)

    def restart(self, model_dir: str | None = None) -> None:
        """Kills the process and starts it again (on model_dir, or the same checkpoint); returns at once."""
        self.kill()
        self.proc = None
        self.start(model_dir or self.model_dir)

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return "(no log)"
