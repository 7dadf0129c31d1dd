"""`cadence replay`: the controller's decisions on a run's logged updates, stopping where the course parts."""
import json
import os

import yaml

from cadence.launch import cli, config_loader
from cadence.launch.config import load_config
from cadence.launch.experiments.replay import replay


def logged_run(tmp_path, steps=12, batch_size=8):
    """A run directory as a fixed-B run leaves it: config.yaml, and one record per update with what
    the controller reads (one group of 8 per update: one whole-group unit)."""
    cfg = load_config([], ["learner.batch_size=8", "learner.group_size=8", "learner.microbatch_size=8",
                           "controller.min_batch_size=8", "controller.window=4", "controller.dwell=8",
                           "controller.warmup_steps=0"])
    with open(tmp_path / "config.yaml", "w") as f:
        yaml.safe_dump(config_loader.to_dict(cfg), f)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "eval/exact_match": 0.1}) + "\n")  # an evaluation: skipped
        for step in range(1, steps + 1):
            f.write(json.dumps({
                "step": step, "batch_size": batch_size, "tokens": 60.0, "learner/train_seconds": 2.0,
                "grad_norm_sq": 0.3, "microbatch_grad_norm_sq": [0.2, 0.1], "microbatch_tokens": [30.0, 30.0],
                "unit_grad_norm_sq": [0.3], "unit_share": [1.0], "unit_samples": [8], "ess": 0.9, "clip_frac": 0.0,
                "wall_time": 3.0 * step, "actors/tokens_per_second": 20.0, "actors/generate_seconds": 1.0 * step,
                "actors/concurrency": cfg.actors.prompts_per_call}) + "\n")
    return str(tmp_path)


def test_replay_decides_on_the_logged_updates_and_stops_where_the_course_parts(tmp_path):
    run = logged_run(tmp_path)
    out = replay(run)
    # one group per update: the controller probes 2B at its first decision after the dwell; the
    # run stayed at 8, so update 9 is not the replay's to judge
    assert [(d["step"], d["action"]) for d in out["decisions"]] == [(4, "hold"), (8, "probe")]
    assert out["stopped_at"] == 9 and "B=8" in out["why"] and "B=16" in out["why"]
    off = replay(run, ["controller.probe=false"])  # the settings to try go over the run's own
    assert off["stopped_at"] is None and [d["action"] for d in off["decisions"]] == ["hold"] * 3
    assert "noise scale not measurable" in off["decisions"][-1]["reason"]


def test_replay_command_prints_decisions_and_names_bad_input(tmp_path, capsys):
    run = logged_run(tmp_path)
    assert cli.main(["replay", run, "controller.probe=false"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["step"] for x in lines[:-1]] == [4, 8, 12] and lines[-1]["stopped_at"] is None
    assert cli.main(["replay", run, "controller.dwel=3"]) == cli.EXIT_CONFIG
    assert "controller.dwell" in capsys.readouterr().err  # the suggestion names the key
    os.remove(os.path.join(run, "metrics.jsonl"))
    assert cli.main(["replay", run]) == 1
    assert "metrics.jsonl not found" in capsys.readouterr().err
