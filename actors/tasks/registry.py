"""Builds a task by name: a built-in, ``package.module:factory``, ``path/to/file.py:factory``, or
the name of an installed ``cadence.tasks`` entry point.

    task = make_task(cfg.task, tokenizer)

A factory is called as ``factory(cfg, tokenizer)`` with the task sub-config (``cfg.args`` holds
the user's own mapping, ``cfg.seed`` / ``cfg.heldout_size`` / ``cfg.heldout_seed`` the stream
settings) and the policy's tokenizer, and returns an object with the Task protocol
(actors/tasks/base.py). A package makes its tasks available by name with, in pyproject.toml:

    [project.entry-points."cadence.tasks"]
    mytask = "mypackage.tasks:make_mytask"

The built-ins import their modules lazily here, so the base module never imports them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Callable

from cadence.actors.tasks.config import BUILTIN_TASKS, TaskConfig
from cadence.actors.tasks.loading import load_module as _load_module

ENTRY_POINT_GROUP = "cadence.tasks"


def _sort(cfg, tokenizer):
    from cadence.actors.tasks.sort import SortTask
    return SortTask(cfg, tokenizer)


def _add_reversed(cfg, tokenizer):
    from cadence.actors.tasks.add_reversed import AddReversedTask
    return AddReversedTask(cfg, tokenizer)


def _jsonl(cfg, tokenizer):
    from cadence.actors.tasks.jsonl_task import JsonlMathTask
    return JsonlMathTask(cfg, tokenizer)


def _word_problems(cfg, tokenizer):
    from cadence.actors.tasks.word_problems import WordProblemsTask
    return WordProblemsTask(cfg, tokenizer)


BUILTINS: dict[str, Callable[[TaskConfig, Any], Any]] = {
    "sort": _sort, "add_reversed": _add_reversed, "jsonl": _jsonl, "word_problems": _word_problems}
assert set(BUILTINS) == set(BUILTIN_TASKS)


def resolve_factory(name: str) -> Callable[[TaskConfig, Any], Any]:
    """The factory a task name stands for.

    Raises:
      ValueError("name: ..."): an unknown name, a module that does not import, a missing attribute.
    """
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" in name:
        module_name, _, attr = name.rpartition(":")
        if not module_name or not attr:
            raise ValueError(f"name: {name!r} must look like package.module:factory or file.py:factory")
        module = _load_module(module_name)
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ValueError(f"name: {module_name!r} has no callable {attr!r}")
        return factory
    points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    for point in points:
        return point.load()
    installed = sorted(p.name for p in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    raise ValueError(f"name: unknown task {name!r}; expected one of {sorted(BUILTINS)}, an installed "
                     f"'{ENTRY_POINT_GROUP}' entry point {installed}, or package.module:factory")


def make_task(cfg: TaskConfig, tokenizer=None):
    """Builds the task named by cfg (validating cfg first).

    Args:
      cfg: the task sub-config.
      tokenizer: the policy's tokenizer (learner.models.policy.Policy.tokenizer). None means the built-in
        CharTokenizer, which the digit tasks default to; the jsonl task requires a checkpoint's.

    Raises:
      ValueError("<field>: <problem>"): a bad config, or a task that does not follow the protocol.
    """
    cfg.validate()
    task = resolve_factory(cfg.name)(cfg, tokenizer)
    missing = [a for a in ("name", "max_prompt_len", "max_completion_len", "prompt", "heldout")
               if not hasattr(task, a)]
    if not hasattr(task, "score") and not hasattr(task, "environment"):
        missing.append("score (or environment)")
    if missing:
        raise ValueError(f"name: the task {cfg.name!r} built lacks {', '.join(missing)} "
                         "(see actors/tasks/base.py, docs/tasks.md)")
    if "/" in str(task.name):
        raise ValueError(f"name: a task's name must not contain '/', got {task.name!r}")
    if getattr(task, "tokenizer", None) is None:
        if tokenizer is None:
            from cadence.learner.models.char_tokenizer import CharTokenizer  # the digit tasks' default
            tokenizer = CharTokenizer()
        task.tokenizer = tokenizer
    return task


def task_factory(cfg: TaskConfig, tokenizer) -> Callable[[], Any]:
    """A picklable zero-argument callable that builds the same task (what reward workers run)."""
    import functools
    return functools.partial(make_task, cfg, tokenizer)

