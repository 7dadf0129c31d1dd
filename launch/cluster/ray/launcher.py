"""`cadence launch ray`: the Launcher (launch/cluster/launcher.py) for a Ray cluster.

    cadence launch ray --address HEAD:6379 learner.processes=2 actors.processes=8
    RayLauncher(cfg, run_dir, address="HEAD:6379").run()    # the same, from Python

This module imports no Ray (the CLI lists every launcher's flags without it); the work is in
driver.py (the watch loop), learner_hosts.py (the learner group), fleet.py (the actors),
placement.py (bundles), hosts.py (one process inside a Ray actor).
"""
from __future__ import annotations

import os

from cadence.launch.cluster.launcher import Launcher, LauncherUnavailable


class RayLauncher(Launcher):
    kind = "ray"
    help = "the run on a Ray cluster (pip install 'cadence-rl[ray]')"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--address", default=None, help="Ray cluster address HOST:PORT (default: "
                            "$RAY_ADDRESS, else a local cluster is started)")

    @classmethod
    def from_args(cls, cfg, run_dir, args) -> "RayLauncher":
        return cls(cfg, run_dir, address=args.address or os.environ.get("RAY_ADDRESS"))

    def __init__(self, cfg, run_dir: str, address: str | None = None, message=None):
        self.cfg, self.run_dir, self.address, self.message = cfg, run_dir, address, message

    def run(self) -> int:
        try:
            from cadence.launch.cluster.ray.driver import RayDriver
        except ImportError as e:
            raise LauncherUnavailable(f"Ray is not installed ({e}); pip install 'cadence-rl[ray]'") from None
        return RayDriver(self.cfg, self.run_dir, address=self.address, message=self.message).run()
