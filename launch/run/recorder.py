"""After every update: held-out evaluation when due, one metrics line, the progress line, the
target check, and the periodic checkpoint. `on_step` is what LearnerLoop.run calls back.

    rec = Recorder(cfg.run, sinks, progress, evaluate, checkpointer, summary, clock, snapshot)
    state = loop.run(state, steps, on_step=rec.on_step, ...)
    rec.save(state, finished=True, wait=True)
"""
from __future__ import annotations

import json
from typing import Any, Callable


def arrays_of(state) -> dict:
    """The array part of a learner state (GRPO: params, Adam; PPO adds critic and reference)."""
    return {k: v for k, v in state._asdict().items() if k != "step" and v is not None}


class Recorder:
    def __init__(self, run_cfg, sinks, progress, evaluate: Callable[[Any], dict], checkpointer, summary: dict,
                 clock, snapshot: Callable[[Any, bool], dict], samples0: int = 0):
        self.cfg, self.sinks, self.progress = run_cfg, sinks, progress
        self.evaluate, self.checkpointer, self.summary = evaluate, checkpointer, summary
        self.clock, self.snapshot = clock, snapshot
        self._samples = samples0  # samples after the previous step (a resumed run starts there)

    def eval_due(self, step: int, samples: int) -> bool:
        n = self.cfg.eval_every_samples
        if n:  # a crossing of a multiple of n samples, whatever B the steps in between had
            due, self._samples = samples // n > self._samples // n, samples
            return due
        return bool(self.cfg.eval_every and step % self.cfg.eval_every == 0)

    def on_step(self, step: int, state, m: dict) -> bool:
        """Record one update; True when the run should stop (target reached, sample budget spent)."""
        final = step == self.cfg.steps
        if self.eval_due(step, m["samples"]) or final:
            self.summary["last_eval"] = self.evaluate(state.params)
            m.update(self.summary["last_eval"])
            m["wall_time"] = self.clock()
        m["checkpoint/blocked_seconds"] = self.checkpointer.blocked_seconds
        m["checkpoint/last_saved_at"] = self.checkpointer.last_saved_at  # unix time; status/Prometheus show its age
        self.sinks.write(m)
        if step % self.cfg.log_every == 0 or "eval/exact_match" in m or final:
            self.progress.line(m)
        em = m.get("eval/exact_match")
        done = bool(em is not None and self.cfg.stop_at_exact_match and em >= self.cfg.stop_at_exact_match)
        if done:
            self.summary["target_reached_at"] = {"step": step, "samples": m["samples"], "wall_time": m["wall_time"]}
        done = done or bool(self.cfg.max_samples and m["samples"] >= self.cfg.max_samples)
        if self.checkpointer.due(step) and not (done or final):
            self.save(state)
        return done

    def save(self, state, finished: bool = False, wait: bool = False) -> None:
        meta = self.snapshot(state, finished)
        # A deep copy, outside the ledger's lock: an asynchronous save serialises it later, while
        # the run mutates the originals.
        meta = json.loads(json.dumps(meta))
        self.checkpointer.save(state.step, arrays_of(state), meta, wait=wait)
