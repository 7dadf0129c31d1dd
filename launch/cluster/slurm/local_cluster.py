"""A one-node SLURM cluster on this machine (munged, slurmctld, slurmd), for tests.

Debian's packages (`apt-get install slurm-wlm munge`, SLURM 22.05) with everything in a temp dir:
a generated MUNGE key, a one-node slurm.conf (this host, its CPUs, one partition), state, spool
and logs. The daemons listen on all interfaces: call `enter_private_network()`
(launch/cluster/private_network.py) first, as root. SLURM 22.05 resolves addresses with
AI_ADDRCONFIG and AF_INET, which glibc answers with nothing when loopback is the only interface;
`CommunicationParameters=EnableIPv6` makes it ask for AF_UNSPEC, which finds 127.0.0.1.

    enter_private_network()
    with LocalSlurm() as slurm:
        slurm.env                   # SLURM_CONF=...: pass to sbatch, squeue, `cadence launch slurm`
        subprocess.run(["sinfo"], env=slurm.env)
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd")


def available() -> str:
    """'' when SLURM's daemons and clients are installed here, else what is missing."""
    missing = [n for n in (*DAEMONS, "mungekey", "sbatch", "srun", "squeue", "scancel", "scontrol")
               if not shutil.which(n, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    return ", ".join(missing)


def _which(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    def __init__(self, cpus: int | None = None, timeout: float = 60.0):
        self.cpus = cpus or os.cpu_count() or 1
        self.timeout = timeout
        self.host = socket.gethostname()
        self.dir = tempfile.mkdtemp(prefix="cadence-slurm-")
        os.chmod(self.dir, 0o711)  # munged wants its socket's directories searchable
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.procs: dict[str, subprocess.Popen] = {}

    def _write_conf(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.chmod(os.path.join(d, "munge"), 0o711)
        lines = [
            "ClusterName=cadence",
            "CommunicationParameters=EnableIPv6",  # AF_UNSPEC lookups: see the module docstring
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d}/munge/munge.socket",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
            "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "KillWait=60",  # a step asked to end gets this long between SIGTERM and SIGKILL
            "MinJobAge=3600",  # scontrol remembers a finished job this long (no accounting database)
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=main Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _daemon(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, "log", f"{name}.out"), "ab")
        proc = subprocess.Popen([_which(name), *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start(self) -> "LocalSlurm":
        self._write_conf()
        d = self.dir
        key = os.path.join(d, "munge", "munge.key")
        subprocess.run([_which("mungekey"), "-c", "-k", key], check=True, capture_output=True)
        self._daemon("munged", ["-F", "-f", f"--key-file={key}", f"--socket={d}/munge/munge.socket",
                                f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/log/munged.log",
                                f"--seed-file={d}/munge/seed"])
        self._wait(lambda: os.path.exists(f"{d}/munge/munge.socket"), "munged's socket")
        self._daemon("slurmctld", ["-D", "-f", self.conf])
        self._daemon("slurmd", ["-D", "-f", self.conf])
        self._wait(self._node_idle, "the node to be idle")
        return self

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True).stdout
        return out.strip() == "idle"

    def _wait(self, cond, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if cond():
                return
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited with {self.procs[dead[0]].returncode}:\n{self.logs()}")
            time.sleep(0.5)
        raise TimeoutError(f"local SLURM: no {what} within {self.timeout:.0f} s:\n{self.logs()}")

    def logs(self) -> str:
        d = os.path.join(self.dir, "log")
        out = []
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            with open(os.path.join(d, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-1500:]}")
        return "\n".join(out)

    def stop(self) -> None:
        """Every job cancelled, then the daemons (SIGTERM, SIGKILL after 10 s), the temp dir removed."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h"], env=self.env, capture_output=True, text=True).stdout.strip():
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
