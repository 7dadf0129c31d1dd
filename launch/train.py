"""Wiring for one process: actor threads and the learner share a CPU (or an accelerator).

    summary = train(cfg)                  # what `cadence train` runs
    summary = train(cfg, resume="auto")   # continue from the newest complete checkpoint, if any

Order of events: build the task, model and engine; either restore the newest checkpoint (params,
Adam state, stream position, sample ledger with its queued groups, in-flight prompts to re-issue)
or run the supervised warm-up; start the actor threads; the learner loop takes batches and
publishes versions; held-out greedy evaluation every run.eval_every updates (or
run.eval_every_samples samples); checkpoints every checkpoint.every_steps; SIGTERM/SIGINT end
with a final checkpoint and exit code 0.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import threading
from typing import NamedTuple

import jax
import numpy as np

from actors.actor_loop import Actor
from actors.engine import JaxEngine
from actors.prompt_stream import PromptStream
from actors.tasks.base import make_task
from launch import artifacts, compile_cache, run_state
from launch.config_loader import ConfigError, to_dict
from launch.config import Config, seq_len as config_seq_len
from launch.metrics import Clock, MetricsWriter, Progress
from launch.policy import build_policy, export_policy
from learner.controller import make_controller
from learner.dynamic_sampling import make_group_filter
from learner.steps import make_train_step
from learner.checkpoint import Checkpointer
from learner.loop import LearnerLoop, LoopSettings, PipelineStopped
from learner.models.llama import count_params, forward
from learner.steps.sft_step import SFTStep, build_sft_batch
from protocols.admission import AdmissionGate
from protocols.ledger import SampleLedger
from protocols.transport import InProcessTransport
from protocols.weights import InProcessWeights


def evaluate(engine: JaxEngine, task, params, prompts=None) -> dict:
    """Greedy decoding on the held-out set: exact-match rate and mean reward."""
    prompts = task.heldout() if prompts is None else prompts
    result = engine.generate(params, [list(p.tokens) for p in prompts], jax.random.key(0), greedy=True)
    exact, rewards = [], []
    for i, p in enumerate(prompts):
        ids = result.tokens[i, : int(result.lengths[i])].tolist()
        exact.append(task.exact_match(p, ids))
        rewards.append(task.reward(p, ids))
    return {"eval/exact_match": float(np.mean(exact)), "eval/reward": float(np.mean(rewards))}


def supervised_warmup(cfg: Config, logits_fn, params, stream: PromptStream, seq_len: int, pad_id: int,
                      progress: Progress):
    """A few cross-entropy steps on task answers, with their own Adam and fixed lr."""
    sft_cfg = cfg.learner.sft
    if sft_cfg.steps == 0:
        return params, {}
    sft = SFTStep(logits_fn, sft_cfg)
    opt_state = sft.init(params)
    loss = None
    for _ in range(sft_cfg.steps):
        prompts = stream.take(sft_cfg.batch_size)
        batch = build_sft_batch([p.tokens for p in prompts], [p.answer for p in prompts], seq_len, pad_id)
        params, opt_state, metrics = sft.update(params, opt_state, batch)
        loss = metrics["loss"]
    progress.message(f"supervised warm-up: {sft_cfg.steps} steps, final loss {float(loss):.3f}")
    return params, {"sft/loss": float(loss), "sft/steps": sft_cfg.steps}


class Preemption:
    """First SIGTERM/SIGINT: ask for a final checkpoint and a clean exit within `timeout` seconds.
    A second signal exits at once; the last complete checkpoint stays as it is."""

    def __init__(self, stop: threading.Event, loop: LearnerLoop, timeout: float, progress: Progress):
        self.stop, self.loop, self.timeout, self.progress = stop, loop, timeout, progress
        self.signalled = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame):
        if self.signalled is not None:
            os.write(2, b"cadence: second signal, exiting now; the last complete checkpoint is kept\n")
            os._exit(128 + signum)
        self.signalled = signal.Signals(signum).name
        self.progress.message(f"{self.signalled}: saving a final checkpoint, then exiting "
                              f"(within {self.timeout:.0f} s; send it again to exit at once)")
        self.loop.stop_reason = "preempted"
        self.stop.set()
        timer = threading.Timer(self.timeout, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self):
        os.write(2, f"cadence: final checkpoint not done within {self.timeout:.0f} s; exiting, the last "
                    "complete checkpoint is kept\n".encode())
        os._exit(1)


def _arrays(state) -> dict:
    """The array part of a learner state (GRPO: params, Adam; PPO adds critic and reference)."""
    return {k: v for k, v in state._asdict().items() if k != "step" and v is not None}


def _sglang_engine(cfg: Config, policy, run_dir: str):
    """SGLang servers for the actors (held-out eval keeps the JaxEngine on the learner's params)."""
    from actors.sglang.checkpoint import export_for_server
    from actors.sglang.engine import SGLangEngine
    from learner.models.hf_export import hf_tensors

    sg = cfg.actors.sglang
    return SGLangEngine(sg, max_new_tokens=cfg.engine.max_new_tokens, eos_id=policy.tokenizer.eos_id,
                        pad_id=policy.tokenizer.pad_id, temperature=cfg.engine.temperature,
                        top_p=cfg.engine.top_p, work_dir=sg.work_dir or os.path.join(run_dir, "sglang"),
                        export_fn=lambda params, d: export_for_server(policy.model_cfg, params, d),
                        tensors_fn=lambda params: hf_tensors(policy.model_cfg, params))


class Begin(NamedTuple):
    """Where a run starts: restored from its newest checkpoint, or fresh."""
    step0: int
    state: object  # TrainState, with the checkpoint's arrays when restored
    restored: bool
    meta: dict  # the checkpoint's metadata ({} for a fresh run)
    ledger: SampleLedger
    stream: PromptStream
    clock: Clock
    summary: dict


def _begin(cfg: Config, run_dir: str, checkpointer: Checkpointer, state, task, progress: Progress,
           resume: str, resuming: bool) -> Begin:
    """Restore the newest complete checkpoint (arrays, ledger with its queued groups, in-flight
    prompts to re-issue, metrics truncated to the step), or prepare a fresh run directory."""
    if not resuming:
        artifacts.prepare_run_dir(cfg, run_dir, overwrite=resume == "auto")
        return Begin(0, state, False, {}, SampleLedger(), PromptStream(task), Clock(),
                     {"target_reached_at": None})
    restored = checkpointer.restore_latest(_arrays(state))
    if restored is None:
        raise ConfigError(f"run.resume: no checkpoint in {checkpointer.directory} restores (see the warnings above)")
    step0, arrays, meta = restored
    saved_steps = meta["config"]["run"]["steps"]
    if meta.get("finished") and cfg.run.steps <= max(saved_steps, step0):
        raise run_state.RunFinished(
            f"{run_dir} already finished at step {step0} (run.steps={cfg.run.steps}); "
            "raise run.steps to train further, or start a new run.dir")
    ledger = SampleLedger.from_state_dict(meta["ledger"])
    reissue = sorted(set(ledger.in_flight.values()) | set(meta["reissue"]))
    ledger.in_flight.clear()
    stream = PromptStream(task, start=meta["stream_position"], reissue=reissue)
    lines = run_state.truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), step0)
    summary = dict(meta["summary"])
    summary.setdefault("resumed_from", []).append(
        {"step": step0, "queued_restored": len(ledger.queued), "reissued": len(reissue)})
    artifacts.write_config(cfg, run_dir)
    progress.message(f"resumed {run_dir} at step {step0} ({lines} metrics lines kept, "
                     f"{len(ledger.queued)} queued groups restored, {len(reissue)} prompts re-issued)")
    return Begin(step0, state._replace(**arrays, step=step0), True, meta, ledger, stream,
                 Clock(offset=meta["wall_time"]), summary)


def train(cfg: Config, run_dir: str | None = None, *, resume: str = "no", wrap_train_step=None,
          controller=None) -> dict:
    """Run one training job; returns the summary also written to RUN_DIR/summary.json.

    resume: "no" (a new run), "auto" (continue from the newest complete checkpoint if there is
      one, else start), "yes" (continue, and fail if there is nothing to continue).
    wrap_train_step: tests inject faults (e.g. a deliberately slow learner) by wrapping GRPOTrainStep.
    controller: a learner.loop.Controller consulted after every update (batch size, Adam
      hyperparameters, actor concurrency).
    Raises ConfigError (a resume with changed frozen keys, nothing to resume), RunFinished.
    """
    compile_cache.enable(cfg.run.jax_cache)  # before the first compile (launch/compile_cache.py)
    run_dir = os.path.abspath(run_dir or cfg.run.dir or artifacts.default_run_dir(cfg))
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if resume == "yes" and not has_ckpt:
        raise ConfigError(f"run.resume: nothing to resume in {run_dir} (no complete checkpoint)")
    resuming = resume in ("yes", "auto") and has_ckpt
    if resuming:
        run_state.check_compatible(run_dir, run_state.saved_config(run_dir), to_dict(cfg))
    progress = Progress(cfg.run.progress)
    policy = build_policy(cfg)
    tokenizer, graphdef, params = policy.tokenizer, policy.graphdef, policy.params
    task = make_task(cfg.task, tokenizer)
    heldout = task.heldout()
    L = config_seq_len(cfg, task.max_prompt_len)
    logits_fn = functools.partial(forward, graphdef)
    train_step = make_train_step(graphdef, cfg.learner, completion_budget=cfg.engine.max_new_tokens)
    state = train_step.init(params)
    G = cfg.learner.group_size
    checkpointer = Checkpointer(ckpt_dir, cfg.checkpoint)

    begin = _begin(cfg, run_dir, checkpointer, state, task, progress, resume, resuming)
    step0, state, restored, meta = begin.step0, begin.state, begin.restored, begin.meta
    ledger, stream, clock, summary = begin.ledger, begin.stream, begin.clock, begin.summary
    sft_metrics = {}
    progress.message(f"run dir {run_dir} | task {task.name} | model {count_params(params):,} params | "
                     f"batch {cfg.learner.batch_size} samples (G={G}) | "
                     f"max_staleness {cfg.actors.max_staleness}")
    # One engine for actors and evaluation: jitted calls are thread-safe, and sharing it means the
    # held-out eval runs the program the actors already compiled.
    engine = JaxEngine(policy.model_cfg, graphdef, cfg.engine, tokenizer.eos_id, tokenizer.pad_id)
    if not restored:
        params, sft_metrics = supervised_warmup(cfg, logits_fn, state.params, stream, L, tokenizer.pad_id,
                                                progress)
        ledger.warmup(stream.position)
        state = state._replace(params=params)

    if wrap_train_step is not None:
        train_step = wrap_train_step(train_step)
    gate = AdmissionGate(cfg.learner.batch_size, cfg.actors.max_staleness)
    gate.steps_taken, gate.issued = step0, G * len(ledger.queued)
    weights = InProcessWeights(state.params, step0, on_publish=lambda v: gate.notify())
    transport = InProcessTransport(maxsize=cfg.actors.queue_size)
    for group in ledger.queued.values():  # buffered trajectories, in their original order
        transport.put(group)
    actor_engine = engine if cfg.actors.engine == "jax" else _sglang_engine(cfg, policy, run_dir)
    actors = [Actor(f"actor-{i}", actor_engine, task, stream, gate, weights, transport, G, cfg.actors.prompts_per_call,
                    cfg.actors.seed + i, ledger=ledger)
              for i in range(cfg.actors.num_actors)]

    def health():
        for a in actors:
            if a.error is not None:
                raise PipelineStopped(f"{a.actor_id} failed: {a.error!r}") from a.error

    controller = controller or make_controller(cfg.controller, cfg.learner, cfg.actors)
    if restored and controller is not None and meta.get("controller") is not None:
        controller.load_state_dict(meta["controller"])
    loop = LearnerLoop(train_step, transport, gate, weights,
                       LoopSettings(cfg.learner.batch_size, G, cfg.learner.microbatch_size, L,
                                    tokenizer.pad_id, cfg.learner.grpo), health=health,
                       controller=controller,
                       on_concurrency=lambda c: [a.set_concurrency(c) for a in actors], ledger=ledger)
    loop.group_filter = make_group_filter(cfg.learner)  # dynamic sampling (None when off)
    if restored:
        loop.samples = meta["samples"]
        loop.dropped = dict(meta["dropped"])
    writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))
    if not restored:
        record0 = {"step": 0, "samples": 0, "wall_time": clock(), **sft_metrics,
                   **evaluate(engine, task, state.params, heldout)}
        writer.write(record0)
        progress.message(f"before RL: held-out exact match {record0['eval/exact_match']:.3f}")

    last = {"t": clock(), "tokens": 0}
    samples_before = 0 if not restored else G * (len(ledger.consumed) + len(ledger.queued) + len(ledger.dropped))

    def enrich(step, m) -> None:
        """Generation-side measurements, added before the controller sees the step."""
        now = clock()
        tokens = sum(a.stats.tokens for a in actors)
        m["wall_time"] = now
        m["actors/tokens_per_second"] = (tokens - last["tokens"]) / max(now - last["t"], 1e-9)
        m["actors/admission_wait_seconds"] = sum(a.stats.admission_wait_seconds for a in actors)
        m["actors/generate_seconds"] = sum(a.stats.generate_seconds for a in actors)
        m["actors/concurrency"] = actors[0].prompts_per_call
        # cumulative over the run's life (a resumed run starts from what its checkpoint had produced)
        m["actors/samples"] = samples_before + sum(a.stats.samples for a in actors)
        if cfg.actors.engine == "sglang":  # cumulative counters: re-issues, misaligned responses, restarts, syncs
            m.update({f"sglang/{k}": v for k, v in dataclasses.asdict(actor_engine.stats).items()})
        last.update(t=now, tokens=tokens)

    loop.enrich = enrich

    def snapshot(st, finished: bool) -> dict:
        """Everything besides arrays that the run needs to continue, taken at a step boundary."""
        with ledger.lock:  # actors cannot move prompts between states while we look
            meta = {
                "step": st.step, "version": weights.version, "samples": loop.samples,
                "wall_time": clock(), "finished": finished,
                "stream_position": stream.position, "reissue": stream.pending_reissue,
                "ledger": ledger.state_dict(), "dropped": loop.dropped,
                "batch_size": loop.batch_size,
                "controller": controller.state_dict() if hasattr(controller, "state_dict") else None,
                "summary": {k: v for k, v in summary.items() if k != "last_eval"},
                "actors_seed": cfg.actors.seed, "config": to_dict(cfg),
            }
        # A deep copy: an asynchronous save serialises it later, while the run mutates the originals.
        return json.loads(json.dumps(meta))

    def save(st, finished=False, wait=False):
        checkpointer.save(st.step, _arrays(st), snapshot(st, finished), wait=wait)

    previous = {"samples": loop.samples}  # samples after the previous step (a resumed run starts there)

    def eval_due(step: int, samples: int) -> bool:
        n = cfg.run.eval_every_samples
        if n:  # a crossing of a multiple of n samples, whatever B the steps in between had
            due, previous["samples"] = samples // n > previous["samples"] // n, samples
            return due
        return bool(cfg.run.eval_every and step % cfg.run.eval_every == 0)

    def on_step(step, st, m) -> bool:
        final = step == cfg.run.steps
        if eval_due(step, m["samples"]) or final:
            summary["last_eval"] = evaluate(engine, task, st.params, heldout)
            m.update(summary["last_eval"])
            m["wall_time"] = clock()
        m["checkpoint/blocked_seconds"] = checkpointer.blocked_seconds
        writer.write(m)
        if step % cfg.run.log_every == 0 or "eval/exact_match" in m or final:
            progress.line(m)
        em = m.get("eval/exact_match")
        done = bool(em is not None and cfg.run.stop_at_exact_match and em >= cfg.run.stop_at_exact_match)
        if done:
            summary["target_reached_at"] = {"step": step, "samples": m["samples"], "wall_time": m["wall_time"]}
        done = done or bool(cfg.run.max_samples and m["samples"] >= cfg.run.max_samples)
        if checkpointer.due(step) and not (done or final):
            save(st)
        return done

    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), name=a.actor_id, daemon=True) for a in actors]
    for t in threads:
        t.start()
    preempted = False
    try:
        with Preemption(stop, loop, cfg.checkpoint.signal_timeout_seconds, progress) as pre:
            state = loop.run(state, cfg.run.steps, on_step=on_step, stop=stop, start_step=step0)
            preempted = pre.signalled is not None
            stop.set()
            gate.close()
            for t in threads:  # actors leave their in-flight prompts in the ledger: re-issued on resume
                t.join(timeout=30)
            summary["run_dir"] = run_dir
            summary["steps"] = state.step
            summary["samples"] = loop.samples
            summary["dropped"] = dict(loop.dropped)
            summary["dropped_stale"] = loop.dropped.get("stale", 0)
            summary["preempted"] = preempted
            save(state, finished=not preempted, wait=True)
    finally:
        stop.set()
        gate.close()
        transport.close()
        for t in threads:
            t.join(timeout=30)
        writer.close()
        checkpointer.close()
        if actor_engine is not engine:
            actor_engine.close()  # stops the servers it launched
    summary["ledger"] = ledger.verify(stream.position, stream.pending_reissue)
    summary["wall_time"] = clock()
    summary["checkpoint_blocked_seconds"] = checkpointer.blocked_seconds
    if not preempted:
        artifacts.save_params(run_dir, state.params)
        if cfg.model.path:  # a checkpoint came in: ship the trained weights in the same format
            summary["hf_export"] = os.path.join(run_dir, "hf")
            export_policy(policy, state.params, summary["hf_export"])
        summary["final_eval"] = summary.get("last_eval") or evaluate(engine, task, state.params, heldout)
    summary.pop("last_eval", None)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
