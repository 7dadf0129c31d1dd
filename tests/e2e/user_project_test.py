"""Cadence inside a user's project: one import name, `cadence`, and nothing generic.

1. The wheel installs everything beneath `cadence/` (no top-level learner, actors, launch or
   protocols to collide with), task data included.
2. A project with its own `launch/` and `protocols/` packages trains a plug-in task written
   against the public API only, through the `cadence` command and through `cadence.train` /
   `cadence.evaluate` from Python, while its own packages stay its own.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile

import cadence
from cadence._root import IMPORT_ROOT

ROOMS = ("protocols", "learner", "actors", "launch")

TASK = '''
import launch, protocols                      # the project's own packages, not Cadence's
from cadence import RecordsTask, Score

assert launch.OWNER == protocols.OWNER == "user", (launch.__file__, protocols.__file__)


def reward(prompt, completion):
    return Score(float(completion.text == prompt.metadata["answer"]), exact_match=completion.text == prompt.metadata["answer"])


def make(cfg, tokenizer):
    return RecordsTask(cfg, tokenizer, reward, name="echo")
'''

SCRIPT = '''
import json, sys
import cadence, launch
assert launch.OWNER == "user"

if __name__ == "__main__":  # reward workers are spawned processes: they import this file again
    cfg = cadence.load_config(overrides=sys.argv[2:])
    summary = cadence.train(cfg, sys.argv[1])
    held = cadence.evaluate(cfg, sys.argv[1], limit=4)
    print(json.dumps({"steps": summary["steps"], "task": held.task, "n": len(held.prompts),
                      "exact": held.metrics["eval/exact_match"], "text": held.completions[0].text,
                      "reward": held.scores[0].reward}))
'''


def _project(tmp_path):
    root = tmp_path / "project"
    for pkg in ("launch", "protocols"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text('OWNER = "user"\n')
    (root / "echo_task.py").write_text(TASK)
    (root / "train_echo.py").write_text(SCRIPT)
    with open(root / "digits.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"{i % 10}=", "answer": str(i % 10)}) + "\n")
    return root


def _env(root):
    # The project first, as `python -m` from it puts it; then wherever this cadence imports from.
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), IMPORT_ROOT]))


ARGS = ["task.name=echo_task:make", "task.args.path=digits.jsonl", "task.heldout_size=8", "run.steps=2",
        "run.eval_every=0", "run.progress=false", "learner.sft.steps=0", "learner.batch_size=16", "learner.microbatch_size=16",
        "learner.group_size=4", "actors.prompts_per_call=4", "engine.max_new_tokens=4"]


def test_a_project_with_its_own_launch_and_protocols_trains_through_the_cadence_command(tmp_path):
    root = _project(tmp_path)
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={tmp_path / 'run'}", *ARGS],
                         cwd=root, env=_env(root), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["ledger"]["in_flight"] == 0


def test_a_project_trains_and_evaluates_through_the_python_api(tmp_path):
    root = _project(tmp_path)
    out = subprocess.run([sys.executable, "train_echo.py", str(tmp_path / "run"), *ARGS], cwd=root, env=_env(root),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 2 and result["task"] == "echo" and result["n"] == 4
    assert 0.0 <= result["exact"] <= 1.0 and result["reward"] in (0.0, 1.0) and isinstance(result["text"], str)


def test_the_public_api_names_resolve_and_unknown_names_are_an_attribute_error():
    for name in cadence.__all__:
        assert getattr(cadence, name) is not None, name
    try:
        cadence.not_a_name
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("cadence.not_a_name resolved")


def test_the_wheel_claims_one_top_level_name(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("cadence", *ROOMS):
        shutil.copytree(os.path.join(IMPORT_ROOT, name), src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(IMPORT_ROOT, name), src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"cadence", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    for room in ROOMS:  # every module of every room, beneath cadence/
        here = {os.path.relpath(os.path.join(d, f), IMPORT_ROOT) for d, _, fs in os.walk(os.path.join(IMPORT_ROOT, room))
                for f in fs if f.endswith(".py")}
        assert {f"cadence/{p}" for p in here} <= set(names), room
    assert "cadence/actors/tasks/data/math_sample.jsonl" in names
    entry = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/entry_points.txt").decode()
    assert "cadence = cadence.launch.cli:main" in entry


def test_examples_and_the_task_guide_use_only_the_public_api():
    import re

    internal = re.compile(r"^\s*(from|import)\s+(cadence\.\w|protocols\b|learner\b|actors\b|launch\b)", re.M)
    paths = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(IMPORT_ROOT, "examples")) for f in fs
             if f.endswith((".py", ".md"))] + [os.path.join(IMPORT_ROOT, "docs", "tasks.md")]
    offenders = [(os.path.relpath(p, IMPORT_ROOT), m.group(0).strip()) for p in paths
                 for m in internal.finditer(open(p).read())]
    assert len(paths) > 5 and offenders == []
