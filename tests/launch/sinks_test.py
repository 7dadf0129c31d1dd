"""Metric sinks: what each one writes reads back the same; a failing sink is switched off, not fatal."""
import json
import os
import time
import urllib.request

import pytest

from cadence.launch.config import load_config
from cadence.launch.config_loader import ConfigError
from cadence.launch.observe.heartbeat import Heartbeat
from cadence.launch.metrics import MetricsWriter, read_metrics
from cadence.launch.observe.prometheus import PrometheusSink, RecordCollector
from cadence.launch.observe.sinks import Sinks, TensorBoardSink, open_sinks, scalars
from tests.sink_readers import tensorboard_events, tensorboard_scalars

RECORDS = [
    {"step": 0, "samples": 0, "wall_time": 1.5, "eval/exact_match": 0.05, "sft/loss": 2.25},
    {"step": 1, "samples": 128, "wall_time": 2.0, "reward/mean": 0.125, "staleness/hist": [3, 13],
     "controller/decision": "hold B=128: dwell", "train/exact_match": None, "learning_rate": 1e-3,
     "dropped/stale": 2, "actor/3/samples_per_second": 41.5},
    {"step": 2, "samples": 256, "wall_time": 2.7, "reward/mean": 0.25, "loss": float("nan"),
     "learning_rate": 1e-3, "checkpoint/last_saved_at": 1.0e9},
]


def test_scalars_keeps_finite_numbers_and_flattens_dicts():
    got = scalars({"a": 1, "b": 2.5, "c": None, "d": [1, 2], "e": "text", "f": float("inf"),
                   "g": {"h": 3, "i": {"j": 4.0}}, "k": True})
    assert got == {"a": 1.0, "b": 2.5, "g/h": 3.0, "g/i/j": 4.0, "k": 1.0}


def test_tensorboard_event_files_hold_the_records_values(tmp_path):
    sink = TensorBoardSink(str(tmp_path), {"run": {"steps": 2}}, purge_step=None)
    for r in RECORDS:
        sink.write(r, scalars(r))
    sink.close()
    tb = tensorboard_scalars(str(tmp_path / "tensorboard"))
    expected = {}
    for r in RECORDS:
        for k, v in scalars(r).items():
            if k != "step":
                expected.setdefault(k, {})[r["step"]] = v
    assert set(tb) == set(expected)
    for tag, by_step in expected.items():
        assert tb[tag] == pytest.approx(by_step, rel=1e-6), tag  # TensorBoard stores float32


def test_tensorboard_after_a_resume_keeps_only_the_redone_steps(tmp_path):
    first = TensorBoardSink(str(tmp_path), {}, purge_step=0)
    for s in range(6):  # steps 4 and 5 are lost: the checkpoint was at step 3
        first.write({"step": s}, {"reward/mean": float(s)})
    first.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    resumed = TensorBoardSink(str(tmp_path), {}, purge_step=4)
    for s in range(4, 8):
        resumed.write({"step": s}, {"reward/mean": 10.0 + s})
    resumed.close()
    got = tensorboard_events(str(tmp_path / "tensorboard"))["reward/mean"]
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0), (7, 17.0)]


def _sinks(tmp_path, factories, warnings):
    hb = Heartbeat(str(tmp_path), interval=60).start()
    return Sinks(MetricsWriter(str(tmp_path / "metrics.jsonl")), factories, hb, warn=warnings.append)


class Recording:
    name = "recording"

    def __init__(self):
        self.seen, self.closed = [], False

    def write(self, record, values):
        self.seen.append(record["step"])

    def close(self):
        self.closed = True


class Raising:
    name = "raising"

    def __init__(self, fail_at):
        self.fail_at, self.calls = fail_at, 0

    def write(self, record, values):
        self.calls += 1
        if record["step"] >= self.fail_at:
            raise ConnectionError("no route to host")

    def close(self):
        raise ConnectionError("still no route")


def test_a_sink_that_raises_warns_once_and_is_switched_off(tmp_path):
    warnings, good, bad = [], Recording(), Raising(fail_at=1)

    def broken_open():
        raise RuntimeError("api key rejected")

    sinks = _sinks(tmp_path, {"recording": lambda: good, "raising": lambda: bad, "broken": broken_open}, warnings)
    for step in range(5):
        sinks.write({"step": step, "samples": 8 * step})
    sinks.close()
    assert good.seen == [0, 1, 2, 3, 4] and good.closed  # the healthy sink saw everything
    assert bad.calls == 2  # steps 0 and 1; never called again after it raised
    assert sorted(sinks.failed) == ["broken", "raising"]
    assert "api key rejected" in sinks.failed["broken"] and "no route" in sinks.failed["raising"]
    assert len(warnings) == 2 and all("training continues" in w for w in warnings)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3, 4]  # jsonl has all of it
    assert json.load(open(tmp_path / "heartbeat.json"))["sinks_failed"].keys() == {"broken", "raising"}


def test_close_while_an_error_propagates_marks_the_heartbeat_failed(tmp_path):
    sinks = _sinks(tmp_path, {}, [])
    with pytest.raises(ValueError):
        try:
            raise ValueError("learner blew up")
        finally:
            sinks.close()
    assert json.load(open(tmp_path / "heartbeat.json"))["state"] == "failed"


def test_finish_writes_the_final_state_after_running_heartbeats(tmp_path):
    sinks = _sinks(tmp_path, {}, [])
    sinks.write({"step": 3, "samples": 24})
    sinks.heartbeat._write()
    hb = json.load(open(tmp_path / "heartbeat.json"))
    assert (hb["state"], hb["step"], hb["samples"], hb["pid"]) == ("running", 3, 24, os.getpid())
    sinks.close()
    sinks.finish({"preempted": True})
    assert json.load(open(tmp_path / "heartbeat.json"))["state"] == "preempted"


def _prom_text(collector) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return generate_latest(reg).decode()


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_prometheus_gauges_follow_the_newest_records():
    c = RecordCollector()
    assert _samples(_prom_text(c)) == {}  # nothing reported yet: no gauges at all
    c.update(scalars(RECORDS[0]))
    got = _samples(_prom_text(c))
    assert got["cadence_step"] == 0 and got["cadence_eval_exact_match"] == 0.05
    assert "cadence_reward_mean" not in got  # appears when its key first appears
    c.update(scalars(RECORDS[1]))
    c.update(scalars(RECORDS[2]))
    got = _samples(_prom_text(c))
    assert got["cadence_step"] == 2 and got["cadence_samples"] == 256 and got["cadence_reward_mean"] == 0.25
    assert got["cadence_eval_exact_match"] == 0.05  # the last evaluation stays until the next one
    assert got["cadence_learning_rate"] == 1e-3
    assert got['cadence_dropped_total{reason="stale"}'] == 2  # cumulative: a counter
    assert got['cadence_actor_samples_per_second{actor="3"}'] == 41.5
    assert got["cadence_sft_loss"] == 2.25  # any other number: cadence_<key>
    assert got["cadence_seconds_since_checkpoint"] == pytest.approx(time.time() - 1.0e9, abs=60)
    assert 0 <= got["cadence_seconds_since_last_step"] < 60


def test_prometheus_per_batch_gauges_reset_and_counters_keep_the_total():
    c = RecordCollector()
    c.update(scalars({"step": 1, "reward/mean": 0.5, "reward/errors/timeout": 3, "task/tool_use": 0.75,
                      "dropped/stale": 1, "actors/reissued": 2, "eval/reward": 0.4}))
    c.update(scalars({"step": 2, "reward/mean": 0.5, "reward/errors/timeout": 2, "reward/errors/memory": 1,
                      "task/tool_use": 0.5, "dropped/stale": 1, "actors/reissued": 2}))
    text = _prom_text(c)
    got = _samples(text)
    assert got['cadence_reward_errors_batch{reason="timeout"}'] == 2
    assert got['cadence_reward_errors_total{reason="timeout"}'] == 5
    c.update(scalars({"step": 3, "reward/mean": 0.75, "dropped/stale": 4, "actors/reissued": 2}))  # no errors
    text = _prom_text(c)
    got = _samples(text)
    assert got['cadence_reward_errors_batch{reason="timeout"}'] == 0  # this batch had none
    assert got['cadence_reward_errors_batch{reason="memory"}'] == 0
    assert got['cadence_reward_errors_total{reason="timeout"}'] == 5  # the run's total stays
    assert got['cadence_reward_errors_total{reason="memory"}'] == 1
    assert got["cadence_task_tool_use"] == 0  # a per-batch mean the batch did not report
    assert got["cadence_eval_reward"] == 0.4  # an evaluation holds until the next one
    assert got['cadence_dropped_total{reason="stale"}'] == 4 and got["cadence_actors_reissued_total"] == 2
    assert "# TYPE cadence_reward_errors_total counter" in text and "# TYPE cadence_dropped_total counter" in text
    assert "# TYPE cadence_reward_errors_batch gauge" in text


def test_prometheus_server_serves_metrics_on_loopback():
    sink = PrometheusSink("127.0.0.1", 0)  # 0: any free port (run.prometheus_port=0 means off)
    try:
        sink.write(RECORDS[1], scalars(RECORDS[1]))
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10).read().decode()
        assert _samples(body)["cadence_samples"] == 128
        assert sink._server.server_address[0] == "127.0.0.1"
    finally:
        sink.close()


def test_prometheus_port_in_use_disables_only_that_sink(tmp_path):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        cfg = load_config(overrides=[f"run.prometheus_port={busy.getsockname()[1]}", "run.heartbeat_seconds=60"])
        warnings = []
        sinks = open_sinks(cfg.run, str(tmp_path), {}, warn=warnings.append)
        assert sinks.wait_open(30)
        sinks.write(RECORDS[0])
        sinks.close()
    finally:
        busy.close()
    assert "prometheus" in sinks.failed and "Address already in use" in sinks.failed["prometheus"]
    assert read_metrics(str(tmp_path)) == [RECORDS[0]]


@pytest.mark.parametrize("override, key", [
    ("run.loggers=[jsonl, mlflow]", "run.loggers[1]"),
    ("run.loggers=[tensorboard, tensorboard]", "run.loggers"),
    ("run.prometheus_port=70000", "run.prometheus_port"),
    ("run.heartbeat_seconds=0", "run.heartbeat_seconds"),
    ("run.stall_factor=1", "run.stall_factor"),
])
def test_bad_observability_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(overrides=[override])
