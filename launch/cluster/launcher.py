"""What a launcher does, defined once: `cadence launch KIND` places a Cadence run on a cluster.

A launcher places the learner's `learner.processes` processes (one jax.distributed group; process
0 runs the dispatcher) and the `actors.processes` actor processes (`cadence actor --connect`),
restarts what dies (an actor process at once; the learner group from its newest checkpoint, at
most launch.max_restarts times), reports status and stops cleanly. It only places processes:
every byte of training data goes over Cadence's own ZeroMQ path.

    from cadence.launch.cluster import launcher

    Ray = launcher.get("ray")                     # the class, imported on first use
    code = Ray(cfg, run_dir, address="10.0.0.1:6379").run()   # blocks until the run ends
    Ray.status(run_dir)   # {"state": "running", "learner": {...}, "actors": {...}, "step": 40, ...}
    Ray.stop(run_dir)     # from any machine that sees run_dir: final checkpoint, actors leave

A new launcher is one module with one subclass, registered by name:

    class Kubernetes(launcher.Launcher):
        kind = "k8s"
        help = "the run as Kubernetes pods"

        @classmethod
        def add_arguments(cls, parser):           # its own flags of `cadence launch k8s`
            parser.add_argument("--namespace", default="default")

        def __init__(self, cfg, run_dir, namespace="default", message=None): ...

        def run(self) -> int: ...                 # write status.json, poll the stop file

    launcher.register("k8s", "my_pkg.k8s:Kubernetes")   # or the class itself

The contract every launcher keeps (tests/launch/launcher_contract_test.py runs one body over
each): `run()` returns `cadence train`'s exit status (0 finished or stopped with a final
checkpoint, 1 failed, 2 bad config, 3 already finished) and prints the run's summary.json, with a
"launch" entry, as its last stdout line; while it runs it rewrites RUN_DIR/launch/status.json
(launch_state.py) with at least `state` (starting, running, stopping, stopped, finished, failed),
`learner` {processes, target, restarts, hosts} and `actors` {processes, endpoint, restarts, hosts:
[{name, state, restarts, ...}]}; it stops cleanly when RUN_DIR/launch/stop appears (`stop()`), on
SIGTERM or SIGINT; each process's output lands in RUN_DIR/logs/NAME.log (learner-0, actor-0, ...).
"""
from __future__ import annotations

import abc
import argparse
import importlib
from typing import Callable, ClassVar

from cadence.launch.cluster import launch_state


class LauncherUnavailable(RuntimeError):
    """The cluster software this launcher drives is not installed or not reachable here."""


class Launcher(abc.ABC):
    kind: ClassVar[str]  # `cadence launch KIND`
    help: ClassVar[str] = ""  # one line for `cadence launch --help`

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """This launcher's own flags (`--status`, `--stop`, `--config` and overrides are common)."""

    @classmethod
    def from_args(cls, cfg, run_dir: str, args: argparse.Namespace) -> "Launcher":
        """The launcher for `cadence launch KIND`'s parsed flags (those of add_arguments)."""
        return cls(cfg, run_dir)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ConfigError naming a key this launcher cannot honour (before anything is placed)."""

    @abc.abstractmethod
    def __init__(self, cfg, run_dir: str, message: Callable[[str], None] | None = None):
        """cfg: the run's validated Config; run_dir: absolute, seen by every node."""

    @abc.abstractmethod
    def run(self) -> int:
        """Place the learner group and the actors, restart what dies, until the run ends or is
        stopped; the exit status as `cadence train`'s. Raises LauncherUnavailable."""

    @classmethod
    def status(cls, run_dir: str) -> dict:
        """The launch's last status.json with the run's newest step and samples."""
        return launch_state.read_status(run_dir, cls.kind)

    @classmethod
    def stop(cls, run_dir: str) -> str:
        """Ask the running launch to stop cleanly; the path of the stop request."""
        return launch_state.request_stop(run_dir, cls.kind)


_REGISTRY: dict[str, str | type[Launcher]] = {
    "ray": "cadence.launch.cluster.ray.launcher:RayLauncher",
    "slurm": "cadence.launch.cluster.slurm.launcher:SlurmLauncher",
}


def register(kind: str, target: str | type[Launcher]) -> None:
    """`cadence launch KIND` runs `target` ("module:Class", imported on first use, or the class)."""
    _REGISTRY[kind] = target


def kinds() -> list[str]:
    return list(_REGISTRY)


def get(kind: str) -> type[Launcher]:
    if kind not in _REGISTRY:
        raise KeyError(f"no launcher {kind!r}; known: {', '.join(_REGISTRY)}")
    target = _REGISTRY[kind]
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = _REGISTRY[kind] = getattr(importlib.import_module(module), name)
    return target
