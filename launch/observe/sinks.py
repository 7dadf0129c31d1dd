"""Where a run's metrics records go: metrics.jsonl always; TensorBoard, W&B and Prometheus on request.

    sinks = open_sinks(cfg.run, run_dir, to_dict(cfg), resumed=restored)
    sinks.write(record)      # once per update (and the step-0 record)
    sinks.close()            # flush and close every sink (a `finally:`)
    sinks.finish(summary)    # after summary.json: the heartbeat's last word (finished / preempted)

metrics.jsonl is written on the calling thread (it is the run's record and what resume truncates).
The other sinks (`run.loggers`, `run.prometheus_port`) run on one background thread fed by a
bounded queue, so a slow disk, a W&B server that does not answer or a sink that raises never
holds up an update: a sink that raises is reported once on stderr and switched off for the rest
of the run; training goes on. The heartbeat (launch/observe/heartbeat.py) for `cadence status` starts here.

TensorBoard: RUN_DIR/tensorboard, one scalar per number in the record (float32, as TensorBoard
stores them), the config as text; a resumed run purges the steps after its checkpoint.
W&B: the run id is kept in RUN_DIR/wandb.json, so `--resume` continues the same W&B run (a fresh
start, e.g. resume=auto with no checkpoint yet, begins a new W&B run)
(`WANDB_MODE=offline` writes RUN_DIR/wandb/offline-run-*; `wandb sync` uploads it later).
"""
from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import uuid
from typing import Callable, Protocol

from cadence.launch.observe.heartbeat import Heartbeat
from cadence.launch.metrics import MetricsWriter

QUEUE_RECORDS = 10_000  # records the background sinks may fall behind by before records are dropped
CLOSE_SECONDS = 120.0  # how long close() waits for the background sinks to flush (W&B uploads)


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's finite numbers by key; nested dicts flatten to 'a/b' (lists, text, None are left out)."""
    out = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(scalars(v, key + "/"))
        elif isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
            out[key] = float(v)
    return out


class Sink(Protocol):
    name: str

    def write(self, record: dict, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def import_tensorboardx():
    """tensorboardX, imported without torch: tensorboardX imports torch when it is installed
    only to accept torch tensors (we pass floats), and that import costs ~4 s of CPU at the start
    of a run. Call on the main thread before other threads start (nothing else may be importing
    torch at that moment); a torch already imported is left as it is."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX
        return tensorboardX
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, run_dir: str, config: dict, purge_step: int | None):
        import yaml

        tbx = import_tensorboardx()
        from tensorboardX.proto.summary_pb2 import Summary

        self._summary = Summary
        self.logdir = os.path.join(run_dir, "tensorboard")
        self.writer = tbx.SummaryWriter(logdir=self.logdir, purge_step=purge_step, flush_secs=10)
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), global_step=purge_step or 0)

    def write(self, record: dict, values: dict[str, float]) -> None:
        # one event per record holding every scalar (add_scalar would write one event each: 10x the CPU)
        step = int(record["step"])
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()
                                       if k != "step"])
        self.writer._get_file_writer().add_summary(summary, global_step=step)
        if isinstance(record.get("controller/decision"), str):
            self.writer.add_text("controller/decision", record["controller/decision"], global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, run_dir: str, project: str, entity: str, config: dict, resumed: bool):
        import wandb

        id_path = os.path.join(run_dir, "wandb.json")
        if resumed and os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = json.load(f)["id"]
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_path, "w") as f:  # before init: a crash right after still resumes this run
                json.dump({"id": run_id, "project": project, "entity": entity}, f)
        # console="off": W&B must not wrap stdout, where `cadence train` prints its summary.
        self.run = wandb.init(project=project, entity=entity or None, id=run_id, resume="allow",
                              dir=run_dir, name=os.path.basename(os.path.normpath(run_dir)), config=config,
                              settings=wandb.Settings(console="off"))
        # x-axis: the update number, not W&B's own counter (a resumed run re-logs the steps
        # after its checkpoint; W&B would drop those as going back in time).
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict, values: dict[str, float]) -> None:
        data = dict(values)
        if isinstance(record.get("controller/decision"), str):
            data["controller/decision"] = record["controller/decision"]
        self.run.log(data)

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """metrics.jsonl on the caller's thread; the other sinks behind a queue on one thread."""

    def __init__(self, jsonl: MetricsWriter, factories: dict[str, Callable[[], Sink]], heartbeat: Heartbeat,
                 warn: Callable[[str], None] | None = None):
        self.jsonl = jsonl
        self.heartbeat = heartbeat
        self.warn = warn or (lambda msg: print(f"cadence: warning: {msg}", file=sys.stderr, flush=True))
        self.failed: dict[str, str] = {}  # sink name -> why it was switched off
        self.dropped = 0  # records the background sinks never saw (queue full)
        self.live: list[Sink] = []
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_RECORDS)
        self._opened = threading.Event()
        self._thread = None
        if factories:
            self._thread = threading.Thread(target=self._run, args=(factories,), name="metric-sinks", daemon=True)
            self._thread.start()
        else:
            self._opened.set()
        self._closed = False
        self._handled_at_open = sys.exc_info()[1]  # train() may itself run inside an `except:`

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        self.heartbeat.update(record)
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self.warn(f"metric sinks fell {QUEUE_RECORDS} records behind; dropping records for "
                          f"{', '.join(s.name for s in self.live)} until they catch up (metrics.jsonl has all)")

    def wait_open(self, timeout: float | None = None) -> bool:
        """True once every background sink has been opened (or has failed to open)."""
        return self._opened.wait(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        error = sys.exc_info()[1]  # called from a `finally:`: set while an error propagates
        failed = error is not None and error is not self._handled_at_open
        try:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join(CLOSE_SECONDS)
                if self._thread.is_alive():
                    self.warn(f"metric sinks still flushing after {CLOSE_SECONDS:.0f} s; leaving them")
        finally:
            self.jsonl.close()
            if failed:
                self.heartbeat.stop("failed")

    def finish(self, summary: dict) -> None:
        """The run is over and summary.json written: the heartbeat's final state."""
        self.heartbeat.stop("preempted" if summary.get("preempted") else "finished")

    # -- the background thread ------------------------------------------------------------------
    def _fail(self, name: str, error: BaseException) -> None:
        self.failed[name] = f"{type(error).__name__}: {error}"
        self.heartbeat.note(sinks_failed=dict(self.failed))
        self.warn(f"metric sink {name} failed ({self.failed[name]}); it is off for the rest of this run, "
                  "training continues")

    def _run(self, factories: dict[str, Callable[[], Sink]]) -> None:
        for name, make in factories.items():
            try:
                self.live.append(make())
            except Exception as e:  # noqa: BLE001 - any failure of an optional sink disables only it
                self._fail(name, e)
        self._opened.set()
        while True:
            record = self._queue.get()
            if record is None:
                break
            values = scalars(record)
            for sink in list(self.live):
                try:
                    sink.write(record, values)
                except Exception as e:  # noqa: BLE001
                    self.live.remove(sink)
                    self._fail(sink.name, e)
                    self._close_quietly(sink)
        for sink in self.live:
            self._close_quietly(sink, report=True)

    def _close_quietly(self, sink: Sink, report: bool = False) -> None:
        try:
            sink.close()
        except Exception as e:  # noqa: BLE001
            if report:
                self._fail(sink.name, e)


def open_sinks(run_cfg, run_dir: str, config: dict, resumed: bool = False, step0: int = 0,
               warn: Callable[[str], None] | None = None) -> Sinks:
    """The run's sinks from its `run` config section (run.loggers, run.prometheus_*, run.wandb_*).

    resumed: the run continues from its checkpoint at step0 (TensorBoard drops what it logged
    after step0 in the lost stretch; W&B continues the run whose id RUN_DIR/wandb.json holds).
    """
    heartbeat = Heartbeat(run_dir, run_cfg.heartbeat_seconds).start()
    jsonl = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))
    factories: dict[str, Callable[[], Sink]] = {}
    if "tensorboard" in run_cfg.loggers:
        try:
            import_tensorboardx()  # here, on the caller's thread (see its docstring)
        except Exception:  # noqa: BLE001 - reported when the sink opens
            pass
        # purge: TensorBoard drops earlier events from this step on (the redone stretch after a
        # resume; everything of an attempt that never reached a checkpoint, for a fresh start)
        factories["tensorboard"] = lambda: TensorBoardSink(run_dir, config, step0 + 1 if resumed else 0)
    if "wandb" in run_cfg.loggers:
        factories["wandb"] = lambda: WandbSink(run_dir, run_cfg.wandb_project, run_cfg.wandb_entity, config, resumed)
    if run_cfg.prometheus_port:
        from cadence.launch.observe.prometheus import PrometheusSink

        factories["prometheus"] = lambda: PrometheusSink(run_cfg.prometheus_host, run_cfg.prometheus_port)
    return Sinks(jsonl, factories, heartbeat, warn)
