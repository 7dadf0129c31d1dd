"""Config tree: strict keys, types and ranges; YAML files and dotted overrides; exit code 2."""
import re
import subprocess
import sys

import pytest

from cadence.launch.cli import main
from cadence.launch.config import Config, load_config, preflight
from cadence.launch.config_loader import ConfigError, all_keys, parse_override


def test_defaults_validate_and_overrides_apply(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, Config)
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  optimizer:\n    lr: 0.002\nrun:\n  steps: 7\n")
    cfg = load_config([str(f)], ["run.steps=9", "learner.grpo.scale_by_std=false", "task.name=add_reversed",
                                 "task.num_digits=3"])
    assert cfg.learner.optimizer.lr == 0.002
    assert cfg.run.steps == 9  # the override beats the file
    assert cfg.learner.grpo.scale_by_std is False
    assert cfg.task.name == "add_reversed"


def test_yaml_yes_and_no_mean_the_choices_of_that_name(tmp_path):
    # YAML 1.1 reads no/yes as booleans; run.resume's choices are the strings "no"/"auto"/"yes".
    assert load_config(overrides=["run.resume=no"]).run.resume == "no"
    assert load_config(overrides=["run.resume=yes"]).run.resume == "yes"
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  resume: no\n")
    assert load_config([str(f)]).run.resume == "no"
    with pytest.raises(ConfigError, match="^actors.sglang.sync: True"):  # no choice of that meaning
        load_config(overrides=["actors.sglang.sync=yes"])


def test_scientific_notation_and_lists():
    assert parse_override("learner.optimizer.lr=1e-3") == ("learner.optimizer.lr", 1e-3)
    cfg = load_config(overrides=["engine.batch_buckets=[8, 64, 256]"])
    assert cfg.engine.batch_buckets == (8, 64, 256)


@pytest.mark.parametrize("override, named", [
    ("learner.optimizer.lrr=1", "learner.optimizer.lrr"),       # unknown key
    ("nosuch.section=1", "nosuch.section"),                     # unknown section
    ("learner.batch_size=abc", "learner.batch_size"),           # wrong type
    ("learner.batch_size=1.5", "learner.batch_size"),           # float for an int
    ("run.progress=3", "run.progress"),                         # int for a bool
    ("task.name=parity", "task.name"),                          # not a Literal choice
    ("learner.optimizer.lr=-1", "learner.optimizer.lr"),        # out of range
    ("learner.batch_size=100", "learner.batch_size"),           # not a multiple of microbatch
    ("model.n_kv_heads=3", "model.n_kv_heads"),                 # cross-field, inside a section
    ("task.num_digits=0", "task.num_digits"),
    ("learner.mesh.fsdp=0", "learner.mesh.fsdp"),                # mesh axis sizes: >= 1 or -1
    ("learner.mesh.rules=[embed=model]", "learner.mesh.rules"),  # no such mesh axis
    ("learner.remat=some", "learner.remat"),
    ("learner.logits_chunk=-1", "learner.logits_chunk"),
    ("learner.processes=0", "learner.processes"),
    ("learner.distributed.coordinator=nohost", "learner.distributed.coordinator"),
    ("launch.actor_restart_budget=-1", "launch.actor_restart_budget"),
    ("launch.actor_restart_window_s=0", "launch.actor_restart_window_s"),
    ("launch.actor_env=[NOVALUE]", "launch.actor_env"),
])
def test_bad_input_names_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(overrides=[override])


@pytest.mark.parametrize("override, named", [
    ("engine.max_new_tokens=4", "engine.max_new_tokens: 4 is shorter than the task's answers"),  # answers: 7 tokens
    ("model.max_seq_len=8", "model.max_seq_len: 8 < prompt + completion"),
    ("model.vocab_size=8", "model.vocab_size: 8 < the tokenizer's"),
    ("task.name=tests.no_such_module:make", "task.name: cannot import task module"),
])
def test_checks_that_build_the_task_run_where_the_run_starts(override, named, tmp_path, capsys):
    # Loading (and printing) a config builds no task and loads no tokenizer; preflight does, and
    # `cadence train` runs it first: the same message, exit code 2.
    cfg = load_config(overrides=[override])
    with pytest.raises(ConfigError, match="^" + re.escape(named)):
        preflight(cfg)
    assert main(["train", override, f"run.dir={tmp_path / 'run'}"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_loading_a_config_builds_no_task(monkeypatch):
    from cadence.actors.tasks import registry

    def refuse(*a, **k):
        raise AssertionError("load_config built the task")

    monkeypatch.setattr(registry, "make_task", refuse)
    load_config(overrides=["task.name=add_reversed", "task.num_digits=3"])


def test_temperature_is_one_key_and_the_old_one_is_read_as_it(tmp_path):
    # engine.temperature: the sampler draws at it and the learner scores at it.
    assert load_config(overrides=["engine.temperature=0.7"]).engine.temperature == 0.7
    with pytest.warns(FutureWarning, match=r"learner\.grpo\.temperature is deprecated: set engine\.temperature"):
        cfg = load_config(overrides=["learner.grpo.temperature=0.7"])
    assert cfg.engine.temperature == 0.7 and not hasattr(cfg.learner.grpo, "temperature")
    old = tmp_path / "config.yaml"  # a run directory's config from before: both keys, equal
    old.write_text("engine:\n  temperature: 0.6\nlearner:\n  grpo:\n    temperature: 0.6\n    clip_low: 0.1\n")
    with pytest.warns(FutureWarning):
        cfg = load_config([str(old)])
    assert (cfg.engine.temperature, cfg.learner.grpo.clip_low) == (0.6, 0.1)
    old.write_text("engine:\n  temperature: 0.6\nlearner:\n  grpo:\n    temperature: 0.9\n")
    with pytest.raises(ConfigError, match=r"^learner\.grpo\.temperature: replaced by engine\.temperature .* "
                                          r"to 0\.9 and 0\.6: keep engine\.temperature only"):
        load_config([str(old)])


def test_minibatches_with_the_controller_names_the_key():
    load_config(overrides=["learner.minibatches=2"])  # fine alone
    with pytest.raises(ConfigError, match=r"learner\.minibatches: the batch-size controller"):
        load_config(overrides=["learner.minibatches=2", "controller.enabled=true"])


def test_unknown_key_suggests_the_near_one():
    with pytest.raises(ConfigError, match=r"did you mean learner\.optimizer\.lr"):
        load_config(overrides=["learner.optimizer.lrr=1"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config([str(tmp_path / "nope.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config([str(bad)])
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("learner:\n  optimizer: 3\n")
    with pytest.raises(ConfigError, match="learner.optimizer: expected a mapping"):
        load_config([str(wrong)])


def test_cli_exits_2_naming_the_key(capsys):
    assert main(["train", "learner.optimizer.lrr=1"]) == 2
    assert "learner.optimizer.lrr" in capsys.readouterr().err
    assert main(["train", "--print-config", "run.steps=3"]) == 0
    assert "steps: 3" in capsys.readouterr().out


def test_console_script_exit_code_is_2():
    # the real entry point in a fresh interpreter, as a user runs it
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", "actors.max_staleness=-1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "actors.max_staleness" in out.stderr


def test_every_key_is_reachable_by_override():
    cfg = load_config()
    for key in all_keys(Config):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)


def test_eval_on_actors_needs_actor_processes(capsys, tmp_path):
    # the default run has one actor thread: evaluation on the actors has nobody to run it
    with pytest.raises(ConfigError, match=r"^run\.eval_on: 'actors' needs actor processes"):
        load_config(overrides=["run.eval_on=actors"])
    assert main(["train", "run.eval_on=actors", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "run.eval_on" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"run\.eval_on"):
        load_config(overrides=["run.eval_on=sometimes"])
    # actor processes of its own, or actors that join at actors.listen (as under `cadence launch ray`)
    assert load_config(overrides=["run.eval_on=actors", "actors.processes=2"]).run.eval_on == "actors"
    assert load_config(overrides=["run.eval_on=actors", "actors.num_actors=0"]).run.eval_on == "actors"
    assert load_config().run.eval_on == "auto"
