"""A crash loop told apart from a few restarts: at most N restarts of one process within a window.

    budget = RestartBudget(cfg.launch.actor_restart_budget, cfg.launch.actor_restart_window_s)
    budget.restarted("actor-0")      # each restart the launcher saw (time.time() unless given)
    budget.exceeded()                # "actor-0" once it restarted more than N times within the window
    last_error(open("RUN_DIR/logs/actor-0.log").read())   # what its last run died of, for the message

A process that fails at start (a bad environment, a missing library, a broken node) would be
restarted forever (launch.actor_max_restarts=-1) while the learner waits for samples; with the
budget the run fails, naming the process and its last error. No cluster library here.
"""
from __future__ import annotations

import collections
import re
import time

_ERROR = re.compile(r"^(\w[\w.]*(Error|Exception|Exit|Interrupt)\b.*|Fatal Python error.*)$")
HOST_MARKER = "[ray host "  # the line a Ray host writes after its process failed (ray/hosts.py)


class RestartBudget:
    def __init__(self, budget: int, window_s: float):
        self.budget, self.window_s = budget, window_s  # budget 0: never a crash loop
        self.times: dict[str, collections.deque] = {}

    def restarted(self, name: str, now: float | None = None) -> None:
        self.times.setdefault(name, collections.deque()).append(time.time() if now is None else now)

    def exceeded(self, now: float | None = None) -> str | None:
        """The first process restarted more than `budget` times within the window, else None."""
        if self.budget <= 0:
            return None
        now = time.time() if now is None else now
        for name, times in self.times.items():
            while times and times[0] < now - self.window_s:
                times.popleft()
            if len(times) > self.budget:
                return name
        return None


def last_error(log: str) -> str:
    """The error a process's last failed run ended with, from its gathered output (every run's,
    one after another, each failed one closed by the host's line): the last line of that run that
    names an error, else its last line."""
    lines = [line.strip() for line in log.splitlines()]
    marks = [i for i, line in enumerate(lines) if line.startswith(HOST_MARKER)]
    run = lines[(marks[-2] + 1 if len(marks) > 1 else 0):marks[-1]] if marks else lines
    run = [line for line in run if line]
    if not run:
        return "(no output gathered)"
    errors = [line for line in run if _ERROR.match(line)]
    return errors[-1] if errors else run[-1]
