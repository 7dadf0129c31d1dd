"""Built-in tasks: prompt sources plus verifiable rewards."""

from actors.tasks.base import Prompt, Task, make_task
from actors.tasks.config import TaskConfig

__all__ = ["Prompt", "Task", "TaskConfig", "make_task"]
