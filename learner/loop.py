"""The learner loop: take exactly B samples, train one step, publish the next policy version.

    loop = LearnerLoop(train_step, transport, gate, weights, settings, controller=controller)
    state = loop.run(state, num_steps, on_step=callback)   # callback(step, state, metrics) -> True to stop

Each step: collect groups from the transport until B samples (dropping any that are staler than
the bound, counted), tell the admission gate the batch is taken, build fixed-shape microbatches,
run the jitted update, publish the new params as version step + 1, and hand the controller a typed
Observation; its Decision (batch size, Adam's hyperparameters, actor concurrency) is applied here
(learner/controller/interface.py). B is the gate's: the controller decides it, `apply` sets it.
Everything here is host-side.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import numpy as np

from cadence.learner.controller.interface import Controller, Decision, Generation, GradientNorms, Observation
from cadence.learner.packing import layout_microbatches
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.ledger import SampleLedger


class PipelineStopped(RuntimeError):
    """The generation side stopped (an actor failed or the run was interrupted)."""


class StopRequested(PipelineStopped):
    """The run's stop event was set (a signal): the loop ends at the last completed step."""


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    group_size: int
    microbatch_size: int
    seq_len: int  # fixed microbatch length: prompt + completion, padded
    pad_id: int
    grpo: Any  # learner.config.GRPOConfig
    microbatch_tokens: int = 0  # > 0: pack samples into microbatches of this token budget (learner/packing.py)
    separate_flat: bool = False  # groups without a signal in microbatches of their own (learner.skip_zero_advantage)
    share_prompts: bool = False  # a group's completions in a row share its prompt (learner.share_prompts)


@dataclasses.dataclass
class Batch:
    groups: list
    staleness: list[int]  # per group: consuming step - policy version
    dropped_stale: int  # groups dropped while filling this batch
    wait_seconds: float  # time the learner was blocked waiting for samples


class LearnerLoop:
    """See the module docstring.

    Args:
      train_step, transport, gate, weights, settings: the jitted step, where groups arrive, the
        admission gate (its batch_size is the B in force), where new versions are published, and
        the fixed shapes.
      health: raises when the generation side failed (called while waiting for samples).
      controller: told every update (None: nothing changes B, Adam or the concurrency).
      on_concurrency: applies a decided concurrency (the dispatcher tells the actors).
      ledger: the run's SampleLedger; publish: params -> what actors get (a sharded learner's
        whole copies).
      measure_generation: (step, record) -> the generation side's Generation counters, adding its
        own metrics to the step's record.
      group_filter: group -> a drop reason or None to keep (dynamic sampling: groups whose
        advantages are all zero); dropped groups free their admission slots.
      before_update: called before each update (the update donates the Adam moments, so a
        checkpoint still being written from them must finish first: Checkpointer.wait).
      samples, dropped: where a resumed run's counts stand.
    """

    def __init__(self, train_step, transport, gate: AdmissionGate, weights, settings: LoopSettings,
                 health: Callable[[], None] | None = None, controller: Controller | None = None,
                 on_concurrency: Callable[[int], None] | None = None,
                 ledger: SampleLedger | None = None, publish: Callable[[Any], Any] | None = None, *,
                 measure_generation: Callable[[int, dict], Generation | None] | None = None,
                 group_filter: Callable[[Any], str | None] | None = None,
                 before_update: Callable[[], None] | None = None,
                 samples: int = 0, dropped: dict[str, int] | None = None):
        self.train_step = train_step
        self.transport = transport
        self.gate = gate
        self.weights = weights
        self.settings = settings
        self.health = health or (lambda: None)
        self.samples = samples  # samples consumed by updates so far
        self.controller = controller
        self.ledger = ledger or SampleLedger()
        self.measure_generation = measure_generation or (lambda step, record: None)
        self.group_filter = group_filter
        self.dropped: dict[str, int] = dict(dropped or {})
        self.reward_errors: dict[str, int] = {}  # completions whose reward failed, by reason (whole run)
        self.on_concurrency = on_concurrency or (lambda c: None)
        self.publish = publish or (lambda params: params)
        self.before_update = before_update
        self._check_batch_size(gate.batch_size)

    @property
    def batch_size(self) -> int:
        """Samples per update in force (the gate's, as the controller last decided)."""
        return self.gate.batch_size

    def _check_batch_size(self, batch_size: int) -> None:
        s = self.settings
        if batch_size % s.group_size or batch_size % s.microbatch_size:
            raise ValueError(f"batch_size {batch_size} must be a multiple of group_size ({s.group_size}) "
                             f"and microbatch_size ({s.microbatch_size})")

    def set_batch_size(self, batch_size: int) -> None:
        self._check_batch_size(batch_size)
        self.gate.set_batch_size(batch_size)

    def apply(self, state, decision: Decision):
        """Apply a controller decision between steps: no recompilation (fixed microbatch shapes,
        injected optimizer hyperparameters)."""
        if decision.batch_size is not None and decision.batch_size != self.batch_size:
            self.set_batch_size(decision.batch_size)
        if decision.hyperparams is not None:
            state = self.train_step.set_hyperparams(state, **decision.hyperparams.as_kwargs())
        if decision.concurrency is not None:
            self.on_concurrency(decision.concurrency)
        return state

    def collect(self, stop: threading.Event | None = None) -> Batch:
        """Block until exactly batch_size samples of acceptable staleness are in hand."""
        G = self.settings.group_size
        need = self.batch_size // G
        step = self.gate.steps_taken
        groups, staleness, dropped = [], [], 0
        t0 = time.perf_counter()
        while len(groups) < need:
            self.health()  # first: a failed actor sets stop too, and its own error is the news
            if stop is not None and stop.is_set():
                raise StopRequested("stopped while waiting for samples")
            group = self.transport.get(timeout=0.1)
            if group is None:
                continue
            if self.gate.is_too_stale(group.policy_version, step):
                reason = "stale"
                dropped += 1
            else:
                reason = self.group_filter(group) if self.group_filter is not None else None
            if reason is not None:
                self.gate.drop(len(group.rewards))
                self.ledger.drop(group, reason)
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
                continue
            groups.append(group)
            staleness.append(step - group.policy_version)
        wait = time.perf_counter() - t0
        with self.ledger.lock:
            for g in groups:
                self.ledger.consume(g, step + 1)  # the update that produces version step + 1
        self.gate.take_batch(need * G)
        return Batch(groups, staleness, dropped, wait)

    def train_on(self, state, batch: Batch):
        s = self.settings
        t0 = time.perf_counter()
        units = self.controller.gradient_units if self.controller is not None else 0
        microbatches, stats = layout_microbatches(batch.groups, s.seq_len, s.microbatch_size, s.microbatch_tokens,
                                                  s.pad_id, s.grpo, units, s.separate_flat, s.share_prompts)
        if self.before_update is not None:
            self.before_update()
        # The layout keeps its units every update (a steady cost); the step measures them when asked.
        objective = (self.controller.gradient_objective(int(state.step) + 1, max(batch.staleness) > 0)
                     if units else None)
        state, metrics = self.train_step.update(state, microbatches, stats["num_tokens"],
                                                units=stats.get("unit_microbatches") if objective else None,
                                                unit_objective=objective or "trained")
        train_seconds = time.perf_counter() - t0
        self.samples += sum(len(g.rewards) for g in batch.groups)
        rewards = np.concatenate([np.asarray(g.rewards, np.float64) for g in batch.groups])
        exact = [e for g in batch.groups for e in (g.exact_match or [])]
        seq_tokens = sum(len(g.prompt_tokens) * len(g.rewards) + len(g.completion_tokens.values)
                         for g in batch.groups)
        out = {k: _scalar(v) for k, v in metrics.items() if _scalar(v) is not None}
        out.update({
            "samples": self.samples,
            "batch_size": len(rewards),
            "reward/mean": float(rewards.mean()),
            "train/exact_match": float(np.mean(exact)) if exact else None,
            "staleness/mean": float(np.mean(batch.staleness)),
            "staleness/max": int(np.max(batch.staleness)),
            "staleness/hist": np.bincount(batch.staleness).tolist(),
            "dropped_stale": batch.dropped_stale,
            "learner/wait_seconds": batch.wait_seconds,
            "learner/train_seconds": train_seconds,
            "learner/tokens_per_second": seq_tokens / max(train_seconds, 1e-9),
        })
        if "truncation_kl" in stats:  # top-p's share of the sampler/learner mismatch
            out["truncation_kl"] = stats["truncation_kl"]
        if "row_fill" in stats:  # packing: real tokens / tokens the learner computed
            out["learner/row_fill"] = stats["row_fill"]
        if "shared_prompt_tokens" in stats:  # prompt copies the shared layout did not compute
            out["learner/shared_prompt_tokens"] = stats["shared_prompt_tokens"]
        if units:  # 0: the update's gradient norms are not a noise reading (Observation.gradients None)
            out["noise/measured"] = int(objective is not None)
        if "unit_tokens" in metrics:  # whole-group units: each one's share of the loss's normalizer
            sizes = stats["unit_samples"]
            per_token = s.grpo.aggregation == "token_mean"
            out["unit_samples"] = sizes
            out["unit_share"] = ([t / max(float(stats["num_tokens"]), 1.0) for t in metrics["unit_tokens"]]
                                 if per_token else [n / sum(sizes) for n in sizes])
        out.update(self._task_metrics(batch.groups))
        return state, out

    def _task_metrics(self, groups) -> dict:
        """reward/errors/<reason> (completions of this batch whose reward failed; the run's totals
        stay in self.reward_errors) and task/<name> (means over the batch's completions of the
        task's own per-completion metrics)."""
        out: dict = {}
        for g in groups:
            for reason in g.reward_errors or ():
                if reason:
                    out[f"reward/errors/{reason}"] = out.get(f"reward/errors/{reason}", 0) + 1
                    self.reward_errors[reason] = self.reward_errors.get(reason, 0) + 1
        # A metric a completion does not report counts as 0 for it (e.g. tool_use on a direct answer).
        n = sum(len(g.rewards) for g in groups)
        sums: dict[str, float] = {}
        for g in groups:
            for name, values in (g.task_metrics or {}).items():
                sums[name] = sums.get(name, 0.0) + float(np.sum(values))
        out.update({f"task/{name}": total / n for name, total in sums.items()})
        return out

    def run(self, state, num_steps: int, on_step: Callable[[int, Any, dict], bool] | None = None,
            stop: threading.Event | None = None, start_step: int = 0):
        """Train until num_steps updates are done (or on_step returns True). Returns the state."""
        for step in range(start_step, num_steps):
            try:
                batch = self.collect(stop)
            except StopRequested:
                break  # graceful: the caller checkpoints the last completed step
            state, metrics = self.train_on(state, batch)
            version = step + 1
            self.weights.publish(self.publish(state.params), version)
            metrics["step"] = version
            generation = self.measure_generation(version, metrics)
            metrics.update({f"dropped/{reason}": n for reason, n in self.dropped.items()})  # cumulative, by reason
            if self.controller is not None:
                decision = self.controller.update(observation(version, metrics, generation))
                metrics.update(self.controller.metrics())
                if decision is not None:
                    state = self.apply(state, decision)
                    metrics["controller/decision"] = decision.reason
            if on_step is not None and on_step(version, state, metrics):
                break
        return state


def observation(step: int, metrics: dict, generation: Generation | None = None) -> Observation:
    """The controller's view of one update, from the record train_on built (the train step's
    metrics by name: the one place they are read for the controller)."""
    m = metrics
    grads = None
    if m.get("microbatch_grad_norm_sq") is not None and m.get("noise/measured", 1):
        units = m.get("unit_share") is not None
        grads = GradientNorms(float(m["grad_norm_sq"]), tuple(m["microbatch_grad_norm_sq"]),
                              tuple(m["microbatch_tokens"]),
                              unit_grad_norm_sq=tuple(m["unit_grad_norm_sq"]) if units else (),
                              unit_share=tuple(m["unit_share"]) if units else (),
                              unit_samples=tuple(int(n) for n in m["unit_samples"]) if units else (),
                              unit_batch_grad_norm_sq=m.get("unit_batch_grad_norm_sq"))
    computed = None
    if m.get("skipped_microbatches") is not None and m.get("num_microbatches"):
        computed = 1.0 - float(m["skipped_microbatches"]) / float(m["num_microbatches"])
    return Observation(step=step, batch_size=int(m["batch_size"]), train_seconds=m.get("learner/train_seconds"),
                       tokens=float(m.get("tokens", 0)), computed_fraction=computed, gradients=grads, ess=m.get("ess"),
                       clip_frac=m.get("clip_frac"), staleness_mean=m.get("staleness/mean"),
                       staleness_max=m.get("staleness/max"), learning_rate=m.get("learning_rate"),
                       generation=generation)


def _scalar(v):
    """Host float/int for metrics; lists stay lists; anything else is left out."""
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [float(x) for x in v]
    try:
        arr = np.asarray(v)
    except Exception:
        return None
    if arr.ndim == 0:
        return arr.item()
    return arr.astype(float).tolist() if arr.size <= 64 else None
