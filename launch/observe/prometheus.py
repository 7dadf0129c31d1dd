"""Prometheus /metrics for a running Cadence run (prometheus-client; `run.prometheus_port`).

    sink = PrometheusSink("127.0.0.1", 9400)   # serves http://127.0.0.1:9400/metrics
    sink.write(record)                          # each metrics record; a scrape sees the newest values
    sink.close()

A scrape reads one consistent snapshot of the newest record. Known keys get named gauges
(cadence_step, cadence_reward_mean, ... in GAUGES); every other number in the records is exported
too, as cadence_<key with / -> _>; per-actor keys `actor/<id>/<name>` become
cadence_actor_<name>{actor="<id>"}. A gauge appears when its key first appears.

What a value means decides how it is kept:
  - per batch (most keys: reward/mean, task/<name>, reward/errors/<reason>, ...): the newest
    record's value, and 0 once a newer record lacks the key (a batch without reward errors has
    no reward/errors/* keys: its gauges read 0, not the last batch that had some);
    reward/errors/<reason> is cadence_reward_errors_batch{reason} and also the counter
    cadence_reward_errors_total{reason}: the sum over every record this process exported;
  - held between records (HELD_PREFIXES: evaluations, checkpoints, the controller, the warm-up,
    per-actor keys): the last value reported (held-out exact match stays at its last evaluation);
  - cumulative counts the run keeps (COUNTERS: dropped/<reason>, actors/reissued): counters,
    cadence_dropped_total{reason}, cadence_actors_reissued_total.
Two gauges are computed at scrape time: cadence_seconds_since_checkpoint and
cadence_seconds_since_last_step.
"""
from __future__ import annotations

import re
import threading
import time

# record key -> (gauge name, help)
GAUGES = {
    "step": ("cadence_step", "RL updates done"),
    "samples": ("cadence_samples", "samples consumed by updates"),
    "wall_time": ("cadence_wall_time_seconds", "seconds since the run started (a resumed run continues its clock)"),
    "reward/mean": ("cadence_reward_mean", "mean reward of the newest training batch"),
    "eval/exact_match": ("cadence_eval_exact_match", "held-out greedy exact match at the last evaluation"),
    "eval/reward": ("cadence_eval_reward", "held-out greedy mean reward at the last evaluation"),
    "staleness/mean": ("cadence_staleness_mean", "mean policy-version lag of the newest batch"),
    "staleness/max": ("cadence_staleness_max", "largest policy-version lag in the newest batch"),
    "queue/depth": ("cadence_queue_depth", "groups generated and waiting for the learner"),
    "actors/tokens_per_second": ("cadence_generation_tokens_per_second", "tokens generated per second, all actors"),
    "learner/tokens_per_second": ("cadence_training_tokens_per_second", "tokens trained per second in the newest update"),
    "batch_size": ("cadence_batch_size", "samples per update"),
    "learning_rate": ("cadence_learning_rate", "Adam learning rate"),
    "actors/alive": ("cadence_actors_alive", "actors currently producing samples"),
    "dropped_stale": ("cadence_dropped_stale_batch", "groups dropped as too stale while filling the newest batch"),
    "controller/noise_scale": ("cadence_noise_scale", "the controller's gradient noise scale estimate (samples)"),
}
CHECKPOINT_TIME = "checkpoint/last_saved_at"  # unix time of the newest complete checkpoint
_LABELLED = [(re.compile(r"^actor/([^/]+)/(.+)$"), "cadence_actor_{}", "actor"),
             (re.compile(r"^reward/errors/([^/]+)$"), "cadence_reward_errors_batch", "reason")]
# keys whose last value stands until the next one reports it (not per batch)
HELD_PREFIXES = ("eval/", "checkpoint/", "controller/", "sft/", "actor/")
# cumulative counts in the records -> (counter name without _total, label or None, help)
COUNTERS = [(re.compile(r"^dropped/([^/]+)$"), "cadence_dropped", "reason",
             "groups dropped, by reason (cumulative over the run)"),
            (re.compile(r"^actors/reissued$"), "cadence_actors_reissued", None,
             "prompts re-issued after an actor was lost (cumulative)")]
# per-batch counts summed into counters here -> (counter name, label, help)
SUMMED = [(re.compile(r"^reward/errors/([^/]+)$"), "cadence_reward_errors", "reason",
           "completions whose reward failed, by reason (summed over the records this process exported)")]


def metric_name(key: str) -> str:
    """The generic gauge name of a record key: cadence_ + the key with every other character as _."""
    return "cadence_" + re.sub(r"[^a-zA-Z0-9]+", "_", key).strip("_").lower()


class RecordCollector:
    """A prometheus-client collector over the newest value of every numeric record key."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        self._totals: dict[str, float] = {}  # SUMMED keys: the sum over every record
        self._last_record_at: float | None = None

    def update(self, values: dict[str, float]) -> None:
        """One record's numbers: per-batch keys it lacks drop to 0, held keys stay."""
        with self._lock:
            for key in self._latest:
                if key not in values and not key.startswith(HELD_PREFIXES) and not _counter(key):
                    self._latest[key] = 0.0
            self._latest.update(values)
            for key, value in values.items():
                if any(pattern.match(key) for pattern, *_ in SUMMED):
                    self._totals[key] = self._totals.get(key, 0.0) + value
            self._last_record_at = time.time()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            latest, totals, last_at = dict(self._latest), dict(self._totals), self._last_record_at
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def family(name, doc, labels=(), kind=GaugeMetricFamily):
            if name not in families:
                families[name] = kind(name, doc, labels=list(labels))
            return families[name]

        def count(rules, values):
            for key, value in values.items():
                for pattern, name, label, doc in rules:
                    m = pattern.match(key)
                    if m:
                        family(name, doc, [label] if label else [], CounterMetricFamily).add_metric(
                            [m.group(1)] if label else [], value)

        count(COUNTERS, latest)
        count(SUMMED, totals)
        named = {name for name, _ in GAUGES.values()}
        for key, value in latest.items():
            if key == CHECKPOINT_TIME or _counter(key):
                continue
            if key in GAUGES:
                name, doc = GAUGES[key]
                family(name, doc).add_metric([], value)
                continue
            for pattern, fmt, label in _LABELLED:
                m = pattern.match(key)
                if m:
                    name = fmt.format(re.sub(r"[^a-zA-Z0-9]+", "_", m.group(m.lastindex)).lower())
                    family(name, f"per-{label} metrics keys {pattern.pattern}", [label]).add_metric(
                        [m.group(1)], value)
                    break
            else:
                name = metric_name(key)
                if name not in named:
                    family(name, f"metrics.jsonl key {key!r} (newest value)").add_metric([], value)
        now = time.time()
        if latest.get(CHECKPOINT_TIME) is not None:
            family("cadence_seconds_since_checkpoint", "seconds since the newest complete checkpoint").add_metric(
                [], now - latest[CHECKPOINT_TIME])
        if last_at is not None:
            family("cadence_seconds_since_last_step", "seconds since the run reported its newest update").add_metric(
                [], now - last_at)
        yield from families.values()


def _counter(key: str) -> bool:
    return any(pattern.match(key) for pattern, *_ in COUNTERS)


class PrometheusSink:
    name = "prometheus"

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self.collector = RecordCollector()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        # an OSError here (port in use, address not on this machine) disables this sink only
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port

    def write(self, record: dict, values: dict[str, float]) -> None:
        self.collector.update(values)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
