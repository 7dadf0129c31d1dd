"""Tasks: prompt sources plus rewards (built-ins here; plug-ins anywhere, see registry.py)."""

from cadence.actors.tasks.base import Completion, Environment, Prompt, Score, Step, Task
from cadence.actors.tasks.config import TaskConfig

__all__ = ["Completion", "Environment", "Prompt", "Score", "Step", "Task", "TaskConfig"]
