"""`cadence launch ray` without a cluster: its config keys, --status and --stop (no Ray needed)."""
import json
import os

import pytest

from cadence.launch.cluster import launch_state
from cadence.launch.cli import main
from cadence.launch.config import load_config
from cadence.launch.config_loader import ConfigError


@pytest.mark.parametrize("override, key", [
    ("launch.actor_resources=[worker_node]", "launch.actor_resources[0]"),
    ("launch.learner_resources=[gpu_host=two]", "launch.learner_resources[0]"),
    ("launch.learner_strategy=ANYWHERE", "launch.learner_strategy"),
    ("launch.min_learner_processes=0", "launch.min_learner_processes"),
    ("launch.actor_max_restarts=-2", "launch.actor_max_restarts"),
    ("launch.env=[NOVALUE]", "launch.env[0]"),
])
def test_bad_launch_keys_are_named(override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config([], [override])


def test_launch_keys_parse():
    cfg = load_config([], ["launch.learner_resources=[learner_host=1]", "launch.env=[JAX_PLATFORMS=cuda]",
                           "launch.learner_strategy=STRICT_SPREAD"])
    assert cfg.launch.learner_resources == ("learner_host=1",) and cfg.launch.learner_strategy == "STRICT_SPREAD"


def test_status_and_stop(tmp_path, capsys):
    run = str(tmp_path / "run")
    os.makedirs(run)
    assert main(["launch", "ray", "--status", run]) == 1  # not a launched run: says so, exit 1
    assert "not started by `cadence launch ray`" in capsys.readouterr().err
    assert main(["launch", "ray", "--stop", run]) == 1
    assert not launch_state.stop_requested(run)

    os.makedirs(launch_state.launch_dir(run))
    launch_state.write_status(run, {"state": "running", "updated_at": 0.0, "learner": {"processes": 2}})
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 7, "samples": 896, "eval/exact_match": 0.25}) + "\n")
        f.write('{"step": 8, "samp')  # a line being written is skipped
    assert main(["launch", "ray", "--status", run]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["state"], st["step"], st["samples"], st["heldout_exact_match"]) == ("running", 7, 896, 0.25)
    assert st["learner"]["processes"] == 2
    assert main(["launch", "ray", "--stop", run]) == 0
    assert launch_state.stop_requested(run)


def test_bad_config_exits_2_before_any_cluster(tmp_path, capsys):
    assert main(["launch", "ray", "launch.learner_cpus=-1", f"run.dir={tmp_path}"]) == 2
    assert "launch.learner_cpus" in capsys.readouterr().err
