"""Cadence: asynchronous reinforcement learning for language models on JAX.

This package is the public API; plug-in tasks and scripts import only from here:

    from cadence import RecordsTask, Score

    def reward(prompt, completion):
        return Score(float(completion.text.strip() == prompt.metadata["answer"]))

    def make(cfg, tokenizer):          # task.name=my_task:make task.args.path=data.jsonl
        return RecordsTask(cfg, tokenizer, reward, name="my_task")

and a run from Python is

    import cadence

    if __name__ == "__main__":  # reward workers are spawned processes that import this file again
        cfg = cadence.load_config(["my.yaml"], ["run.steps=100"])
        summary = cadence.train(cfg, "runs/mine")
        print(cadence.evaluate(cfg, "runs/mine").metrics)

The internals live in four rooms installed beneath this package (cadence.protocols,
cadence.learner, cadence.actors, cadence.launch), so installing Cadence claims one import name,
`cadence`, and a project with its own `launch/` or `protocols/` package does not collide with it.
Their modules may change between releases; the names below do not without a deprecation.
"""

from __future__ import annotations

import importlib
import os

# In a source checkout the rooms are folders beside this one (the repository keeps learner/,
# actors/, protocols/ and launch/ at its top); an installed wheel maps them under cadence/ through
# setup.py's package_dir. Searching the checkout root too makes `cadence.learner` resolve to
# ./learner when the checkout is run without installing (PYTHONPATH=., a worktree, a child process).
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Only a checkout (setup.py beside the rooms): an installed cadence never searches site-packages.
_in_checkout = all(os.path.isfile(os.path.join(_checkout, *p)) for p in (("setup.py",), ("learner", "__init__.py")))
if _in_checkout and _checkout not in __path__:
    __path__.append(_checkout)

# Public name -> module that defines it. Imported on first use, so `import cadence` stays cheap
# (no JAX until a run or a model is asked for).
_PUBLIC = {
    "Task": "cadence.actors.tasks.base",
    "Prompt": "cadence.actors.tasks.base",
    "Completion": "cadence.actors.tasks.base",
    "Score": "cadence.actors.tasks.base",
    "Step": "cadence.actors.tasks.base",
    "Environment": "cadence.actors.tasks.base",
    "completion_text": "cadence.actors.tasks.base",
    "RecordsTask": "cadence.actors.tasks.records",
    "Config": "cadence.launch.config",
    "load_config": "cadence.launch.config",
    "train": "cadence.launch.run.train",
    "evaluate": "cadence.launch.evaluate",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'cadence' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup skips this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
