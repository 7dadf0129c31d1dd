"""task.reward_url from a run's config to an actor's groups, against a real HTTP server (issue 31,
finding 6).

The server is the standard library's http.server in a thread on 127.0.0.1. The actor is built the
way an actor process builds its parts (launch.actor_process.prepare: config -> task -> scorer), so
the test covers the path a user's config takes. The plug-in task puts NumPy values in
Prompt.metadata (a NumPy int used to raise TypeError in the HTTP scorer, ending the run): they
reach the server as JSON numbers and lists; metadata JSON cannot carry scores 0 as a counted
failure (remote_encode) while the other groups of the same call are scored.
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from cadence.actors.actor_loop import Actor
from cadence.actors.rewards.remote import RemoteScorer
from cadence.launch.cluster.actor_process import prepare
from cadence.protocols.weights import InProcessWeights
from tests.scripted_engine import ScriptedEngine

TASK = '''
import numpy as np
from cadence.actors.tasks.base import Prompt, Score
from cadence.learner.models.char_tokenizer import CharTokenizer


class NumpyMetadataTask:
    name = "npmeta"
    max_prompt_len = 4
    max_completion_len = 4

    def __init__(self):
        self.tokenizer = CharTokenizer()

    def prompt(self, index):
        meta = {"answer": np.int64(3), "weights": np.arange(3), "scale": np.float32(0.5)}
        if index == 1:
            meta["handle"] = object()  # nothing JSON can carry
        return Prompt(f"npmeta/train/{index}", index, (1, 2), (), "q", meta)

    def heldout(self):
        return [self.prompt(0)]

    def score(self, prompt, completion):
        raise AssertionError("scored on the server, never here")


def make(cfg, tokenizer):
    return NumpyMetadataTask()
'''


class Judge(BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.bodies.append(body)
        answer = str(body["prompt"]["metadata"]["answer"])
        rewards = [1.0 if c["text"] == answer else 0.0 for c in body["completions"]]
        data = json.dumps({"rewards": rewards, "exact_match": [r == 1.0 for r in rewards]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Judge.bodies = []
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_reward_url_in_a_config_scores_an_actors_groups(judge, tmp_path):
    task_file = tmp_path / "npmeta_task.py"
    task_file.write_text(TASK)
    parts = prepare({"task": {"name": f"{task_file}:make", "reward_url": judge, "reward_retries": 0,
                              "reward_timeout_s": 10.0}})
    assert isinstance(parts.scorer, RemoteScorer)
    tok = parts.task.tokenizer
    right, wrong = tok.encode("3") + [tok.eos_id], tok.encode("4") + [tok.eos_id]
    actor = Actor("a", ScriptedEngine([right, wrong]), parts.task, None, InProcessWeights({}, 0), group_size=2,
                  prompts_per_call=2, seed=0, scorer=parts.scorer)
    try:
        groups = actor.step([parts.task.prompt(0), parts.task.prompt(1)])
    finally:
        parts.scorer.close()
    assert groups[0].rewards == [1.0, 0.0] and groups[0].reward_errors is None
    assert groups[1].rewards == [0.0, 0.0] and groups[1].reward_errors == ["remote_encode"] * 2
    assert len(Judge.bodies) == 1  # the unencodable group never left the actor
    meta = Judge.bodies[0]["prompt"]["metadata"]
    assert meta == {"answer": 3, "weights": [0, 1, 2], "scale": 0.5}
