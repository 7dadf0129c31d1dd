"""The SLURM commands a launch uses, each one call: submit, a job's state, a step's signal.

    job_id = submit(script_path, ["--partition=gpu"], env)     # sbatch --parsable
    job_state(job_id, env)        # {"JobState": "RUNNING", "ExitCode": "0:0", "Reason": "None", ...}
    steps(job_id, env)            # {"actor-0": {"step": "12.3", "nodes": "node7"}, ...} (srun --job-name)
    signal_step("12.3", "TERM", env)                           # scancel --signal: no kill after it

No accounting database is assumed: a job's state comes from `scontrol show job` (kept for
MinJobAge after the job ends), not sacct.
"""
from __future__ import annotations

import subprocess

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT"}


class SlurmError(RuntimeError):
    pass


def _run(argv: list[str], env: dict | None, timeout: float = 60.0) -> str:
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} not found: SLURM's client commands are not installed here") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)}: no answer within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def submit(script: str, sbatch_args: list[str], env: dict | None = None) -> str:
    out = _run(["sbatch", "--parsable", *sbatch_args, script], env)
    return out.strip().split(";")[0]  # "ID" or "ID;CLUSTER"


def job_state(job_id: str, env: dict | None = None) -> dict:
    """`scontrol show job -o ID` as a dict ({} once SLURM forgot the job)."""
    try:
        out = _run(["scontrol", "show", "job", "-o", job_id], env)
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return {}
        raise
    fields = {}
    for token in out.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def steps(job_id: str, env: dict | None = None) -> dict[str, dict]:
    """The job's running steps by name (srun --job-name): step id and nodes."""
    out = _run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j|%N"], env)
    found = {}
    for line in out.splitlines():
        step, name, nodes = (line.split("|") + ["", ""])[:3]
        found[name] = {"step": step, "nodes": nodes}
    return found


def signal_step(step: str, signal_name: str, env: dict | None = None) -> None:
    """Send a signal to every task of a step (or a whole job's steps, given a job id)."""
    _run(["scancel", f"--signal={signal_name}", step], env)


def cancel(job_id: str, env: dict | None = None) -> None:
    _run(["scancel", job_id], env)


def node_address(node: str, env: dict | None = None) -> str:
    """The address SLURM reaches `node` at (NodeAddr): where this node's learner listens."""
    out = _run(["scontrol", "show", "node", "-o", node], env)
    for token in out.split():
        if token.startswith("NodeAddr="):
            return token.split("=", 1)[1]
    raise SlurmError(f"scontrol show node {node}: no NodeAddr")
