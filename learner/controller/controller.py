"""The batch-size controller: measure after every update, decide every W updates, rescale Adam.

    ctrl = BatchSizeController(cfg.controller, cfg.learner, num_actors=2, concurrency=16)
    decision = ctrl.update(observation)   # learner.loop calls this; None = nothing to do
    record.update(ctrl.metrics())         # controller/noise_scale, ... (and at decisions action, scores)

The interface it implements (Observation in, Decision out) and its use are in
learner/controller/interface.py. Per update it feeds the estimators (noise scale, learner and
generation throughput) and the guard windows (ESS, clip fraction, staleness) and keeps its current
estimates for `metrics()`. Every `window` updates it decides: a hold (with its reason) or a change
of B by k = 2 or 1/2 with the scaling rule's lr, betas and eps, computed from the reference point
(base batch size, configured optimizer), and the actors' new concurrency; a change is a probe where
B alone cannot feed the rule (one group per update: no noise scale; the learner timed at one B:
no fixed cost). Every decision, kept or changed, is appended to `decisions` with its inputs.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from cadence.learner.config import LearnerConfig
from cadence.learner.controller.config import ControllerConfig
from cadence.learner.controller.decision import candidate_batch_sizes, choose_batch_size
from cadence.learner.controller.interface import AdamHyperparams, Decision, Observation
from cadence.learner.controller.noise import NoiseScaleEstimator
from cadence.learner.controller.scaling import lr_shortfall, max_k, optimizer_hyper, rescale
from cadence.learner.controller.throughput import (Contention, GenerationThroughput, LearnerThroughput,
                                                   pipeline_throughput)
from cadence.learner.row_plan import nearest_multiple

MAX_LOGGED = 1000  # decisions kept in the state dict


def _finite(x: float) -> float | None:
    """x, or None for inf (metrics and the decision log are JSON)."""
    return None if math.isinf(x) else x


class BatchSizeController:
    """See the module docstring.

    Args:
      cfg: the controller section.
      learner_cfg: the learner section (start batch size, group/microbatch sizes, optimizer values
        tuned at `cfg.base_batch_size or learner_cfg.batch_size`).
      num_actors: generation engines running in parallel.
      asynchronous: actors run ahead of the learner (max_staleness > 0): X = min(X_gen, X_train)
        where the sides overlap, towards 1/X = 1/X_gen + 1/X_train as far as they contend for
        the same cores (measured each update: throughput.Contention); synchronous: they alternate.
      generation, learner: throughput models (defaults: fitted online); tests pass fixed curves.
      noise: the noise-scale estimator (default: NoiseScaleEstimator(cfg.noise_ema)); tests pass fixed values.
      concurrency: the actors' prompts per call at the start (actors.prompts_per_call).
    """

    def __init__(self, cfg: ControllerConfig, learner_cfg: LearnerConfig, num_actors: int = 1,
                 asynchronous: bool = True, generation=None, learner=None, concurrency: int | None = None,
                 noise=None):
        self.cfg = cfg
        self.asynchronous = asynchronous
        self.multiple = math.lcm(learner_cfg.group_size, learner_cfg.microbatch_size)
        self.group_size = learner_cfg.group_size
        self.base_batch_size = cfg.base_batch_size or learner_cfg.batch_size
        self.base_hyper = optimizer_hyper(learner_cfg.optimizer)
        self._max_k = max_k(cfg.max_scaled_batch_size, self.base_batch_size)  # the rule's ceiling
        self.batch_size = learner_cfg.batch_size  # in force: the last update's, or the last decision's
        self.concurrency: int | None = concurrency  # in force (the observations report it)
        self.noise = noise or NoiseScaleEstimator(cfg.noise_ema)
        self.generation = generation or GenerationThroughput(num_actors, cfg.saturation_prior)
        self.learner = learner or LearnerThroughput()
        self.contention = Contention()  # how far the two sides' times add up (asynchronous)
        self.num_actors = num_actors
        self.window: collections.deque = collections.deque(maxlen=cfg.window)
        self.last_change = 0  # step of the last change (dwell counts from here)
        self.prev: dict | None = None  # previous step's cumulative generation counters
        self.decisions: list[dict] = []
        self.explored: set[int] = set()  # batch sizes moved to once by exploration (cfg.explore)
        self._needs_initial_scaling = self.base_batch_size != self.batch_size
        self._metrics: dict = {}  # the last update's estimates (metrics())

    @classmethod
    def holding(cls, cfg: ControllerConfig, learner_cfg: LearnerConfig, num_actors: int = 1,
                asynchronous: bool = True, concurrency: int | None = None) -> "BatchSizeController":
        """The controller with B fixed at learner_cfg.batch_size (and the concurrency with it): it
        still measures (noise scale, throughput: logged) and, when cfg.base_batch_size differs from
        B, applies the scaling rule's Adam values once, after the first update."""
        b = learner_cfg.batch_size
        fixed = dataclasses.replace(cfg, min_batch_size=b, max_batch_size=b, scale_concurrency=False,
                                    min_ess=0.0, max_clip_frac=1.0)
        return cls(fixed, learner_cfg, num_actors, asynchronous, concurrency=concurrency)

    # ---- the interface (learner/controller/interface.py) ----

    def course(self) -> Decision:
        return Decision(batch_size=self.batch_size, concurrency=self.concurrency)

    def update(self, obs: Observation) -> Decision | None:
        """Measure this update; every `window` updates return a Decision (a hold has only a reason)."""
        self._metrics = {}
        self.observe(obs)
        if self._needs_initial_scaling:  # start B differs from the tuned one: apply the rule once
            self._needs_initial_scaling = False
            return Decision(hyperparams=AdamHyperparams(**self.hyperparams_for(self.batch_size)),
                            reason=f"initial scaling: B {self.batch_size} vs base {self.base_batch_size}")
        if obs.step % self.cfg.window:
            return None
        return self.decide(obs.step)

    def fit(self, multiple: int, reason: str) -> Decision | None:
        """B to the nearest multiple of `multiple` (the interface's fit); logged with the decisions."""
        self.multiple = multiple  # the candidates of later decisions split over the new mesh too
        b, new = self.batch_size, nearest_multiple(self.batch_size, multiple)
        if new == b:
            return None
        c_new = self.concurrency_for(new) if self.cfg.scale_concurrency else None
        decision = Decision(batch_size=new, hyperparams=AdamHyperparams(**self.hyperparams_for(new)),
                            concurrency=c_new, reason=f"refit B {b} -> {new}: {reason}; scaling {self.cfg.scaling}")
        self.decisions.append({"step": None, "batch_size": b, "action": "refit", "reason": decision.reason,
                               "new_batch_size": new, "new_concurrency": c_new})
        del self.decisions[:-MAX_LOGGED]
        self.batch_size = new
        if c_new is not None:
            self.concurrency = c_new
        return decision

    def metrics(self) -> dict:
        return dict(self._metrics)

    @property
    def gradient_units(self) -> int:
        return self.cfg.noise_units

    def gradient_objective(self, step: int, off_policy: bool) -> str | None:
        if not off_policy:
            return "trained"
        return self.cfg.noise_objective if step % self.cfg.noise_every == 0 else None

    # ---- measurements ----

    def observe(self, obs: Observation) -> None:
        """Feed the estimators with one update and keep the estimates for metrics()."""
        b = obs.batch_size
        self.batch_size = b
        if obs.generation is not None:
            self.concurrency = obs.generation.concurrency
        warm = obs.step > self.cfg.warmup_steps
        if warm and obs.gradients is not None:
            self.noise.update_from_gradients(obs.gradients, b)
        if warm and obs.train_seconds:
            self.learner.observe(b, float(obs.train_seconds),
                                 1.0 if obs.computed_fraction is None else float(obs.computed_fraction))
        self._observe_generation(warm, obs)
        self._metrics["controller/contention"] = self.contention.value
        # keys as checkpoints hold them
        self.window.append({"ess": obs.ess, "clip_frac": obs.clip_frac, "staleness/mean": obs.staleness_mean,
                            "staleness/max": obs.staleness_max, "learning_rate": obs.learning_rate})
        interval = self.noise.noise_scale_interval
        self._metrics.update({"controller/noise_scale": self.noise.noise_scale,
                              "controller/noise_scale_low": interval and interval[0],
                              # None where unbounded (|G|^2 within noise of zero) or unmeasured
                              "controller/noise_scale_high": interval and _finite(interval[1]),
                              "controller/grad_sq": self.noise.grad_sq,
                              "controller/trace_sigma": self.noise.trace_sigma})

    def _observe_generation(self, warm: bool, obs: Observation) -> None:
        gen = obs.generation
        if gen is None:
            return
        cur = {"wall_time": float(gen.wall_time), "gen": float(gen.generate_seconds), "c": int(gen.concurrency)}
        prev, self.prev = self.prev, cur
        if not warm or prev is None or prev["c"] != cur["c"]:  # a changed concurrency mixes two rates
            return
        tokens = float(gen.tokens_per_second) * (cur["wall_time"] - prev["wall_time"])
        busy = cur["gen"] - prev["gen"]  # summed over engines
        tokens_per_sample = float(obs.tokens) / max(obs.batch_size, 1)
        if busy > 0 and tokens > 0 and tokens_per_sample > 0:
            self.generation.observe(cur["c"], tokens / tokens_per_sample / busy)
        if obs.train_seconds:  # the engines generate side by side: their span is busy / engines
            self.contention.observe(cur["wall_time"] - prev["wall_time"], busy / self.num_actors,
                                    float(obs.train_seconds))

    def _mean(self, key: str) -> float | None:
        vals = [w[key] for w in self.window if w.get(key) is not None]
        return float(np.mean(vals)) if vals else None

    # ---- the rule ----

    def hyperparams_for(self, batch_size: int) -> dict[str, float]:
        """The scaling rule's lr, b1, b2, eps for `batch_size`, from the reference point."""
        return rescale(self.base_hyper, batch_size / self.base_batch_size, self.cfg.scaling, self._max_k)

    def lr_shortfall(self, batch_size: int) -> float:
        """The scaling rule's lr at `batch_size` over the lr its ceiling gives (1: none, or under it)."""
        return lr_shortfall(batch_size / self.base_batch_size, self.cfg.scaling, self._max_k)

    def throughput(self, batch_size: int) -> float | None:
        """Predicted pipeline samples/s at `batch_size` (actors' concurrency following B)."""
        x_train = self.learner.predict(batch_size)
        c = self.concurrency_for(batch_size)
        x_gen = self.generation.predict(c) if c is not None else None
        if x_train is None or x_gen is None:
            return None
        return pipeline_throughput(x_gen, x_train, self.asynchronous, self.contention.value or 0.0)

    def concurrency_for(self, batch_size: int) -> int | None:
        """Actors' prompts per call at `batch_size` (proportional to B when scale_concurrency)."""
        if self.concurrency is None:
            return None
        if not self.cfg.scale_concurrency:
            return self.concurrency
        c = round(self.concurrency * batch_size / self.batch_size)
        return int(min(max(c, 1), self.cfg.max_concurrency))

    def decide(self, step: int) -> Decision:
        """Apply the decision rule now; logs and returns the Decision (a hold changes nothing) and
        takes the new course as its own (the next observation reports it in force)."""
        b = self.batch_size
        ess, clip, stale = self._mean("ess"), self._mean("clip_frac"), self._mean("staleness/mean")
        bn = self.noise.noise_scale_interval  # (low, high): the rule reads the range, not the point
        entry = {"step": step, "batch_size": b, "noise_scale": self.noise.noise_scale,
                 "noise_scale_interval": None if bn is None else [bn[0], _finite(bn[1])],
                 "ess": ess, "clip_frac": clip,
                 "staleness_mean": stale, "concurrency": self.concurrency, "contention": self.contention.value,
                 "learner_cost": self.learner.cost(), "generation_curve": self.generation.curve()}
        if self.learner.computed_fraction != 1.0:  # learner.skip_zero_advantage: learner_cost is per computed sample
            entry["computed_fraction"] = self.learner.computed_fraction
        decision = self._rule(step, b, bn, ess, clip, stale, entry)
        entry.update(action=entry.get("action", "hold"), reason=decision.reason,
                     new_batch_size=decision.batch_size or b, new_concurrency=decision.concurrency)
        self.decisions.append(entry)
        del self.decisions[:-MAX_LOGGED]
        self._metrics["controller/action"] = entry["action"]
        self._metrics["controller/scores"] = entry.get("scores")
        if decision.batch_size is not None:
            self.batch_size = decision.batch_size
        if decision.concurrency is not None:
            self.concurrency = decision.concurrency
        return decision

    def _rule(self, step, b, bn, ess, clip, stale, entry) -> Decision:
        cfg = self.cfg
        if step - self.last_change < cfg.dwell:
            return Decision(reason=f"hold B={b}: dwell ({step - self.last_change} < {cfg.dwell} steps since the last change)")
        guard = None
        if ess is not None and ess < cfg.min_ess:
            guard = f"ESS {ess:.2f} < {cfg.min_ess}"
        elif clip is not None and clip > cfg.max_clip_frac:
            guard = f"clip fraction {clip:.2f} > {cfg.max_clip_frac}"
        if bn is None:
            if guard is None and cfg.noise_units >= 2 and b < 2 * self.group_size:
                probe = self._probe(step, b, entry, f"one group per update leaves no two units of whole groups "
                                                    f"to measure the noise scale from")
                if probe is not None:
                    return probe
            return Decision(reason=f"hold B={b}: noise scale not measurable yet (tr(Sigma) estimate <= 0, or "
                                   f"nothing yet says |G|^2 > 0)")
        if guard is not None:
            # Too off-policy: less in flight first (lower concurrency), B stays.
            c = self.concurrency
            if c is not None and c > 1:
                self.last_change = step
                entry["action"] = "halve_concurrency"
                return Decision(concurrency=c // 2, reason=f"hold B={b}: {guard}; concurrency {c} -> {c // 2}")
            return Decision(reason=f"hold B={b}: {guard}")
        if self.throughput(b) is None:
            return Decision(reason=f"hold B={b}: throughput not measured yet")
        cands = candidate_batch_sizes(b, cfg.min_batch_size, cfg.max_batch_size, self.multiple)
        if cfg.max_staleness_lr > 0 and stale is not None:
            # mean lag in versions ~ samples in line / B: it scales as B / B'
            cands = [c for c in cands if c == b or
                     stale * b / c * self.hyperparams_for(c)["learning_rate"] <= cfg.max_staleness_lr]
        cands = [c for c in cands if self.throughput(c) is not None]
        best, scores = choose_batch_size(b, cands, bn, self.throughput, cfg.hysteresis, self.lr_shortfall)
        entry["scores"] = {str(k): v for k, v in scores.items()}
        if len(self.learner.batch_sizes()) == 1:
            probe = self._probe(step, b, entry, "the learner's time measured at one batch size says nothing of "
                                                "its fixed cost (X would be flat in B)")
            if probe is not None:
                return probe
        gain = 1.0 - scores[best]
        if best == b:
            explore = self._explore(step, b, scores, entry, bn)
            if explore is not None:
                return explore
            alt = min(scores, key=scores.get)
            why = "current B is fastest" if alt == b else (
                f"B={alt} only {1 - scores[alt]:.1%} faster (hysteresis {cfg.hysteresis:.0%})")
            return Decision(reason=f"hold B={b}: {why}; B_noise {self._bn_text(bn)}")
        action = "grow" if best > b else "shrink"
        return self._move(step, entry, action, best, f"{action} B {b} -> {best}: predicted {gain:.1%} faster to "
                                                     f"target; B_noise {self._bn_text(bn)}, scaling {cfg.scaling}")

    def _move(self, step: int, entry: dict, action: str, new: int, reason: str) -> Decision:
        """The Decision changing B to `new` (the rule's Adam values, the actors' concurrency with it),
        logged as `action`; the dwell counts from here."""
        self.last_change = step
        entry["action"] = action
        c_new = self.concurrency_for(new) if self.cfg.scale_concurrency else None
        return Decision(batch_size=new, hyperparams=AdamHyperparams(**self.hyperparams_for(new)), concurrency=c_new,
                        reason=reason)

    @staticmethod
    def _bn_text(bn: tuple[float, float]) -> str:
        """B_noise's range as a reason gives it."""
        low, high = bn
        if low == high:
            return f"{low:.0f}"
        return f">= {low:.0f} (|G|^2 within noise of 0)" if math.isinf(high) else f"{low:.0f}-{high:.0f}"

    def _probe(self, step: int, b: int, entry: dict, why: str) -> Decision | None:
        """Move to the neighbouring B to measure there, where the rule cannot be applied from B
        alone (cfg.probe): B/2, else (B at the floor, or one group per update) 2B. Either gives
        the learner's time a second point; the smaller B is the safe side, since the scaling
        rule's lr falls with it: sort-6 from B = 256 probed 512, where the sqrt rule's Adam values
        (tuned at 128) stall learning (fixed B = 512 reaches the target in 1-2 of 3 seeds), and
        the damage outlasted the probe (docs/controller.md). A probe is a measurement; only the rule's
        predicted gain moves B up. None when there is no neighbour."""
        cands = [c for c in candidate_batch_sizes(b, self.cfg.min_batch_size, self.cfg.max_batch_size,
                                                  self.multiple) if c != b]
        if not self.cfg.probe or not cands:
            return None
        target = min(cands)
        return self._move(step, entry, "probe", target,
                          f"probe B {b} -> {target}: {why}; scaling {self.cfg.scaling}")

    def _explore(self, step: int, b: int, scores: dict, entry: dict, bn) -> Decision | None:
        """Move once to a neighbouring B the learner was never timed at (its X an extrapolation from
        other batch sizes) when that B is predicted faster at the end of B_noise's range most in its
        favour, though not by the margin at the other end (cfg.explore): a measurement there
        settles the throughput half of the question. None when there is nothing to explore."""
        measured = self.learner.batch_sizes()
        if not self.cfg.explore or not measured:  # no measurements (a given curve): nothing to explore
            return None
        cands = [c for c in scores if c != b and c not in measured and c not in self.explored]
        if not cands:
            return None
        _, hopeful = choose_batch_size(b, cands, (bn[1], bn[0]), self.throughput, 0.0,  # the other ends
                                       self.lr_shortfall)
        cands = [c for c in cands if hopeful[c] < 1.0]
        if not cands:
            return None
        c = min(cands, key=hopeful.get)
        self.explored.add(c)
        entry["explore_scores"] = {str(k): v for k, v in hopeful.items()}
        return self._move(step, entry, "explore", c,
                          f"explore B {b} -> {c}: predicted {1 - hopeful[c]:.1%} faster at B_noise's other end, "
                          f"{scores[c] - 1:+.1%} at this one, but the learner was never timed at {c}; "
                          f"B_noise {self._bn_text(bn)}, scaling {self.cfg.scaling}")

    # ---- checkpointing ----

    def state_dict(self) -> dict:
        """Everything needed to continue as if nothing happened (JSON-serializable)."""
        return {"batch_size": self.batch_size, "concurrency": self.concurrency,
                "last_change": self.last_change, "prev": self.prev,
                "needs_initial_scaling": self._needs_initial_scaling,
                "window": list(self.window), "noise": self.noise.state_dict(),
                "generation": self.generation.state_dict(), "learner": self.learner.state_dict(),
                "contention": self.contention.state_dict(), "decisions": list(self.decisions),
                "explored": sorted(self.explored)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict returned. A state with only the course (batch_size and
        concurrency: a checkpoint of a run with a fixed batch size) starts the estimators afresh there."""
        self.batch_size = int(state["batch_size"])
        self.concurrency = state["concurrency"]
        if "noise" not in state:
            return
        self.last_change = int(state["last_change"])
        self.prev = state["prev"]
        self._needs_initial_scaling = bool(state["needs_initial_scaling"])
        self.window.clear()
        self.window.extend(state["window"])
        self.noise.load_state_dict(state["noise"])
        self.generation.load_state_dict(state["generation"])
        self.learner.load_state_dict(state["learner"])
        if "contention" in state:  # checkpoints before it: measured afresh
            self.contention.load_state_dict(state["contention"])
        self.decisions = list(state["decisions"])
        self.explored = {int(b) for b in state.get("explored", ())}  # checkpoints before it: none yet
