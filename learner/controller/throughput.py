"""Online throughput models of the two sides of the pipeline, in samples per second.

Generation (per engine, as a function of concurrency c = prompts per call):
    X_gen(c) = c r1 / (1 + c / c_sat)      linear while memory-bound, flat once compute-bound
  fitted as 1 / X = (1 / r1) (1 / c) + 1 / (r1 c_sat), least squares over the measured c's.
Learner (as a function of the batch size B):
    t_step(B) = t_fix + B t_sample,   X_train(B) = B / t_step(B)
Each measured point is an EMA per distinct c (or B), so a model re-probes a concurrency or batch
size it returns to, and its state stays small (a checkpoint holds it).
"""
from __future__ import annotations

import math

import numpy as np


class _EMA:
    """A bias-corrected EMA of one value (None until the first)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.sum, self.weight = 0.0, 0.0

    def add(self, y: float) -> None:
        self.sum = self.decay * self.sum + (1 - self.decay) * y
        self.weight = self.decay * self.weight + (1 - self.decay)

    @property
    def value(self) -> float | None:
        return self.sum / self.weight if self.weight > 0 else None

    def state_dict(self) -> dict:
        return {"decay": self.decay, "sum": self.sum, "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.sum, self.weight = float(state["decay"]), float(state["sum"]), float(state["weight"])


class _PointEMA:
    """EMA of y per distinct x."""

    def __init__(self, decay: float, allow_zero: bool = False):
        self.decay = decay
        self.allow_zero = allow_zero  # a rate or a time must be > 0; a fraction may be 0
        self.points: dict[int, list[float]] = {}  # x -> [ema of y, weight, count]

    def add(self, x: int, y: float) -> None:
        if not (math.isfinite(y) and (y > 0 or (self.allow_zero and y == 0))):
            return
        p = self.points.setdefault(int(x), [0.0, 0.0, 0])
        p[0] = self.decay * p[0] + (1 - self.decay) * y
        p[1] = self.decay * p[1] + (1 - self.decay)
        p[2] += 1

    def means(self) -> tuple[np.ndarray, np.ndarray]:
        xs = sorted(self.points)
        return (np.array(xs, np.float64),
                np.array([self.points[x][0] / self.points[x][1] for x in xs], np.float64))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "points": [[x, *p] for x, p in sorted(self.points.items())]}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self.points = {int(x): [float(y), float(w), int(n)] for x, y, w, n in state["points"]}


class GenerationThroughput:
    """Samples/s of the generation side at concurrency c (num_engines engines in parallel).

    Args:
      num_engines: engines generating in parallel (actors); X_gen is per engine times this.
      saturation_prior: c_sat / c assumed while only one concurrency has been measured.
      decay: EMA decay of each measured point.
    """

    def __init__(self, num_engines: int = 1, saturation_prior: float = 1.0, decay: float = 0.8):
        self.num_engines = num_engines
        self.saturation_prior = saturation_prior
        self.ema = _PointEMA(decay)

    def observe(self, concurrency: int, samples_per_second: float) -> None:
        """One engine's measured rate while busy (samples per second of engine time) at `concurrency`."""
        self.ema.add(concurrency, samples_per_second)

    def curve(self) -> tuple[float, float] | None:
        """(r1, c_sat) of the fitted per-engine curve; c_sat = inf when not saturating; None if unmeasured."""
        cs, rates = self.ema.means()
        if len(cs) == 0:
            return None
        if len(cs) == 1:
            c0, x0 = cs[0], rates[0]
            c_sat = self.saturation_prior * c0
            return float(x0 * (1 + c0 / c_sat) / c0), float(c_sat)
        a, b = np.polyfit(1.0 / cs, 1.0 / rates, 1)  # 1/X = a (1/c) + b
        if a <= 0:  # rate does not grow with c: flat at the best measured rate
            return float(rates.max() * 1e6), float(cs[np.argmax(rates)] * 1e-6)
        r1 = 1.0 / a
        c_sat = math.inf if b <= 0 else 1.0 / (r1 * b)
        return float(r1), float(c_sat)

    def predict(self, concurrency: float) -> float | None:
        """Predicted samples/s of all engines at `concurrency` (None before any measurement)."""
        fit = self.curve()
        if fit is None:
            return None
        r1, c_sat = fit
        return self.num_engines * concurrency * r1 / (1 + concurrency / c_sat)

    def state_dict(self) -> dict:
        return {"num_engines": self.num_engines, "saturation_prior": self.saturation_prior,
                "ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.num_engines = int(state["num_engines"])
        self.saturation_prior = float(state["saturation_prior"])
        self.ema.load_state_dict(state["ema"])


class LearnerThroughput:
    """Samples/s of the learner at batch size B: t_step = t_fix + f B t_sample.

    f is the fraction of the batch the learner ran gradient passes on: 1, except where
    learner.skip_zero_advantage skips the microbatches whose groups have equal rewards, and then
    it follows the reward's sparsity, not B (SmolLM2's word problems: most groups flat at the
    start, fewer as the policy learns). Each B's time is fitted against the samples computed there
    (B f at that B), and predicted at the fraction of the recent updates: otherwise a B measured
    early, when most of its groups were skipped, reads as cheap per sample against one measured
    later. With one measured B the fixed cost cannot be separated: t_fix = 0 (X_train flat in B).
    """

    def __init__(self, decay: float = 0.8):
        self.ema = _PointEMA(decay)
        self.fraction_ema = _PointEMA(decay, allow_zero=True)  # per B: f while measured there
        self.recent_fraction = _EMA(decay)  # f of the recent updates, any B

    def observe(self, batch_size: int, step_seconds: float, computed_fraction: float = 1.0) -> None:
        """One update of `batch_size` samples took `step_seconds` of learner time, with gradient
        passes on `computed_fraction` of the batch."""
        if not (math.isfinite(step_seconds) and step_seconds > 0 and 0.0 <= computed_fraction <= 1.0):
            return
        self.ema.add(batch_size, step_seconds)
        self.fraction_ema.add(batch_size, computed_fraction)
        self.recent_fraction.add(computed_fraction)

    @property
    def computed_fraction(self) -> float:
        """The recent updates' computed fraction f (1 before any measurement)."""
        f = self.recent_fraction.value
        return 1.0 if f is None else f

    def batch_sizes(self) -> list[int]:
        """The batch sizes measured so far."""
        return sorted(self.ema.points)

    def cost(self) -> tuple[float, float] | None:
        """(t_fix seconds, t_sample seconds per computed sample), or None before any measurement
        (or while every update measured skipped its whole batch)."""
        bs, ts = self.ema.means()
        if len(bs) == 0:
            return None
        fb, fs = self.fraction_ema.means()
        frac = dict(zip(fb.tolist(), fs.tolist()))
        ns = np.array([b * frac.get(b, 1.0) for b in bs.tolist()], np.float64)  # samples computed
        some = ns > 0
        if not some.any():  # every update skipped whole: the per-sample cost is unmeasured
            return None
        per_sample = float(np.mean(ts[some] / ns[some]))
        if len(bs) == 1 or np.ptp(ns) <= 0:
            return 0.0, per_sample
        slope, intercept = np.polyfit(ns, ts, 1)
        if slope <= 0:  # noise swamped the per-sample cost: treat as per-sample only
            return 0.0, per_sample
        if intercept < 0:  # no negative fixed cost: refit through the origin
            return 0.0, float(np.sum(ns * ts) / np.sum(ns * ns))
        return float(intercept), float(slope)

    def predict(self, batch_size: float) -> float | None:
        """Predicted learner samples/s at `batch_size` (None before any measurement)."""
        c = self.cost()
        if c is None:
            return None
        t_fix, t_sample = c
        t = t_fix + batch_size * self.computed_fraction * t_sample
        return batch_size / t if t > 0 else None

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "fraction_ema": self.fraction_ema.state_dict(),
                "recent_fraction": self.recent_fraction.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])
        if "fraction_ema" in state:  # checkpoints before it: every update computed whole (f = 1)
            self.fraction_ema.load_state_dict(state["fraction_ema"])
            self.recent_fraction.load_state_dict(state["recent_fraction"])


def pipeline_throughput(x_gen: float, x_train: float, asynchronous: bool, contention: float = 0.0) -> float:
    """Samples/s of the whole pipeline. Per sample it takes the slower side's time plus `contention`
    (0..1) times the faster side's: 0 where the two overlap on hardware of their own (X = the
    slower side's rate), 1 where they alternate (synchronous, or actors running ahead on the
    learner's own cores: 1/X = 1/X_gen + 1/X_train)."""
    k = contention if asynchronous else 1.0
    a, b = 1.0 / x_gen, 1.0 / x_train
    return 1.0 / (max(a, b) + k * min(a, b))


class Contention:
    """How far the two sides' times add up when the actors run ahead of the learner, measured.

    Each update's wall time tau against its two sides' busy times (generation span t_gen, learner
    t_train): tau ~ max + k min, so k = (tau - max) / min, clipped to [0, 1] and averaged (EMA).
    Near 0 the sides overlap (actors on devices of their own); towards 1 they take turns on shared
    cores (actor threads beside SmolLM2's learner on 2 CPU cores: 0.2-1.0 by B, where assuming 0
    over-predicted X(B) up to 1.7x: docs/controller.md). None until measured; the pipeline model
    then assumes overlap (0)."""

    def __init__(self, decay: float = 0.8):
        self._ema = _EMA(decay)

    def observe(self, wall_seconds: float, generation_seconds: float, train_seconds: float) -> None:
        short, long = sorted((generation_seconds, train_seconds))
        if not (short > 0 and wall_seconds > 0 and math.isfinite(wall_seconds)):
            return
        self._ema.add(min(max((wall_seconds - long) / short, 0.0), 1.0))

    @property
    def value(self) -> float | None:
        return self._ema.value

    def state_dict(self) -> dict:
        return self._ema.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._ema.load_state_dict(state)
