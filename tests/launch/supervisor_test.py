"""ActorSupervisor started before the dispatcher exists: real child processes read the config and
then the endpoint on stdin; one that dies before the endpoint is known is started again the same
way, and restarts after connect() get the endpoint on the command line."""
from __future__ import annotations

import json
import sys
import time

import msgspec

from cadence.launch.config import Config
from cadence.launch.config_loader import to_dict
from cadence.launch.cluster.supervisor import ActorSupervisor
from cadence.protocols.codec import decode, encode
from cadence.protocols.messages import Welcome

# Stands in for `cadence actor`: records its argv and every stdin line, then exits if told to.
CHILD = r"""
import json, sys
out = open(sys.argv[1], "a")
out.write(json.dumps({"argv": sys.argv[2:]}) + "\n"); out.flush()
if "-" in sys.argv:
    for line in sys.stdin:
        out.write(line); out.flush()
        if "die" in line:
            sys.exit(3)
"""


class _Recording(ActorSupervisor):
    def __init__(self, record, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = record

    def command(self, actor_id):
        real = super().command(actor_id)
        return [sys.executable, "-c", CHILD, str(self.record), *real[real.index("--connect"):]]


def _lines(path, n, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(rows) >= n:
            return rows
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {n} lines: {path.read_text() if path.exists() else ''}")


def _until(path, ok, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        if ok(rows):
            return rows
        time.sleep(0.05)
    raise AssertionError(f"{path}: {path.read_text()}")


def test_early_children_get_the_config_then_the_endpoint_and_restarts_connect_directly(tmp_path):
    record = tmp_path / "record.jsonl"
    sup = _Recording(record, 1, None, str(tmp_path), backoff=0.05, config={"die": 1}, message=lambda m: None)
    sup.start()
    try:
        # The config line makes the child exit: it is restarted, again with `--connect -` and the config.
        rows = _lines(record, 4)
        assert rows[0] == {"argv": ["--connect", "-", "--id", "proc-0"]}
        assert rows[1] == {"config": {"die": 1}}
        assert rows[2] == rows[0] and rows[3] == rows[1]
        assert sup.restarts >= 1
        sup.config = {"ok": 1}  # a restart from now on lives (backoff grows while they keep dying)
        rows = _until(record, lambda rows: rows[-1] == {"config": {"ok": 1}})
        sup.connect("tcp://127.0.0.1:5555")
        n = len(rows)
        rows = _lines(record, n + 1)
        assert rows[n] == {"connect": "tcp://127.0.0.1:5555"}
        sup.kill("proc-0")  # restarts now know the endpoint: no stdin, no config
        rows = _lines(record, n + 2)
        assert rows[n + 1] == {"argv": ["--connect", "tcp://127.0.0.1:5555", "--id", "proc-0"]}
    finally:
        sup.stop(5.0)
    assert sup.alive() == 0


def test_the_config_a_process_prepares_with_equals_the_welcome_config():
    """An actor reuses what it prepared only if the two copies compare equal after their trips
    (JSON on stdin, MessagePack in the Welcome); tuples and floats must not make them differ."""
    config = to_dict(Config())
    via_stdin = json.loads(json.dumps(config))
    welcome = decode(encode(Welcome(session="s", config=config, weights_endpoint="", version=0,
                                    heartbeat_seconds=1.0, concurrency=1)))
    assert via_stdin == welcome.config
    assert msgspec.json.decode(msgspec.json.encode(config)) == welcome.config


def test_connect_survives_a_child_that_died_before_the_endpoint(tmp_path):
    """A process that died while preparing (its stdin pipe broken) must not break connect(): the
    learner goes on, and the restart connects with the endpoint on its command line."""
    record = tmp_path / "record.jsonl"
    sup = _Recording(record, 1, None, str(tmp_path), backoff=2.0, config={"die": 1}, message=lambda m: None)
    sup.start()
    try:
        _lines(record, 2)
        first = sup.children[0].proc
        first.wait(timeout=20)
        sup.connect("tcp://127.0.0.1:5555")  # raised BrokenPipeError before
        rows = _until(record, lambda rows: rows[-1].get("argv", [None, None])[1] == "tcp://127.0.0.1:5555")
        assert rows[-1] == {"argv": ["--connect", "tcp://127.0.0.1:5555", "--id", "proc-0"]}
    finally:
        sup.stop(5.0)
