"""Wiring for one process: actor threads and the learner share a CPU (or an accelerator).

    summary = train(cfg)    # what `cadence train` runs

Order of events: build the task, model and engines; supervised warm-up; start the actor threads;
the learner loop takes batches and publishes versions; held-out greedy evaluation every
run.eval_every updates; final params, config and summary land in the run directory.
"""
from __future__ import annotations

import functools
import json
import os
import threading
import time

import jax
import numpy as np

from actors.actor_loop import Actor
from actors.engine import JaxEngine
from actors.prompt_stream import PromptStream
from actors.tasks.base import make_task
from launch import artifacts
from launch.config import Config, seq_len as config_seq_len
from launch.metrics import Clock, MetricsWriter, Progress
from launch.policy import build_policy
from learner.controller import make_controller
from learner.factory import make_train_step
from learner.loop import LearnerLoop, LoopSettings, PipelineStopped
from learner.models.llama import count_params, forward
from learner.sft import SFTStep, build_sft_batch
from protocols.admission import AdmissionGate
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


def train(cfg: Config, run_dir: str | None = None, *, wrap_train_step=None, controller=None) -> dict:
    """Run one training job; returns the summary also written to RUN_DIR/summary.json.

    wrap_train_step: tests inject faults (e.g. a deliberately slow learner) by wrapping TrainStep.
    controller: a learner.loop.Controller consulted after every update (batch size, Adam
      hyperparameters, actor concurrency).
    """
    clock = Clock()
    run_dir = artifacts.prepare_run_dir(cfg, run_dir)
    progress = Progress(cfg.run.progress)
    policy = build_policy(cfg)
    tokenizer, graphdef, params = policy.tokenizer, policy.graphdef, policy.params
    task = make_task(cfg.task)
    heldout = task.heldout()
    L = config_seq_len(cfg, task.max_prompt_len)
    logits_fn = functools.partial(forward, graphdef)
    progress.message(f"run dir {run_dir} | task {task.name} | model {count_params(params):,} params | "
                     f"batch {cfg.learner.batch_size} samples (G={cfg.learner.group_size}) | "
                     f"max_staleness {cfg.actors.max_staleness}")
    # One engine for actors and evaluation: jitted calls are thread-safe, and sharing it means the
    # held-out eval runs the program the actors already compiled.
    engine = JaxEngine(policy.model_cfg, graphdef, cfg.engine, tokenizer.eos_id, tokenizer.pad_id)
    eval_engine = engine
    stream = PromptStream(task)
    params, sft_metrics = supervised_warmup(cfg, logits_fn, params, stream, L, tokenizer.pad_id, progress)

    train_step = make_train_step(graphdef, cfg.learner)
    state = train_step.init(params)
    if wrap_train_step is not None:
        train_step = wrap_train_step(train_step)
    G = cfg.learner.group_size
    gate = AdmissionGate(cfg.learner.batch_size, cfg.actors.max_staleness)
    weights = InProcessWeights(state.params, 0, on_publish=lambda v: gate.notify())
    transport = InProcessTransport(maxsize=cfg.actors.queue_size)
    actors = [Actor(f"actor-{i}", engine, task, stream, gate, weights, transport, G, cfg.actors.prompts_per_call,
                    cfg.actors.seed + i)
              for i in range(cfg.actors.num_actors)]

    def health():
        for a in actors:
            if a.error is not None:
                raise PipelineStopped(f"{a.actor_id} failed: {a.error!r}") from a.error

    loop = LearnerLoop(train_step, transport, gate, weights,
                       LoopSettings(cfg.learner.batch_size, G, cfg.learner.microbatch_size, L,
                                    tokenizer.pad_id, cfg.learner.grpo), health=health,
                       controller=controller or make_controller(cfg.controller, cfg.learner, cfg.actors),
                       on_concurrency=lambda c: [a.set_concurrency(c) for a in actors])
    writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))
    record0 = {"step": 0, "samples": 0, "wall_time": clock(), **sft_metrics,
               **evaluate(eval_engine, task, state.params, heldout)}
    writer.write(record0)
    progress.message(f"before RL: held-out exact match {record0['eval/exact_match']:.3f}")

    last = {"t": clock(), "tokens": 0}
    summary = {"target_reached_at": None}

    def enrich(step, m) -> None:
        """Generation-side measurements, added before the controller sees the step."""
        now = clock()
        tokens = sum(a.stats.tokens for a in actors)
        m["wall_time"] = now
        m["actors/tokens_per_second"] = (tokens - last["tokens"]) / max(now - last["t"], 1e-9)
        m["actors/admission_wait_seconds"] = sum(a.stats.admission_wait_seconds for a in actors)
        m["actors/generate_seconds"] = sum(a.stats.generate_seconds for a in actors)
        m["actors/concurrency"] = actors[0].prompts_per_call
        last.update(t=now, tokens=tokens)

    loop.enrich = enrich

    def on_step(step, st, m) -> bool:
        final = step == cfg.run.steps
        if (cfg.run.eval_every and step % cfg.run.eval_every == 0) or final:
            summary["last_eval"] = evaluate(eval_engine, task, st.params, heldout)
            m.update(summary["last_eval"])
            m["wall_time"] = clock()
        writer.write(m)
        if step % cfg.run.log_every == 0 or "eval/exact_match" in m or final:
            progress.line(m)
        em = m.get("eval/exact_match")
        if em is not None and cfg.run.stop_at_exact_match and em >= cfg.run.stop_at_exact_match:
            summary["target_reached_at"] = {"step": step, "samples": m["samples"], "wall_time": m["wall_time"]}
            return True
        return False

    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), name=a.actor_id, daemon=True) for a in actors]
    for t in threads:
        t.start()
    try:
        state = loop.run(state, cfg.run.steps, on_step=on_step, stop=stop)
    finally:
        stop.set()
        gate.close()
        transport.close()
        for t in threads:
            t.join(timeout=30)
        writer.close()
    artifacts.save_params(run_dir, state.params)
    summary.update({
        "run_dir": run_dir,
        "steps": weights.version,
        "samples": loop.samples,
        "wall_time": clock(),
        "dropped_stale": loop.dropped_stale_total,
        "final_eval": summary.get("last_eval") or evaluate(eval_engine, task, state.params, heldout),
    })
    summary.pop("last_eval", None)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
