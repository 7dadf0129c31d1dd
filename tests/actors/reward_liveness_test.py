"""Slow rewards cannot stop a run (issue 31, finding 5).

A reward worker could get 64 completions at up to 30 s each: longer than the dispatcher's 600 s
liveness limit, so a working actor was declared hung. Now scoring reports progress (the actor's
phase moves on as completions get scored) and a group's scoring time is bounded
(task.reward_group_timeout_s). Real parts: spawned reward workers, the dispatcher and its client
over ZeroMQ (inproc), the actor loop on a thread.
"""
import functools
import threading

import zmq

from cadence.actors.actor_loop import Actor
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.rewards.pool import RewardPool
from cadence.actors.tasks.base import Completion, Prompt
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.dispatch_client import DispatcherClient
from cadence.protocols.dispatch_server import DispatchServer
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.transport import InProcessTransport
from cadence.protocols.weights import InProcessWeights
from tests.scripted_engine import ScriptedEngine

SLOW_TASK = '''
import time


class Slow:
    name = "slow"
    max_prompt_len = 8
    max_completion_len = 8
    tokenizer = None

    def prompt(self, index):
        return None

    def heldout(self):
        return []

    def score(self, prompt, completion):
        time.sleep(float(SECONDS))
        return 1.0


def make(cfg, tokenizer):
    global SECONDS
    SECONDS = cfg.args["seconds"]
    return Slow()
'''


def _slow_pool(tmp_path, seconds, **kw):
    path = tmp_path / "slow_task.py"
    path.write_text(SLOW_TASK)
    factory = functools.partial(make_task, TaskConfig(name=f"{path}:make", args={"seconds": seconds}))
    return RewardPool(factory, workers=1, memory_mb=0, **kw)


def test_a_group_past_its_budget_scores_the_rest_zero_and_the_next_group_still_counts(tmp_path):
    pool = _slow_pool(tmp_path, 0.5, timeout_s=30.0, group_timeout_s=1.25)
    p = Prompt("slow/train/0", 0, (1,))
    try:
        slow = [(p, Completion((4,), "s"))] * 8  # 4 s of reward in a group allowed 1.25 s
        seen = []
        scores = pool.score_groups([slow, slow[:1]], progress=lambda done, total: seen.append((done, total)))
    finally:
        pool.close()
    first, second = scores
    assert (first[0].reward, first[0].error) == (1.0, "")  # within the budget: scored
    assert first[-1].error == "group_timeout" and first[-1].reward == 0.0
    errors = [s.error for s in first if s.error]
    assert len(errors) >= 4 and set(errors) == {"group_timeout"}
    assert [(s.reward, s.error) for s in second] == [(1.0, "")]  # its own budget
    assert seen[-1] == (9, 9) and len(seen) >= 2  # the caller heard progress while it ran


def test_a_completion_running_past_its_groups_budget_is_stopped(tmp_path):
    """One completion longer than the group's whole budget: its worker is replaced (the parent
    steps in), and the group's other completions are not sent again."""
    pool = _slow_pool(tmp_path, 30.0, timeout_s=60.0, group_timeout_s=0.5)
    p = Prompt("slow/train/0", 0, (1,))
    try:
        scores = pool.score_groups([[(p, Completion((4,), "s"))] * 4])[0]
        assert [s.error for s in scores] == ["group_timeout"] * 4
        assert pool.respawns == 1
    finally:
        pool.close()


def test_a_slow_scorer_that_makes_progress_is_not_taken_for_a_hung_actor(tmp_path):
    G, per_call, liveness_s = 2, 4, 2.0
    task = make_task(TaskConfig(name="sort", num_digits=3, heldout_size=4))
    stream, ledger, gate = PromptStream(task), SampleLedger(), AdmissionGate(64, 8)
    delivered, hung = InProcessTransport(), []
    settings = DispatchSettings(group_size=G, heartbeat_seconds=0.1, heartbeat_timeout_seconds=10.0,
                                liveness_timeout_seconds=liveness_s, concurrency=per_call)
    core = Dispatcher(stream, ledger, gate, settings, deliver=delivered.put, version_fn=lambda: 0,
                      on_hung=lambda *a: hung.append(a))
    ctx = zmq.Context()
    server = DispatchServer(core, ctx=ctx).start()
    gate.on_change = server.wake
    # 8 completions at 0.4 s on one worker: ~3 s of scoring per call, past the 2 s liveness limit.
    pool = _slow_pool(tmp_path, 0.4, timeout_s=30.0, group_timeout_s=60.0)
    pool.wait_ready()
    client = DispatcherClient(server.inproc, "slow-actor", per_call, ctx=ctx, heartbeat_seconds=0.1,
                              learner_timeout_seconds=10.0).start()
    actor = Actor("slow-actor", ScriptedEngine([[3, 3]]), task, client, InProcessWeights({}, 0), group_size=G,
                  prompts_per_call=per_call, seed=0, scorer=pool)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: _run(actor, stop), daemon=True)
    thread.start()
    try:
        groups = [delivered.get(timeout=30) for _ in range(per_call)]
    finally:
        stop.set()
        thread.join(30)
        client.close()
        server.stop()
        pool.close()
        ctx.term()
    assert not hung, hung
    assert all(g is not None and g.rewards == [1.0] * G for g in groups)


def _run(actor, stop):
    try:
        actor.run(stop)
    except BaseException:  # noqa: BLE001 - the assertions say what went wrong
        pass
