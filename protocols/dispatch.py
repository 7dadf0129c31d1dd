"""The dispatcher: the one owner of prompt state on the learner side.

    core = Dispatcher(stream, ledger, gate, settings, deliver=transport.put, version_fn=...)
    server = DispatchServer(core, external="tcp://127.0.0.1:0")   # protocols/dispatch_server.py
    server.start()      # a thread: ROUTER sockets <-> core.handle / core.tick

Actors (threads in this process over `inproc://`, or processes anywhere over `tcp://`, the same
protocol either way) speak to it like this:

    actor                         dispatcher
    Hello(id, capacity)     ->                     register; in-flight prompts of an older
                            <-    Welcome          incarnation with the same id are re-issued
    WorkRequest(n)          ->                     admit up to n prompt groups (staleness bound,
                            <-    Grant(ids, v)    counted in samples) when the gate allows
    RolloutGroup(grant_id)  ->                     ledger: in_flight -> queued; to the learner
    Heartbeat (both ways, every heartbeat_seconds; the actor's says what it is doing)
    Goodbye                 ->                     its in-flight prompts go back to the stream
    (held-out evaluation, when the learner asks for one: protocols/eval_work.py)
    WorkRequest(n)          ->                     an evaluation's chunk waits: it goes first
                            <-    EvalGrant(v)     greedy completions of those held-out prompts
    EvalResult(scores)      ->                     collected; the learner is told when all are in

An actor silent for heartbeat_timeout_seconds, or stuck in one phase with prompts in flight for
liveness_timeout_seconds, is declared gone: its prompts go back to the stream (re-issued first)
and their admission credits are returned. A group that answers no live grant (a late answer from
an actor declared gone, or from before a learner restart) is dropped and counted, so no prompt
is consumed twice. A group that answers a live grant but is not what was granted (another prompt,
another group size, lengths beyond the run's budget, rewards or log-probs out of range, an
implausible policy version: protocols/group_checks.py) never reaches the ledger or the learner: it
is counted as bad_groups/REASON, its sender is expelled (its prompts re-issued), told to stop, and
nothing more it sends on that connection is read. Messages from peers the dispatcher does not know
get a Reset: say Hello again.

`Dispatcher` is pure bookkeeping (no sockets, no threads of its own; the server calls it under its
lock). protocols/dispatch_client.py is the actor's side.
"""
from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections import Counter
from typing import Any, Callable

from cadence.protocols.admission import AdmissionGate
from cadence.protocols.eval_work import EvalJob, EvalWork
from cadence.protocols.group_checks import GrantedPrompts, GroupLimits, check_group
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.messages import (
    Control,
    EvalResult,
    Goodbye,
    Grant,
    Heartbeat,
    Hello,
    Reset,
    RolloutGroup,
    Welcome,
    WorkRequest,
)

Peer = tuple[int, bytes]  # (socket index, ZeroMQ routing id)
MAX_BANNED = 4096  # connections remembered as cut off (the oldest forgotten first)


@dataclasses.dataclass(frozen=True)
class DispatchSettings:
    group_size: int
    heartbeat_seconds: float = 1.0
    heartbeat_timeout_seconds: float = 10.0  # silence after which an actor is gone
    liveness_timeout_seconds: float = 600.0  # one phase this long with prompts in flight: hung
    queue_size: int = 0  # no new grants while this many groups wait for the learner (0 = no bound)
    concurrency: int = 16  # prompts per engine call, told to actors (the controller may change it)
    config: dict = dataclasses.field(default_factory=dict)  # the run's config, for actor processes
    weights_endpoint: str = ""
    weights_shards: tuple[str, ...] = ()  # the other learner processes' weight servers (Welcome)
    max_completion_tokens: int = 0  # the run's completion budget: a longer completion is a bad group (0 = unchecked)
    vocab_size: int = 0  # completion ids must be below it (0 = unchecked)
    max_abs_reward: float = 1e6  # a reward of larger magnitude is a bad group

    @property
    def limits(self) -> GroupLimits:
        return GroupLimits(self.group_size, self.max_completion_tokens, self.vocab_size, self.max_abs_reward)


@dataclasses.dataclass
class ActorRecord:
    """What the dispatcher knows of one live actor."""

    actor_id: str
    peer: Peer
    capacity: int
    host: str
    pid: int
    joined_at: float
    last_seen: float
    phase: str = "idle"
    phase_since: float = 0.0
    wanted: int = 0  # prompts asked for and not granted yet
    grants: dict[str, GrantedPrompts] = dataclasses.field(default_factory=dict)  # grant_id -> prompts out
    version: int = -1  # weights version the actor holds
    samples: int = 0
    tokens: int = 0
    groups: int = 0
    generate_seconds: float = 0.0  # engine time of the groups received
    engine_stats: dict[str, float] = dataclasses.field(default_factory=dict)  # its engine's counters (heartbeats)
    rate_mark: tuple[float, int] = (0.0, 0)  # (time, samples) at the last metrics read

    @property
    def in_flight(self) -> int:
        return sum(len(ids) for ids in self.grants.values())


class Dispatcher:
    """Prompt grants, the ledger's actor-side transitions, and actor liveness (see module doc).

    Args:
      stream: hands out prompts (`take(n)` -> objects with .prompt_id and .index; `reissue(indices)`).
      ledger, gate: the run's SampleLedger and AdmissionGate (shared with the learner loop).
      settings: DispatchSettings.
      deliver: called with each accepted RolloutGroup (the learner's queue; must not block).
      version_fn: the newest policy version.
      on_actor_gone(actor_id, reason, error): told when an actor is declared gone or leaves.
      on_hung(actor_id, detail): told when an actor is stuck (the wiring decides: kill a process,
        fail a thread).
      on_bad_group(actor_id, detail): told when an actor sent a bad group and was cut off.
    """

    def __init__(self, stream, ledger: SampleLedger, gate: AdmissionGate, settings: DispatchSettings,
                 deliver: Callable[[RolloutGroup], None], version_fn: Callable[[], int],
                 on_actor_gone: Callable[[str, str, bool], None] | None = None,
                 on_hung: Callable[[str, str], None] | None = None, session: str | None = None,
                 on_bad_group: Callable[[str, str], None] | None = None):
        self.stream, self.ledger, self.gate, self.settings = stream, ledger, gate, settings
        self.deliver, self.version_fn = deliver, version_fn
        self.on_actor_gone = on_actor_gone or (lambda actor_id, reason, error: None)
        self.on_hung = on_hung or (lambda actor_id, detail: None)
        self.on_bad_group = on_bad_group or (lambda actor_id, detail: None)
        self.limits = settings.limits
        self.banned: dict[Peer, None] = {}  # connections cut off for a bad group (insertion-ordered)
        self.session = session or uuid.uuid4().hex[:12]
        self.concurrency = settings.concurrency
        self.actors: dict[str, ActorRecord] = {}
        self.by_peer: dict[Peer, str] = {}
        self._grant_ids = itertools.count()
        self.counts: Counter = Counter()  # joined, gone/<reason>, reissued, late_groups, resets
        self.retired = Counter()  # samples/tokens/groups of actors no longer live
        self._last_heartbeat = 0.0
        self.evals = EvalWork(self.session)  # held-out evaluation handed out as work

    # -- messages -------------------------------------------------------------------------------
    def handle(self, peer: Peer, msg: Any, now: float) -> list[tuple[Peer, Any]]:
        """Applies one message from `peer`; returns the messages to send."""
        if peer in self.banned:
            self.counts["banned_messages"] += 1
            return []
        if isinstance(msg, Hello):
            return self._hello(peer, msg, now)
        rec = self.actors.get(self.by_peer.get(peer, ""))
        if rec is None:  # a peer from before a restart, or declared gone: it must start over
            if isinstance(msg, RolloutGroup):
                self.counts["late_groups"] += 1
            if isinstance(msg, Goodbye):
                return []
            self.counts["resets"] += 1
            return [(peer, Reset(session=self.session, reason="unknown actor: say hello"))]
        rec.last_seen = now
        if isinstance(msg, WorkRequest):
            rec.wanted = msg.capacity
            return self._grant(rec)
        if isinstance(msg, RolloutGroup):
            return self._group(rec, msg)
        if isinstance(msg, EvalResult):
            return self._eval_result(rec, msg)
        if isinstance(msg, Heartbeat):
            if msg.phase != rec.phase:
                rec.phase, rec.phase_since = msg.phase, now - msg.phase_seconds
            rec.version = msg.version
            rec.engine_stats = msg.engine_stats
            return []
        if isinstance(msg, Goodbye):
            self._expel(rec, f"left: {msg.reason}" if msg.reason else "left", msg.error)
            return []
        self.counts["unexpected/" + type(msg).__name__] += 1
        return []

    def _hello(self, peer: Peer, msg: Hello, now: float) -> list[tuple[Peer, Any]]:
        old = self.actors.get(msg.actor_id)
        if old is not None and old.peer == peer:  # a repeated Hello (sent before our Welcome arrived)
            return [(peer, self._welcome())]
        if old is not None:  # a restarted process, or a reconnect: its old work is gone
            self._expel(old, "rejoined", False)
        stale_id = self.by_peer.get(peer)
        if stale_id is not None and stale_id in self.actors:
            self._expel(self.actors[stale_id], "rejoined under a new id", False)
        self.actors[msg.actor_id] = ActorRecord(msg.actor_id, peer, msg.capacity, msg.host, msg.pid,
                                                joined_at=now, last_seen=now, phase_since=now,
                                                rate_mark=(now, 0))
        self.by_peer[peer] = msg.actor_id
        self.counts["joined"] += 1
        return [(peer, self._welcome())]

    def _welcome(self) -> Welcome:
        s = self.settings
        return Welcome(session=self.session, config=s.config, weights_endpoint=s.weights_endpoint,
                       weights_shards=list(s.weights_shards),
                       version=self.version_fn(), heartbeat_seconds=s.heartbeat_seconds,
                       heartbeat_timeout_seconds=s.heartbeat_timeout_seconds, concurrency=self.concurrency)

    def _group(self, rec: ActorRecord, group: RolloutGroup) -> list[tuple[Peer, Any]]:
        granted = rec.grants.get(group.grant_id)
        if granted is None or group.prompt_id not in granted:
            self.counts["late_groups"] += 1
            return []
        bad = check_group(group, granted, self.limits, self.version_fn())
        if bad is not None:
            return self._bad_group(rec, group, *bad)
        del granted.tokens[group.prompt_id]
        if not granted:
            del rec.grants[group.grant_id]
        rec.version = max(rec.version, group.policy_version)  # fresher than its last heartbeat
        self.ledger.queue(group)
        rec.groups += 1
        rec.samples += len(group.rewards)
        rec.tokens += group.timings.num_tokens
        rec.generate_seconds += group.timings.generate_seconds  # the engine call's time, shared by its groups
        self.counts[f"groups/{group.timings.engine}"] += 1  # which engines made the samples
        self.deliver(group)
        return []

    def _eval_result(self, rec: ActorRecord, result: EvalResult) -> list[tuple[Peer, Any]]:
        bad = self.evals.answer(rec.actor_id, result)
        if not bad:
            return []
        self.counts["bad_eval_results"] += 1
        return self._cut_off(rec, f"actor {rec.actor_id} sent a bad evaluation result ({bad}); disconnected")

    def _bad_group(self, rec: ActorRecord, group: RolloutGroup, reason: str, detail: str) -> list[tuple[Peer, Any]]:
        """Reject, count, and cut the sender off: expelled (its prompts, this one included, go back to
        the stream), told to stop, and nothing more read from its connection."""
        self.counts[f"bad_groups/{reason}"] += 1
        text = f"actor {rec.actor_id} sent a bad group for {group.prompt_id!r} ({reason}: {detail}); disconnected"
        return self._cut_off(rec, text, f"bad group ({reason})")

    def _cut_off(self, rec: ActorRecord, text: str, reason: str = "bad evaluation result") -> list[tuple[Peer, Any]]:
        self._expel(rec, reason, True)
        self.banned[rec.peer] = None
        if len(self.banned) > MAX_BANNED:
            del self.banned[next(iter(self.banned))]
        self.on_bad_group(rec.actor_id, text)
        return [(rec.peer, Control(stop=True, reason=text))]

    # -- grants ---------------------------------------------------------------------------------
    def _grant(self, rec: ActorRecord) -> list[tuple[Peer, Any]]:
        if rec.wanted <= 0:
            return []
        evaluation = self.evals.take(rec.actor_id)  # a waiting evaluation chunk goes first
        if evaluation is not None:
            rec.wanted = 0
            return [(rec.peer, evaluation)]
        if self.settings.queue_size and len(self.ledger.queued) >= self.settings.queue_size:
            return []  # backpressure: the learner is behind; granted again once it takes a batch
        G = self.settings.group_size
        version = self.version_fn()
        n = 0
        while n < rec.wanted and self.gate.try_admit(G, version):
            n += 1
        if n == 0:
            return []
        with self.ledger.lock:  # a checkpoint snapshot sees stream and ledger agree
            prompts = self.stream.take(n)
            self.ledger.issue(prompts)
        grant_id = f"{self.session}-{next(self._grant_ids)}"
        oldest = self.gate.consuming_step(0) - self.gate.max_staleness
        min_version = max(0, min(oldest, version))
        rec.grants[grant_id] = GrantedPrompts.of(prompts, min_version)
        rec.wanted = 0
        return [(rec.peer, Grant(grant_id=grant_id, prompt_indices=[p.index for p in prompts],
                                 prompt_ids=[p.prompt_id for p in prompts], version=version,
                                 min_version=min_version, session=self.session))]

    def start_eval(self, version: int, indices: list[int], prompt_ids: list[str], parts: int,
                   on_done: Callable[[EvalJob], None]) -> list[tuple[Peer, Any]]:
        """Hand out held-out evaluation of `version` as work: in at least `parts` chunks (one per
        live actor, if more), each to the next actor that asks for work. on_done(job) runs here
        once every prompt has its score."""
        self.evals.start(version, indices, prompt_ids, max(parts, len(self.actors)), on_done)
        return self.regrant()

    def regrant(self) -> list[tuple[Peer, Any]]:
        """Retry waiting requests (call when the gate moved: a batch taken, a version published)."""
        out = []
        for rec in sorted(self.actors.values(), key=lambda r: r.last_seen):
            out += self._grant(rec)
        return out

    # -- liveness -------------------------------------------------------------------------------
    def tick(self, now: float) -> list[tuple[Peer, Any]]:
        """Heartbeats out, silent and hung actors declared gone, waiting requests retried."""
        s = self.settings
        out: list[tuple[Peer, Any]] = []
        for rec in list(self.actors.values()):
            silent = now - rec.last_seen
            if silent > s.heartbeat_timeout_seconds:
                self._expel(rec, f"no heartbeat for {silent:.1f} s", False)
                continue
            stuck = now - rec.phase_since
            if (rec.grants or self.evals.holds(rec.actor_id)) and stuck > s.liveness_timeout_seconds:
                held = f"{rec.in_flight} prompts in flight, e.g. {_first(rec.grants)}" if rec.grants \
                    else "a chunk of the held-out evaluation"
                detail = (f"actor {rec.actor_id} made no progress for {stuck:.0f} s while {rec.phase or 'busy'} "
                          f"({held}; actors.liveness_timeout_seconds={s.liveness_timeout_seconds:g})")
                self._expel(rec, "hung", True)
                out.append((rec.peer, Control(stop=True, reason=detail)))
                self.on_hung(rec.actor_id, detail)
        if now - self._last_heartbeat >= s.heartbeat_seconds:
            self._last_heartbeat = now
            beat = Heartbeat(sender="learner", session=self.session, version=self.version_fn())
            out += [(rec.peer, beat) for rec in self.actors.values()]
        return out + self.regrant()

    def expel(self, actor_id: str, reason: str, error: bool = False) -> None:
        """Declare an actor gone from outside (e.g. its process exited); no-op if unknown."""
        rec = self.actors.get(actor_id)
        if rec is not None:
            self._expel(rec, reason, error)

    def _expel(self, rec: ActorRecord, reason: str, error: bool) -> None:
        if self.evals.release(rec.actor_id, reason if error else ""):  # its chunk goes to the next actor that asks
            self.counts["eval_reissued"] += 1
        ids = [pid for grant in rec.grants.values() for pid in grant]
        if ids:
            with self.ledger.lock:
                self.stream.reissue(self.ledger.release(ids))
            self.gate.cancel(self.settings.group_size * len(ids))
            self.counts["reissued"] += len(ids)
        rec.grants.clear()
        del self.actors[rec.actor_id]
        self.by_peer.pop(rec.peer, None)
        self.retired.update(samples=rec.samples, tokens=rec.tokens, groups=rec.groups,
                            generate_seconds=rec.generate_seconds)
        self.counts["gone"] += 1
        self.on_actor_gone(rec.actor_id, reason, error)

    def control_all(self, msg: Control) -> list[tuple[Peer, Any]]:
        if msg.concurrency is not None:
            self.concurrency = msg.concurrency
        return [(rec.peer, msg) for rec in self.actors.values()]

    # -- metrics --------------------------------------------------------------------------------
    def totals(self) -> dict:
        live = Counter()
        for rec in self.actors.values():
            live.update(samples=rec.samples, tokens=rec.tokens, groups=rec.groups,
                        generate_seconds=rec.generate_seconds)
        return dict(self.retired + live)

    def metrics(self, now: float) -> dict:
        """actors/* for the run's metrics: alive, re-issued, late groups, groups by engine, and per
        actor: samples/s, prompts in flight, heartbeat age, version lag, phase, its engine's counters."""
        version = self.version_fn()
        out = {"actors/alive": len(self.actors), "actors/reissued": self.counts["reissued"],
               "actors/late_groups": self.counts["late_groups"], "actors/gone": self.counts["gone"],
               "actors/joined": self.counts["joined"]}
        if self.evals.job is not None:  # a run that evaluates on its actors
            out.update({"actors/eval_reissued": self.counts["eval_reissued"], "actors/eval_late_results": self.evals.late})
        out.update({f"actors/{k}": n for k, n in self.counts.items()
                    if k.startswith(("groups/", "bad_groups/"))})  # actors/groups/sglang, actors/bad_groups/group_size
        for rec in self.actors.values():
            t0, s0 = rec.rate_mark
            key = f"actor/{rec.actor_id}"
            out[f"{key}/samples_per_second"] = (rec.samples - s0) / max(now - t0, 1e-9)
            out[f"{key}/in_flight"] = rec.in_flight
            out[f"{key}/heartbeat_age"] = now - rec.last_seen
            out[f"{key}/version_lag"] = version - rec.version if rec.version >= 0 else None
            out.update({f"{key}/{name}": v for name, v in rec.engine_stats.items()})  # e.g. actor/proc-0/sglang/syncs
            rec.rate_mark = (now, rec.samples)
        return out


def _first(grants: dict[str, GrantedPrompts]) -> str:
    for ids in grants.values():
        for pid in sorted(ids):
            return pid
    return "-"
