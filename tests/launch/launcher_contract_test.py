"""Every launcher (launch/cluster/launcher.py) against the same test body.

The fast tests need no cluster. The real one places a run on a real cluster through the CLI,
kills its actor process the way that cluster loses one (Ray: kill -9 of the process, whose host
Ray restarts; SLURM: `scancel --signal=KILL` of the actor's step), checks that the actor comes
back and the run goes on, reads `--status`, stops the run with `--stop` (final checkpoint) and
checks the summary and the logs. Ray's cluster is two nodes, SLURM's one node; both run inside
a private network namespace (root). Run with `python -m pytest -m 'ray or slurm' tests/launch`.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from cadence.launch.cli import main
from cadence.launch.cluster import launch_state, launcher
from tests.launch.ray_cluster import PLACE, ROOT, SHORT, finish, start_launch, status, stop_launch, wait_for

KINDS = launcher.kinds()


def test_every_builtin_kind_is_registered_and_keeps_the_interface():
    assert {"ray", "slurm"} <= set(KINDS)
    for kind in KINDS:
        impl = launcher.get(kind)
        assert issubclass(impl, launcher.Launcher) and impl.kind == kind and impl.help
    with pytest.raises(KeyError, match="no launcher 'nomad'"):
        launcher.get("nomad")


@pytest.mark.parametrize("kind", KINDS)
def test_status_and_stop_of_a_run_it_did_not_launch(kind, tmp_path, capsys):
    run = str(tmp_path / "run")
    os.makedirs(run)
    assert main(["launch", kind, "--status", run]) == 1
    assert f"not started by `cadence launch {kind}`" in capsys.readouterr().err
    assert main(["launch", kind, "--stop", run]) == 1
    assert not launch_state.stop_requested(run)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_config_exits_2_before_any_cluster(kind, tmp_path, capsys):
    assert main(["launch", kind, "launch.learner_cpus=-1", f"run.dir={tmp_path}"]) == 2
    assert "launch.learner_cpus" in capsys.readouterr().err


def test_a_registered_launcher_is_a_cli_command(tmp_path, capsys):
    class Echo(launcher.Launcher):  # the smallest launcher: writes its status and says what it got
        kind, help = "echo", "prints its run directory"

        @classmethod
        def add_arguments(cls, parser):
            parser.add_argument("--greeting", default="hello")

        @classmethod
        def from_args(cls, cfg, run_dir, args):
            return cls(cfg, run_dir, args.greeting)

        def __init__(self, cfg, run_dir, greeting="hello", message=None):
            self.run_dir, self.greeting = run_dir, greeting

        def run(self):
            os.makedirs(launch_state.launch_dir(self.run_dir))
            launch_state.write_status(self.run_dir, {"state": "finished", "greeting": self.greeting})
            return 0

    launcher.register("echo", Echo)
    try:
        run = str(tmp_path / "run")
        assert main(["launch", "echo", "--greeting", "hi", f"run.dir={run}"]) == 0
        assert main(["launch", "echo", "--status", run]) == 0
        st = json.loads(capsys.readouterr().out)
        assert (st["state"], st["greeting"]) == ("finished", "hi")
    finally:
        launcher._REGISTRY.pop("echo")


# -- the same body on each real cluster ---------------------------------------------------------
def _ray(request):
    cluster = request.getfixturevalue("cluster_up")

    def kill_actor(st):
        os.kill(st["actors"]["hosts"][0]["pid"], signal.SIGKILL)

    return ["--address", cluster.address], PLACE, None, kill_actor


def _slurm(request):
    cluster = request.getfixturevalue("slurm_cluster")

    def kill_actor(st):
        subprocess.run(["scancel", "--signal=KILL", st["actors"]["hosts"][0]["step"]], env=cluster.env, check=True)

    return [], [], cluster.env, kill_actor


CLUSTERS = {"ray": _ray, "slurm": _slurm}


@pytest.mark.parametrize("kind", [pytest.param("ray", marks=pytest.mark.ray),
                                  pytest.param("slurm", marks=pytest.mark.slurm)])
def test_launch_restart_an_actor_status_stop(kind, request, run_dir):
    args, place, env, kill_actor = CLUSTERS[kind](request)
    proc = start_launch(kind, args, run_dir, *place, *SHORT, "actors.processes=1", "run.steps=5000", env=env)

    def step():
        return status(run_dir).get("step") or 0

    def running_actor():
        st = status(run_dir)
        hosts = st.get("actors", {}).get("hosts") or []
        return st.get("state") == "running" and len(hosts) == 1 and hosts[0].get("state") == "running" and st

    st = wait_for(lambda: step() >= 3 and running_actor(), 900, "step 3 with one actor", proc)
    assert st["learner"]["processes"] == 1 and st["learner"]["restarts"] == 0
    kill_actor(st)
    wait_for(lambda: status(run_dir)["actors"]["restarts"] >= 1, 300, "the actor's restart", proc)
    log = os.path.join(run_dir, "logs", "actor-0.log")
    wait_for(lambda: open(log).read().count("joined session") >= 2, 600, "the restarted actor to rejoin", proc)
    s0 = step()
    wait_for(lambda: step() >= s0 + 3, 600, "steps after the actor's restart", proc)

    shown = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "launch", kind, "--status", run_dir],
                           cwd=ROOT, env=dict(env or os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["state"] == "running"

    stop_launch(run_dir, kind, env)
    summary = finish(proc, run_dir, timeout=600)
    assert summary["preempted"] and launch_state.read_status(run_dir, kind)["state"] == "stopped"
    assert summary["steps"] >= s0 + 3
    assert summary["samples"] == 8 * summary["ledger"]["consumed"]  # the ledger verified at the end of train()
    assert summary["launch"]["learner_restarts"] == 0 and summary["launch"]["actor_restarts"] >= 1
    logs = set(os.listdir(os.path.join(run_dir, "logs")))
    assert {"learner-0.log", "actor-0.log"} <= logs, logs
    assert "saving a final checkpoint" in open(os.path.join(run_dir, "logs", "learner-0.log")).read()
