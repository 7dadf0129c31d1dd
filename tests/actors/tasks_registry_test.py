"""Plug-in tasks: module:factory, file.py:factory and cadence.tasks entry points, task.args in the
config, errors that name the key, and no import circle among the actors' modules."""
import ast
import os
import subprocess
import sys

import pytest

from cadence.actors.tasks.base import Completion, Score
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.launch.config import load_config, preflight
from cadence.launch.config_loader import ConfigError

PLUGIN = '''
from cadence.actors.tasks.base import Prompt, Score

class Echo:
    """Reward: how many characters of the completion equal args.char (no reference answer)."""
    max_prompt_len = 2
    max_completion_len = 4

    def __init__(self, cfg, tokenizer):
        if "char" not in cfg.args:
            raise ValueError("args.char: the echo task needs the character to reward")
        self.name, self.char, self.tokenizer = "echo", cfg.args["char"], tokenizer
        self.repeat = int(cfg.args.get("repeat", 1))

    def prompt(self, index):
        return Prompt(f"echo/train/{index}", index, (1, 4 + index % 10), text=str(index % 10),
                      metadata={"digit": index % 10})

    def heldout(self):
        return [Prompt(f"echo/heldout/{i}", i, (1, 4 + i)) for i in range(4)]

    def score(self, prompt, completion):
        hits = sum(c == self.char for c in completion.text) / max(len(completion.text), 1)
        return Score(hits, metrics={"length": len(completion.text), "digit": prompt.metadata.get("digit", -1)})

def make(cfg, tokenizer):
    return Echo(cfg, tokenizer)
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "echo_task.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("echo_task", None)


def test_module_factory_builds_the_task_with_its_args(plugin_dir):
    task = make_task(TaskConfig(name="echo_task:make", args={"char": "7"}))
    assert task.name == "echo" and task.char == "7"
    assert task.tokenizer is not None  # the CharTokenizer default
    p = task.prompt(3)
    score = task.score(p, Completion((11, 11), "77"))
    assert score == Score(1.0, metrics={"length": 2, "digit": 3})
    assert p.answer == () and p.metadata == {"digit": 3}


def test_file_path_factory(plugin_dir):
    task = make_task(TaskConfig(name=f"{plugin_dir / 'echo_task.py'}:make", args={"char": "1"}))
    assert task.char == "1"


def test_entry_point_names_an_installed_task(plugin_dir):
    dist = plugin_dir / "echo_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[cadence.tasks]\necho = echo_task:make\n")
    task = make_task(TaskConfig(name="echo", args={"char": "3"}))
    assert task.name == "echo" and task.char == "3"


@pytest.mark.parametrize("name, message", [
    ("no_such_module_xyz:make", "name: cannot import task module 'no_such_module_xyz'"),
    ("echo_task:nothing", "name: 'echo_task' has no callable 'nothing'"),
    ("nope", "name: unknown task 'nope'"),
    ("/no/such/file.py:make", "name: task file '/no/such/file.py' does not exist"),
])
def test_bad_names_are_named(plugin_dir, name, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        make_task(TaskConfig(name=name))


def test_config_takes_args_as_overrides_files_and_round_trips(plugin_dir, tmp_path, capsys):
    cfg = load_config(overrides=["task.name=echo_task:make", "task.args.char=7", "task.args.repeat=2",
                                 "run.progress=false"])
    assert cfg.task.args == {"char": 7, "repeat": 2}  # YAML scalars, like every override
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("task:\n  name: echo_task:make\n  args: {char: '7', extra: [1, 2]}\n")
    cfg2 = load_config([str(yaml_file)], ["task.args.repeat=3"])
    assert cfg2.task.args == {"char": "7", "extra": [1, 2], "repeat": 3}  # merged key by key
    # --print-config output loads back to the same config
    from cadence.launch import cli
    assert cli.main(["train", "--config", str(yaml_file), "task.args.repeat=3", "--print-config"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load_config([str(printed)]) == cfg2


def test_config_errors_name_the_key(plugin_dir):
    with pytest.raises(ConfigError, match=r"^task\.args\.char: the echo task needs"):
        preflight(load_config(overrides=["task.name=echo_task:make"]))  # the factory runs where a run starts
    with pytest.raises(ConfigError, match=r"^task\.args: expected a mapping"):
        load_config(overrides=["task.name=echo_task:make", "task.args=3"])
    with pytest.raises(ConfigError, match=r"^task\.args: the built-in task 'sort'"):
        load_config(overrides=["task.args.x=1"])
    with pytest.raises(ConfigError, match=r"^task\.name: unknown task 'sortt'"):
        load_config(overrides=["task.name=sortt"])


def test_cli_rejects_a_plugin_that_does_not_import_with_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", "task.name=not_a_module_abc:make",
                          f"run.dir={tmp_path / 'r'}"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert "task.name: cannot import task module 'not_a_module_abc'" in out.stderr


def _imports(path: str, package_root: str) -> set[str]:
    """Modules of ours a file imports, at any depth (function-level imports count too)."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] == package_root}


def import_cycles(root: str) -> list[list[str]]:
    """Cycles in the import graph of the actors package (a package is its __init__ module)."""
    modules = {}
    for dirpath, _, files in os.walk(os.path.join(root, "actors")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
                modules[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    graph = {m: sorted(i for i in _imports(p, "actors") if i in modules and i != m) for m, p in modules.items()}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(path + [start])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return cycles


def test_no_import_circle_among_the_actors_modules():
    """The house item of issue 22: the task base imported the concrete tasks for make_task."""
    assert import_cycles(os.path.join(os.path.dirname(__file__), "..", "..")) == []


def test_a_plugin_run_gets_one_plain_run_folder():
    import dataclasses

    from cadence.launch.artifacts import default_run_dir
    from cadence.launch.config import Config

    cfg = dataclasses.replace(Config(), task=TaskConfig(name="examples/calc/calculator_task.py:make"))
    path = default_run_dir(cfg)
    assert os.path.dirname(path) == "runs" and os.path.basename(path).startswith("calculator_task.py-make-")
