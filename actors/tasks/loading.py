"""Loading user code by name: a task module (``package.module`` or ``path/to/file.py``), and
references to module-level functions that survive pickling into another process.

    module = load_module("path/to/mytask.py")       # registered as cadence_task_mytask
    ref = function_ref(module.reward)               # pickles by name (and file); None for a lambda
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable


def load_module(spec: str):
    """The module a task name's module part names (a .py path is loaded under a name of its own).

    Raises ValueError("name: ...") when it does not exist or does not import."""
    if spec.endswith(".py"):  # a file anywhere: loaded under a name of its own
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise ValueError(f"name: task file {spec!r} does not exist")
        mod_name = "cadence_task_" + os.path.splitext(os.path.basename(path))[0]
        if mod_name in sys.modules and getattr(sys.modules[mod_name], "__file__", None) == path:
            return sys.modules[mod_name]
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        loader_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        raise ValueError(f"name: cannot import task module {spec!r} ({e}); is its folder on PYTHONPATH?") from None


class FunctionRef:
    """A module-level function that pickles by name, and by file for a task file loaded by path
    (``path/to/file.py:factory`` modules are not importable by name in another process).

        ref = function_ref(my_reward)      # None for a lambda or a closure
        ref(prompt, completion)            # calls my_reward (resolved once per process)
    """

    def __init__(self, module: str, qualname: str, path: str = ""):
        self.module, self.qualname, self.path = module, qualname, path
        self._fn = None

    def __reduce__(self):
        return FunctionRef, (self.module, self.qualname, self.path)

    def resolve(self) -> Callable:
        if self._fn is None:
            obj = load_module(self.path) if self.path else importlib.import_module(self.module)
            for part in self.qualname.split("."):
                obj = getattr(obj, part)
            self._fn = obj
        return self._fn

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


def function_ref(fn: Callable) -> FunctionRef | None:
    """A FunctionRef to fn, or None when fn is not reachable by module and name."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not qualname or "<" in qualname:
        return None
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", "") or "" if module.startswith("cadence_task_") else ""
    ref = FunctionRef(module, qualname, path)
    try:
        return ref if ref.resolve() is fn else None
    except (AttributeError, ImportError, ValueError):
        return None
