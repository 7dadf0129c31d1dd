"""Real `cadence train` runs watched from outside: every metric sink read back, /metrics scraped
while the run trains, `cadence status` on running, finished, preempted and killed runs, and sinks
that fail without stopping training."""
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from cadence.launch.metrics import read_metrics
from cadence.launch.observe.prometheus import GAUGES
from cadence.launch.observe.sinks import scalars
from tests.sink_readers import read_offline_run, tensorboard_scalars
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

SMALL = ["learner.sft.steps=2", "task.heldout_size=16", "run.progress=false", "run.heartbeat_seconds=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cadence(*args, env=None, log=None, wait=True, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **(env or {}))
    cmd = [sys.executable, "-m", "cadence.launch.cli", *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def last_step(run) -> int:
    try:
        return read_metrics(str(run))[-1]["step"]
    except (OSError, IndexError, ValueError, KeyError):
        return -1


def status(run):
    out = cadence("status", str(run), "--json")
    return json.loads(out.stdout), out.returncode


def scrape(port) -> dict[str, float] | None:
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except (urllib.error.URLError, ConnectionError, OSError):
        return None
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
            if ln and not ln.startswith("#")}


def newest_before(rows, step, key):
    vals = [r[key] for r in rows if r["step"] <= step and isinstance(r.get(key), (int, float))]
    return vals[-1] if vals else None


def test_every_sink_reads_back_what_a_real_run_wrote(tmp_path):
    run, port = tmp_path / "run", free_port()
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with open(tmp_path / "log.txt", "w") as log:
        proc = cadence("train", f"run.dir={run}", "run.steps=20", "run.eval_every=5", "checkpoint.every_steps=5",
                       "run.loggers=[jsonl,tensorboard,wandb]", f"run.prometheus_port={port}", *SMALL,
                       env=env, log=log, wait=False)
        try:
            # during the run: /metrics answers with the run's current values, and status says running
            taken = wait_for(lambda: (s := scrape(port)) and s.get("cadence_step", 0) >= 3 and s,
                             proc=proc, what="a scrape at step >= 3")
            running_during_scrape = proc.poll() is None
        finally:
            proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert running_during_scrape
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(21))
    k = int(taken["cadence_step"])
    compared = 0
    for key, (name, _) in GAUGES.items():
        want = newest_before(rows, k, key)
        if name in taken or want is not None:
            assert taken.get(name) == pytest.approx(want, rel=1e-12), (name, k)
            compared += 1
    assert compared >= 10  # step, samples, reward, exact match, staleness, queue, tok/s x2, batch, lr, ...
    assert taken.get("cadence_seconds_since_checkpoint", 0.0) >= 0.0

    # TensorBoard: every number of every record, at its step (float32)
    tb = tensorboard_scalars(str(run / "tensorboard"))
    for r in rows:
        for key, v in scalars(r).items():
            if key != "step":
                assert tb[key][r["step"]] == pytest.approx(v, rel=1e-6, abs=1e-30), (key, r["step"])

    # W&B offline: the config, and one history row per record with the same numbers
    (wb_dir,) = glob.glob(str(run / "wandb" / "offline-run-*"))
    wid = json.load(open(run / "wandb.json"))["id"]
    wb = read_offline_run(wb_dir)
    assert wb["run_id"] == wid and wb["config"]["run"]["steps"] == 20 and wb["config"]["learner"]["group_size"] == 8
    assert [h["step"] for h in wb["history"]] == list(range(21))
    for h, r in zip(wb["history"], rows):
        for key, v in scalars(r).items():
            assert h[key] == pytest.approx(v, rel=1e-12), key

    st, code = status(run)
    assert (st["state"], code, st["step"], st["checkpoint_step"]) == ("finished", 4, 20, 20)

    # --resume continues the same W&B run and the same TensorBoard log
    out = cadence("train", "--resume", f"run.dir={run}", "run.steps=23", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted(glob.glob(str(run / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and all(r.endswith(f"-{wid}") for r in runs)
    resumed = read_offline_run(next(r for r in runs if r != wb_dir))
    assert resumed["run_id"] == wid and [h["step"] for h in resumed["history"]] == [21, 22, 23]
    assert sorted(tensorboard_scalars(str(run / "tensorboard"))["reward/mean"]) == list(range(1, 24))


def test_status_of_running_preempted_and_killed_runs(tmp_path):
    run = tmp_path / "run"
    args = [f"run.dir={run}", "run.steps=100000", "checkpoint.every_steps=3", *SMALL]
    with open(tmp_path / "log1.txt", "w") as log:
        proc = cadence("train", *args, log=log, wait=False)
        try:
            wait_for(lambda: last_step(run) >= 2, proc=proc, what="step 2")
            st, code = status(run)
            assert (st["state"], code, st["pid"]) == ("running", 0, proc.pid)
            plain = cadence("status", str(run))
            assert plain.returncode == 0 and "running" in plain.stdout and "ETA" in plain.stdout
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=300) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    st, code = status(run)
    assert (st["state"], code) == ("preempted", 5)

    with open(tmp_path / "log2.txt", "w") as log:
        proc = cadence("train", "--resume", *args, log=log, wait=False)
        try:
            first = last_step(run)
            wait_for(lambda: last_step(run) > first + 1, proc=proc, what="a step after the resume")
            st, code = status(run)
            assert (st["state"], code, st["pid"]) == ("running", 0, proc.pid)
        finally:
            proc.kill()  # kill -9: no final checkpoint, no final heartbeat
            proc.wait()
    st, code = status(run)
    assert (st["state"], code) == ("dead", 6) and "gone" in st["why"]
    plain = cadence("status", str(run))
    assert plain.returncode == 6 and "dead" in plain.stdout


def test_failing_sinks_do_not_stop_a_real_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("a file where TensorBoard wants its folder\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    # W&B online with a key it cannot check: there is no network here (its own init timeout: 5 s)
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "0" * 40, "WANDB_INIT_TIMEOUT": "5", "WANDB_SILENT": "true"}
    try:
        out = cadence("train", f"run.dir={run}", "run.steps=12", "run.eval_every=6",
                      "run.loggers=[tensorboard,wandb]", f"run.prometheus_port={busy.getsockname()[1]}",
                      *SMALL, env=env)
    finally:
        busy.close()
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == 12
    assert [r["step"] for r in read_metrics(str(run))] == list(range(13))
    for name in ("tensorboard", "wandb", "prometheus"):
        assert out.stderr.count(f"metric sink {name} failed") == 1, out.stderr[-3000:]
    st, code = status(run)
    assert code == 4 and set(st["sinks_failed"]) == {"tensorboard", "wandb", "prometheus"}


def test_a_sink_raising_mid_run_is_switched_off(small_config, tmp_path, monkeypatch, capsys):
    from tensorboardX.writer import FileWriter

    from cadence.launch.run.train import train

    original = FileWriter.add_summary

    def flaky(self, summary, global_step=None, walltime=None):  # the disk fills up at step 5
        if global_step is not None and global_step >= 5:
            raise OSError(28, "No space left on device")
        return original(self, summary, global_step, walltime)

    monkeypatch.setattr(FileWriter, "add_summary", flaky)
    cfg = small_config("run.steps=10", "run.eval_every=5", "run.loggers=[tensorboard]", "learner.sft.steps=2",
                       "task.heldout_size=16", "run.heartbeat_seconds=1")
    summary = train(cfg, str(tmp_path / "run"))
    assert summary["steps"] == 10 and [r["step"] for r in read_metrics(str(tmp_path / "run"))] == list(range(11))
    err = capsys.readouterr().err
    assert err.count("metric sink tensorboard failed") == 1 and "No space left" in err
    hb = json.load(open(tmp_path / "run" / "heartbeat.json"))
    assert hb["state"] == "finished" and "tensorboard" in hb["sinks_failed"]
