"""A group is checked against its grant (issue 31, finding 2): rogue clients over real sockets send
groups of every bad kind, and random ones; each bad group is refused, counted as bad_groups/REASON
and its sender cut off, while a learner thread keeps laying out everything delivered (the learner's
own build_microbatches) and a good client's groups keep arriving.

Before the check, a group with G=5 where the run uses 2, a 5,000-token prompt and rewards of 1e30
passed the codec, was delivered, and build_microbatches raised ValueError out of the learner loop."""
import functools
import random
import threading

import msgspec
import numpy as np
import pytest

from cadence.actors.prompt_stream import PromptStream
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.learner.batching import build_microbatches
from cadence.learner.config import GRPOConfig
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.dispatch_client import DispatcherClient
from cadence.protocols.dispatch_server import DispatchServer
from cadence.protocols.group_checks import GrantedPrompts, GroupLimits, check_group
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.messages import EngineTimings, RolloutGroup
from cadence.protocols.transport import InProcessTransport
from cadence.protocols.zmq_transport import private_dir
from tests import waiting

G, BUDGET, VOCAB, VERSION = 2, 8, 64, 5
wait_for = functools.partial(waiting.wait_for, timeout=10.0, interval=0.01)
TASK = make_task(TaskConfig(name="sort", num_digits=3, heldout_size=4))
SEQ_LEN = -(-(TASK.max_prompt_len + BUDGET) // 8) * 8  # as launch.config.seq_len lays out rows


def good(grant, i, version=VERSION):
    t = EngineTimings(queued_at=0, started_at=0, finished_at=0, generate_seconds=0, num_tokens=2 * G, engine="jax")
    return RolloutGroup(prompt_id=grant.prompt_ids[i], task="sort", grant_id=grant.grant_id, actor_id="x",
                        prompt_tokens=list(TASK.prompt(grant.prompt_indices[i]).tokens),
                        completion_tokens=[[3, 2]] * G, behavior_logprobs=[[-0.5, -1.5]] * G,
                        rewards=[1.0, 0.0], policy_version=version, timings=t)


def with_completions(g, rows, logprob=-1.0, rewards=None):
    """g with these completions (lists of ids), matching logprobs, and G rewards."""
    return msgspec.structs.replace(g, completion_tokens=rows, behavior_logprobs=[[logprob] * len(r) for r in rows],
                                   rewards=rewards if rewards is not None else [float(i % 2) for i in range(len(rows))],
                                   kept_logmass=None, policy_mask=None, exact_match=None)


# Each bad kind the dispatcher must refuse: reason -> a bad group made from a good one.
BAD = {
    "group_size": lambda g: with_completions(g, [[3, 2]] * 5),  # G=5 where the run uses 2
    "prompt_tokens": lambda g: msgspec.structs.replace(g, prompt_tokens=[7] * 5000),  # not the granted prompt
    "reward_range": lambda g: msgspec.structs.replace(g, rewards=[1e30, -1e30]),
    "completion_length": lambda g: with_completions(g, [[3] * (BUDGET + 1), [3]]),
    "token_id": lambda g: with_completions(g, [[VOCAB, 2], [3]]),
    "logprob_range": lambda g: with_completions(g, [[3], [3]], logprob=0.7),
    "kept_logmass_range": lambda g: msgspec.structs.replace(g, kept_logmass=[[-1e30, 0.0]] * G),
    "future_version": lambda g: msgspec.structs.replace(g, policy_version=VERSION + 1),
    "stale_version": lambda g: msgspec.structs.replace(g, policy_version=0),  # below its grant's min_version
}


class Run:
    """A live dispatcher on an ipc:// socket in a private directory, as a run has it, and a learner
    thread that lays out every delivered group as the learner loop does."""

    def __init__(self, ctx, run_dir):
        self.ctx = ctx
        self.stream, self.ledger = PromptStream(TASK), SampleLedger()
        self.gate = AdmissionGate(10_000, 1, steps_taken=VERSION)  # 5 steps done: grants allow versions 4..5
        self.queue = InProcessTransport()
        settings = DispatchSettings(group_size=G, heartbeat_seconds=0.1, heartbeat_timeout_seconds=2.0,
                                    max_completion_tokens=BUDGET, vocab_size=VOCAB)
        self.bad_reports = []
        self.core = Dispatcher(self.stream, self.ledger, self.gate, settings, deliver=self.queue.put,
                               version_fn=lambda: VERSION, on_bad_group=lambda *a: self.bad_reports.append(a))
        self.server = DispatchServer(self.core, ctx=ctx, external=f"ipc://{private_dir(str(run_dir))}/dispatch",
                                     max_bytes=1 << 20).start()
        self.gate.on_change = self.server.wake
        self.trained, self.learner_errors = [], []
        self._stop = threading.Event()
        self._learner = threading.Thread(target=self._learn, daemon=True)
        self._learner.start()

    def _learn(self):
        while not self._stop.is_set():
            g = self.queue.get(timeout=0.05)
            if g is None:
                continue
            try:
                (mb, *_), _ = build_microbatches([g], SEQ_LEN, 4, 0, GRPOConfig())
                assert np.isfinite(mb.advantages).all() and np.isfinite(mb.behavior_logprobs).all()
                assert mb.behavior_logprobs.max() <= 0 and mb.tokens.max() < VOCAB
                self.ledger.consume(g, 1)
                self.trained.append(g.prompt_id)
            except BaseException as e:  # the learner loop would have ended the run here
                self.learner_errors.append(f"{g.prompt_id}: {type(e).__name__}: {e}")

    def client(self, name):
        c = DispatcherClient(self.server.endpoint, name, 4, ctx=self.ctx, heartbeat_seconds=0.1,
                             learner_timeout_seconds=2.0).start()
        assert c.wait_welcome(5) is not None
        return c

    def bad_count(self):
        return sum(n for k, n in self.core.counts.items() if k.startswith("bad_groups/"))

    def stop(self):
        self._stop.set()
        self._learner.join(5)
        self.server.stop()


@pytest.fixture
def run(ctx, tmp_path):
    r = Run(ctx, tmp_path)
    yield r
    r.stop()


def test_each_bad_kind_is_refused_counted_and_its_sender_cut_off_while_a_good_client_trains(run):
    stop = threading.Event()
    honest = run.client("honest")
    sent_good = []
    for reason, make_bad in BAD.items():
        rogue = run.client(f"rogue-{reason}")
        grant = rogue.request(1, stop, timeout=5)
        assert grant is not None
        assert rogue.send_groups([make_bad(good(grant, 0))], grant)
        assert wait_for(lambda: run.core.counts[f"bad_groups/{reason}"] == 1, what=reason)
        assert wait_for(lambda: rogue.stop_reason != "", what="the rogue told to stop")
        assert reason in rogue.stop_reason and "disconnected" in rogue.stop_reason
        # Cut off: what it sends next (its heartbeats) is not read; its prompt goes back to the stream.
        assert wait_for(lambda: run.core.counts["banned_messages"] > 0)
        assert f"rogue-{reason}" not in run.core.actors
        assert grant.prompt_indices[0] in run.stream.pending_reissue or run.stream.position > grant.prompt_indices[0]
        rogue.close()
        # The honest actor's groups keep arriving and training.
        g_grant = honest.request(1, stop, timeout=5)
        assert g_grant is not None and honest.send_groups([good(g_grant, 0)], g_grant)
        sent_good.append(g_grant.prompt_ids[0])
    assert wait_for(lambda: len(run.trained) == len(sent_good))
    assert run.trained == sent_good and run.learner_errors == []
    assert run.bad_count() == len(BAD) and len(run.bad_reports) == len(BAD)
    metrics = run.server.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("actors/bad_groups/")} == \
        {f"actors/bad_groups/{reason}": 1 for reason in BAD}
    assert "honest" in run.core.actors and not honest.stop_reason
    honest.close()


def _random_group(rng, grant):
    """A group for the grant with one to three random faults (or none), of random sizes."""
    g = good(grant, 0)
    for _ in range(rng.randint(0, 3)):
        fault = rng.randrange(6)
        if fault == 0:
            n = rng.choice([1, G, G, 3, 8])
            g = with_completions(g, [[3] * rng.randint(0, 2 * BUDGET) for _ in range(n)],
                                 rewards=[rng.uniform(-2, 2) for _ in range(n)])
        elif fault == 1:
            g = msgspec.structs.replace(g, prompt_tokens=[rng.randrange(2 * VOCAB) for _ in range(rng.choice([1, 9, 5000]))])
        elif fault == 2:
            g = msgspec.structs.replace(g, rewards=[rng.choice([1, -1]) * 10 ** rng.uniform(-3, 37) for _ in g.rewards])
        elif fault == 3:
            lp = rng.choice([1, -1]) * 10 ** rng.uniform(-6, 37)
            g = msgspec.structs.replace(g, behavior_logprobs=[[lp] * len(r) for r in g.completion_tokens])
        elif fault == 4:
            g = msgspec.structs.replace(g, completion_tokens=[[rng.randrange(2 * VOCAB) for _ in r]
                                                              for r in g.completion_tokens])
        else:
            g = msgspec.structs.replace(g, policy_version=rng.randrange(0, 9))
    return g


def test_random_groups_either_train_or_are_refused_and_the_learner_never_fails(run):
    rng = random.Random(31)
    stop = threading.Event()
    sent = 0
    for i in range(40):
        c = run.client(f"fuzz-{i}")
        grant = c.request(1, stop, timeout=5)
        assert grant is not None
        assert c.send_groups([_random_group(rng, grant)], grant)
        sent += 1
        assert wait_for(lambda: run.bad_count() + len(run.trained) + len(run.learner_errors) == sent)
        c.close()
    assert run.learner_errors == []  # everything delivered was trainable
    assert run.bad_count() > 10 and len(run.trained) > 3  # both outcomes were exercised
    run.ledger.verify(run.stream.position, run.stream.pending_reissue)


def test_garbage_bytes_are_counted_and_the_dispatcher_serves_on(run):
    import zmq
    raw = run.ctx.socket(zmq.DEALER)
    raw.connect(run.server.endpoint)
    for junk in (b"", b"\x00" * 7, b"\xc1" * 300, np.random.default_rng(0).bytes(5000)):
        raw.send(junk)
    assert wait_for(lambda: sum(run.server.bad_messages.values()) == 4)
    raw.close(0)
    c = run.client("after")
    grant = c.request(1, threading.Event(), timeout=5)
    assert c.send_groups([good(grant, 0)], grant)
    assert wait_for(lambda: run.trained == [grant.prompt_ids[0]])
    c.close()


def test_check_group_names_each_fault_and_passes_a_good_group():
    prompt = TASK.prompt(0)
    granted = GrantedPrompts.of([prompt], min_version=4)

    class FakeGrant:  # a grant for prompt 0
        grant_id, prompt_ids, prompt_indices = "s-0", [prompt.prompt_id], [0]

    limits = GroupLimits(G, BUDGET, VOCAB)
    g = good(FakeGrant, 0)
    assert check_group(g, granted, limits, VERSION) is None
    for reason, make_bad in BAD.items():
        got = check_group(make_bad(g), granted, limits, VERSION)
        assert got is not None and got[0] == reason, (reason, got)
    # Unchecked limits (0) let lengths and ids through; a masked-out token's logprob 0 is in range.
    assert check_group(BAD["completion_length"](g), granted, GroupLimits(G), VERSION) is None
    masked = msgspec.structs.replace(with_completions(g, [[3, 4], [5]], logprob=0.0),
                                     policy_mask=[[True, False], [False]])
    assert check_group(masked, granted, limits, VERSION) is None
