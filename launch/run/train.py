"""`cadence train`: one training job, joined from its named parts.

    summary = train(cfg)                  # what `cadence train` runs
    summary = train(cfg, resume="auto")   # continue from the newest complete checkpoint, if any

The parts: run_state (where the run starts: a checkpoint's arrays, ledger, stream position and
queued groups, or a fresh directory), the supervised warm-up, the Pipeline (dispatcher, weight
server, actor threads or processes; launch/run/pipeline.py), the LearnerLoop (learner/loop.py), the
Recorder (evaluation, metrics, checkpoints after each update; launch/run/recorder.py) and the
Lifecycle (SIGTERM/SIGINT: a final checkpoint within one deadline, exit 0; launch/run/lifecycle.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax

from cadence.actors.engine import JaxEngine
from cadence.actors.env_runner import EnvRunner
from cadence.actors.evaluation import evaluate_heldout
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.rewards import make_scorer
from cadence.actors.tasks.base import is_multi_turn
from cadence.launch import artifacts, compile_cache
from cadence.launch.host_memory import HeapTrimmer, release_free_heap
from cadence.launch.run import run_state
from cadence.launch.config_loader import ConfigError, to_dict
from cadence.launch.config import Config, actor_processes, preflight, seq_len as config_seq_len
from cadence.launch.cluster.learner_group import LearnerProcesses  # [sharded learner]
from cadence.launch.run.lifecycle import Lifecycle
from cadence.launch.run.lora_policy import LoraPolicy, LoraWeights, save_merged
from cadence.launch.metrics import Progress
from cadence.launch.run.pipeline import Pipeline, start_actor_processes
from cadence.actors.sglang.build import sglang_engine
from cadence.learner.models.policy import build_policy, export_policy
from cadence.launch.observe.sinks import open_sinks
from cadence.launch.run.recorder import Recorder, arrays_of
from cadence.learner import packing, row_plan, sharding
from cadence.learner.checkpoint import Checkpointer
from cadence.learner.controller import Generation, make_controller
from cadence.learner.dynamic_sampling import make_group_filter
from cadence.learner.loop import LearnerLoop, LoopSettings
from cadence.learner.models import lora
from cadence.learner.models.llama import count_params
from cadence.learner.steps import make_train_step
from cadence.learner.steps.scoring import llama_logits
from cadence.learner.steps.sft_step import SFTStep, build_sft_batch
from cadence.protocols.weights import InProcessWeights

def evaluate(engine: JaxEngine, task, params, prompts=None, scorer=None, envs=None) -> dict:
    """Greedy decoding on the held-out set: eval/reward, eval/exact_match (tasks with answers) and
    the task's own metrics (actors/evaluation.py). scorer: where rewards run (default inline);
    envs: where a multi-turn task's environment calls run."""
    return evaluate_heldout(engine, task, params, prompts, scorer, envs)


def supervised_warmup(cfg: Config, logits_fn, params, stream: PromptStream, seq_len: int, pad_id: int,
                      progress: Progress, sft: SFTStep | None = None):
    """A few cross-entropy steps on task answers, with their own Adam and fixed lr (sft: the
    step to use, e.g. a sharded one)."""
    sft_cfg = cfg.learner.sft
    if sft_cfg.steps == 0:
        return params, {}
    sft = sft or SFTStep(logits_fn, sft_cfg, logits_chunk=cfg.learner.logits_chunk)
    opt_state = sft.init(params)
    loss = None
    if not stream.task.prompt(stream.position).answer:
        progress.message("supervised warm-up: skipped (the task has no reference answers)")
        return params, {}
    for _ in range(sft_cfg.steps):
        prompts = stream.take(sft_cfg.batch_size)
        batch = build_sft_batch([p.tokens for p in prompts], [p.answer for p in prompts], seq_len, pad_id,
                                answer_masks=[p.answer_mask for p in prompts])  # tool output: not trained on
        params, opt_state, metrics = sft.update(params, opt_state, batch)
        loss = metrics["loss"]
    progress.message(f"supervised warm-up: {sft_cfg.steps} steps, final loss {float(loss):.3f}")
    return params, {"sft/loss": float(loss), "sft/steps": sft_cfg.steps}


def train(cfg: Config, run_dir: str | None = None, *, resume: str = "no", wrap_train_step=None,
          controller=None) -> dict:
    """Run one training job; returns the summary also written to RUN_DIR/summary.json.

    resume: "no" (a new run), "auto" (continue from the newest complete checkpoint if there is
      one, else start), "yes" (continue, and fail if there is nothing to continue).
    wrap_train_step: tests inject faults (e.g. a deliberately slow learner) by wrapping the step.
    controller: a learner.controller.Controller, the owner of the batch size, Adam's
      hyperparameters and the actors' concurrency (default: make_controller(cfg.controller, ...));
      a resume hands it the checkpoint's state.
    Raises ConfigError (a resume with changed frozen keys, nothing to resume), RunFinished.
    """
    resolved = preflight(cfg)  # the checks that build the task and load the tokenizer (ConfigError)
    compile_cache.enable(cfg.run.jax_cache)  # before the first compile (launch/compile_cache.py)
    procs = LearnerProcesses.start(cfg, resolved.model)  # [sharded learner] before any JAX work
    run_dir, resuming = run_state.locate(cfg, run_dir, resume)
    progress = Progress(cfg.run.progress)
    # Actor processes start now and build their model and engine while the learner builds its own
    # and warms up (they join the dispatcher at pipe.start()); stopped here if the learner fails first.
    early = start_actor_processes(cfg, run_dir, progress.message, config_dict=to_dict(cfg)) \
        if cfg.actors.processes and procs.group.is_leader else None
    try:
        learner = _build_learner(cfg, procs, run_dir, resume, resuming, progress, wrap_train_step, resolved.task)
        if not isinstance(learner, _Learner):
            return learner  # [sharded learner] a following process: its part of the run is over
        run = _build_run(cfg, run_dir, procs, learner, progress, early, controller)
    except BaseException:
        if early is not None:
            early.stop(5.0)
        raise
    state, preempted = _drive(cfg, run_dir, learner, run, progress)
    summary = _finish(cfg, run_dir, learner, state, preempted, procs)
    run.sinks.finish(summary)  # heartbeat: finished / preempted
    procs.stop()  # [sharded learner] the other processes exit
    return summary


@dataclasses.dataclass
class _Learner:
    """The learner side of a run, positioned where the run starts (a checkpoint or step 0)."""

    policy: object  # learner.models.policy.Policy
    task: object
    train_step: object
    checkpointer: Checkpointer
    begin: object  # run_state.Begin: stream, ledger, summary, clock, meta
    state: object  # the train state at begin.step0
    engine: JaxEngine  # actor threads and evaluation share it
    scorer: object
    evaluate_params: object  # params -> eval metrics (None: the actors evaluate; see eval_on_actors)
    sft_metrics: dict
    seq_len: int
    learner_cfg: object  # cfg.learner with the rows re-planned for this mesh (learner/row_plan.py)
    plan_notes: tuple  # what that re-plan changed
    # state.params -> the policy's plain-model params (LoRA: base + adapters merged; else itself)
    policy_params: object = None
    lora_base: dict | None = None  # LoRA: the frozen base's path and sha256 (checkpoint meta)
    lora: LoraPolicy | None = None  # LoRA: the whole base on process 0, and how adapters join it
    eval_on_actors: bool = False  # held-out evaluation is work for the actor processes (Pipeline.evaluate)


def _build_learner(cfg: Config, procs: LearnerProcesses, run_dir: str, resume: str, resuming: bool,
                   progress: Progress, wrap_train_step, task) -> _Learner | dict:
    """Model, train step, checkpointer and the state to start from (restored or warmed up), for
    the task preflight built (a dataset is read once). A following process of a sharded learner
    runs its whole part here and returns its summary."""
    # [sharded learner] params on the mesh; the tokenizer preflight loaded for the task (not twice)
    policy = build_policy(cfg, procs.layout, task.tokenizer)
    graphdef, params0, lora_base = _lora_model(cfg, policy, procs)  # LoRA: base joined with adapters
    L, G = config_seq_len(cfg, task.max_prompt_len, task), cfg.learner.group_size
    rows = procs.layout.rows if procs.layout else 1
    try:  # a packed row: L unless learner.row_tokens sets it
        R = packing.packed_row_len(cfg.learner, L)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    packed = row_plan.plan_packed_rows(procs.learner, R, rows)  # the same in every process
    learner_cfg, plan_notes = packed.learner, procs.plan_notes + packed.notes
    if learner_cfg.microbatch_tokens > 0:  # packed rows are R long: the budget must hold whole rows
        try:
            packing.rows_per_microbatch(learner_cfg.microbatch_tokens, R, rows)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    train_step = make_train_step(graphdef, learner_cfg, procs.layout,  # [sharded learner]
                                 completion_budget=cfg.engine.max_new_tokens, temperature=cfg.engine.temperature)
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoint)
    # [sharded learner] processes 1..N-1 run process 0's collective calls; process 0 goes on, leading
    logits_fn = llama_logits(graphdef, cfg.learner.remat)  # LoRA: the warm-up trains the adapters alone
    sft_step = SFTStep(logits_fn, learner_cfg.sft, procs.layout, logits_chunk=cfg.learner.logits_chunk,
                       lora=learner_cfg.lora)
    # LoRA: the final params are merged on the mesh by every process, then written
    save_params = save_merged(train_step, artifacts.save_params) if lora_base else artifacts.save_params
    if not procs.group.is_leader:  # params0: the group's first params generation (LoRA: base + adapters)
        return procs.follow(params0, train_step, checkpointer, arrays_of, sft_step, save_params,
                            actors_cfg=None if _actor_threads(cfg) else cfg.actors, run_dir=run_dir)
    train_step, checkpointer, sft_step = procs.lead(params0, train_step, checkpointer, sft_step)
    for note in plan_notes:  # a mesh the configured rows do not split over: re-planned, not refused
        progress.message(f"re-planned for data x fsdp = {rows} row devices: {note}")
    if resuming:  # LoRA or not, same base: checked before orbax restores into the template
        run_state.check_lora_base(run_dir, run_state.newest_meta(checkpointer.directory), lora_base)
    template = train_step.init(params0) if resuming else None
    begin = run_state.begin(cfg, run_dir, checkpointer, template and arrays_of(template), task, progress, resume,
                            resuming)
    progress.message(f"run dir {run_dir} | task {task.name} | model {count_params(policy.params):,} params | "
                     f"batch {cfg.learner.batch_size} samples (G={G}) | max_staleness {cfg.actors.max_staleness}")
    # One engine for actor threads and evaluation: jitted calls are thread-safe, and sharing it means
    # the held-out eval runs the program the actors already compiled.
    if cfg.engine.tensor_parallel > jax.local_device_count():  # known only once JAX runs here
        raise ConfigError(f"engine.tensor_parallel: {cfg.engine.tensor_parallel} devices asked, but this process "
                          f"has {jax.local_device_count()}")
    engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, policy.tokenizer.eos_id, policy.tokenizer.pad_id)
    scorer = make_scorer(cfg.task, task, policy.tokenizer)  # rewards: worker pool, HTTP server or inline
    envs = EnvRunner.from_config(cfg.task) if is_multi_turn(task) else None  # the run's env limits
    evaluate_whole = functools.partial(evaluate, engine, task, prompts=task.heldout(), scorer=scorer, envs=envs)
    sft_metrics = {}
    if begin.restored:
        state = template._replace(**begin.arrays, step=begin.step0)
        if cfg.run.resume_digest:  # proves a reshard onto another process count kept every bit
            begin.summary["resumed_from"][-1].update(
                params_sha256=artifacts.params_digest(procs.gather(state.params)),
                learner_processes=procs.group.num_processes)
    else:  # warm up first: PPO's reference policy and critic trunk start from the weights RL starts from
        params, sft_metrics = supervised_warmup(dataclasses.replace(cfg, learner=learner_cfg), logits_fn,
                                                params0, begin.stream, L,
                                                policy.tokenizer.pad_id, progress, sft_step)  # [sharded learner]
        begin.ledger.warmup(begin.stream.position)
        state = train_step.init(params)
    lora_policy = None
    if lora_base:  # evaluation, actors and exports see base + adapters merged, whole on process 0
        lora_policy = LoraPolicy(procs, cfg.learner.lora, train_step.frozen)  # while params0 is alive
        policy_params, evaluate_params = lora_policy, _after(lora_policy, evaluate_whole)
    else:
        policy_params, evaluate_params = (lambda params: params), procs.on_whole(evaluate_whole)  # [sharded learner]
    on_actors = _eval_on_actors(cfg, procs)
    if on_actors:  # the actor processes evaluate: nothing here gathers the model (Pipeline.evaluate)
        evaluate_params = None
        progress.message("held-out evaluation: work for the actor processes (run.eval_on="
                         f"{cfg.run.eval_on})")
    else:
        evaluate_params = _timed(evaluate_params)
    if wrap_train_step is not None:
        train_step = wrap_train_step(train_step)
    return _Learner(policy, task, train_step, checkpointer, begin, state, engine, scorer, evaluate_params,
                    sft_metrics, L, learner_cfg, plan_notes, policy_params, lora_base, lora_policy, on_actors)


def _eval_on_actors(cfg: Config, procs: LearnerProcesses) -> bool:
    """run.eval_on: "auto" is the actors when they are processes and the learner is sharded (its
    own evaluation would gather the whole model onto process 0), the learner otherwise."""
    if cfg.run.eval_on != "auto":
        return cfg.run.eval_on == "actors"
    return actor_processes(cfg.actors) and (procs.layout is not None or procs.group.distributed)


def _timed(evaluate):
    """evaluate, adding eval/seconds (how long it took) to its metrics."""
    def timed(params):
        t0 = time.monotonic()
        metrics = evaluate(params)
        return {**metrics, "eval/seconds": time.monotonic() - t0}

    return timed


def _actor_threads(cfg: Config) -> bool:
    """Actor threads in the learner's process (their built-in engine needs the whole model)."""
    return cfg.actors.num_actors > 0 and not cfg.actors.processes


def _after(first, then):
    return lambda params: then(first(params))


def _lora_model(cfg: Config, policy, procs: LearnerProcesses):
    """(graphdef, params, base record) the learner trains: the policy's own, or with
    learner.lora.rank > 0 the LoRA model (fresh adapters joined with the frozen base) and the
    base's path and sha256, which checkpoints record and a resume checks."""
    lora_cfg = cfg.learner.lora
    if not lora_cfg.rank:
        return policy.graphdef, policy.params, None
    graphdef, adapters = lora.init_adapters(policy.model_cfg, lora_cfg, cfg.learner.seed)
    # a group's processes each hold shards of the base: they hash it a gathered leaf at a time, together
    fetch = (lambda leaves: sharding.gather(leaves, procs.layout)) if procs.group.distributed else None
    base = {"path": policy.model_cfg.path, "sha256": artifacts.params_digest(policy.params, fetch),
            "rank": lora_cfg.rank, "alpha": lora_cfg.alpha, "targets": list(lora_cfg.targets)}
    return graphdef, lora.join(policy.params, adapters), base


@dataclasses.dataclass
class _Run:
    """What feeds and drives the learner: the pipeline, the loop, and where its records go."""

    pipe: Pipeline
    loop: LearnerLoop
    recorder: Recorder
    on_step: object  # (step, state, metrics) -> stop?: the recorder's, the first record noting a re-plan
    sinks: object  # launch.observe.sinks: metrics.jsonl, loggers, Prometheus, heartbeat
    actor_engine: object  # the JaxEngine, or SGLang servers this process drives
    evaluate: object  # params -> eval metrics: the learner's own engine, or work for the actors
    record0: dict | None = None  # a new run's step-0 record, written once the actors evaluated it


def _build_run(cfg: Config, run_dir: str, procs: LearnerProcesses, learner: _Learner, progress: Progress,
               early, controller) -> _Run:
    """The pipeline (dispatcher, weights, actors), the learner loop and its recorder, resumed
    where the learner's begin says; records step 0 (held-out eval) on a new run."""
    policy, begin, state, G = learner.policy, learner.begin, learner.state, cfg.learner.group_size
    meta = begin.meta
    # The controller owns B, Adam's hyperparameters and the concurrency; the rest apply its course.
    controller = controller or make_controller(cfg.controller, learner.learner_cfg, cfg.actors)
    if begin.restored:
        _restore_controller(controller, meta)
    refit = _fit_mesh(controller, learner, procs, progress)  # B in force that splits over this mesh
    course = controller.course()
    # SGLang servers here only for actor threads; actor processes drive servers of their own
    # (launch/cluster/actor_process.py), fed by the weight server like any actor process.
    threads_drive_sglang = cfg.actors.engine == "sglang" and not cfg.actors.processes and cfg.actors.num_actors > 0
    actor_engine = sglang_engine(cfg, policy, cfg.actors.sglang.work_dir or os.path.join(run_dir, "sglang"),
                                 procs.fetch) if threads_drive_sglang else learner.engine
    # [sharded learner] actor threads get whole weights (an SGLang sync in this process fetches
    # them itself); with no actor threads here, actor processes fetch buckets of the shards
    # (learner/weight_stream.py) and nothing in this process needs the whole model
    stream = None if _actor_threads(cfg) else procs.shard_stream(cfg.actors)
    publish = procs.publisher(whole=not threads_drive_sglang and stream is None)
    # LoRA with actor threads: they get base + adapters merged, whole, and actor processes the whole
    # adapters alone (LoraWeights). Streamed from the shards, a LoRA run publishes as any other:
    # the adapters are the params, and actor processes merge them into their own base.
    lora_run = learner.lora is not None and stream is None
    if lora_run:
        remote = learner.lora.whole_adapters(state.params)
        first = learner.lora.merged(remote)
    else:
        remote, first = None, publish(state.params)
    pipe = Pipeline(cfg, run_dir, learner.task, begin.stream, begin.ledger, course.batch_size,
                    InProcessWeights(first, begin.step0),
                    actor_engine, list(begin.ledger.queued.values()), progress, to_dict(cfg), learner.scorer,
                    supervisor=early, remote_params=remote, shard_stream=stream,
                    weights_shards=procs.weights_shards() if stream is not None else ())
    if course.concurrency is not None and course.concurrency != cfg.actors.prompts_per_call:
        pipe.set_concurrency(course.concurrency)  # a resumed run: where the controller had moved it
    clock = begin.clock
    # metrics.jsonl + run.loggers + Prometheus, and the heartbeat `cadence status` reads (launch/observe/sinks.py)
    sinks = open_sinks(cfg.run, run_dir, to_dict(cfg), resumed=begin.restored, step0=begin.step0)
    # the actors evaluate version v while it is the newest (the learner waits on its on_step)
    evaluate = learner.evaluate_params or (lambda params: pipe.evaluate(pipe.version))
    record0 = None
    if not begin.restored:
        record0 = {"step": 0, "samples": 0, "wall_time": clock(), **learner.sft_metrics}
        if not learner.eval_on_actors:  # else once the actors have joined (_drive)
            _write_record0(sinks, progress, record0, evaluate(state.params))
            record0 = None
    # LoRA: actor processes fetch the adapters alone and merge them into their own base
    weights = LoraWeights(pipe, learner.lora) if lora_run else pipe
    loop = LearnerLoop(learner.train_step, pipe.queue, pipe.gate, weights,
                       LoopSettings(G, learner.learner_cfg.microbatch_size,
                                    packing.packed_row_len(learner.learner_cfg, learner.seq_len),
                                    policy.tokenizer.pad_id, cfg.learner.grpo, learner.learner_cfg.microbatch_tokens,
                                    learner.learner_cfg.skip_zero_advantage, learner.learner_cfg.share_prompts),
                       health=pipe.health, controller=controller, on_concurrency=pipe.set_concurrency,
                       ledger=begin.ledger, publish=None if lora_run else publish,  # [sharded learner]
                       # its rates count from now: after the step-0 evaluation
                       measure_generation=_generation_meter(cfg, pipe, actor_engine, begin),
                       group_filter=make_group_filter(cfg.learner),  # dynamic sampling (None when off)
                       before_update=_before_update(learner.checkpointer),
                       samples=meta["samples"] if begin.restored else 0,
                       dropped=meta["dropped"] if begin.restored else None)
    if refit is not None:  # Adam's rescale (and the concurrency) before the first update
        learner.state = loop.apply(learner.state, refit)
    snapshot = functools.partial(_snapshot, cfg, loop, pipe, begin, controller, clock, learner.lora_base)
    recorder = Recorder(cfg.run, sinks, progress, evaluate, learner.checkpointer, begin.summary,
                        clock, snapshot, samples0=loop.samples)
    notes = [*learner.plan_notes, *([refit.reason] if refit is not None else [])]
    return _Run(pipe, loop, recorder, _noting(recorder.on_step, "; ".join(notes)), sinks, actor_engine, evaluate,
                record0)


def _write_record0(sinks, progress: Progress, record0: dict, metrics: dict) -> None:
    """A new run's step-0 record: the held-out evaluation before RL."""
    record0 = {**record0, **metrics}
    sinks.write(record0)
    if "eval/exact_match" in record0 or "eval/reward" in record0:  # {}: a stop signal cut it short
        before = ("exact match", record0["eval/exact_match"]) if "eval/exact_match" in record0 else \
            ("reward", record0["eval/reward"])
        progress.message(f"before RL: held-out {before[0]} {before[1]:.3f}")


def _fit_mesh(controller, learner: _Learner, procs: LearnerProcesses, progress: Progress):
    """The controller's Decision moving the B in force (configured, or the checkpoint's) to a
    multiple of group x the re-planned microbatch, with the scaling rule's Adam values; None
    when it already is one. An elastic restart on fewer (or more) devices lands here."""
    lc = learner.learner_cfg
    multiple = math.lcm(lc.group_size, lc.microbatch_size)
    b = controller.course().batch_size
    rows = procs.layout.rows if procs.layout else 1
    if not hasattr(controller, "fit"):  # a controller of the caller's own that cannot move B
        if b % multiple:
            raise ConfigError(f"learner.batch_size: {b} is not a multiple of group x microbatch = {multiple} on "
                              f"data x fsdp = {rows} devices, and the controller given cannot refit it")
        return None
    decision = controller.fit(multiple, f"data x fsdp = {rows} devices, microbatch {lc.microbatch_size}, "
                                        f"group {lc.group_size}")
    if decision is not None:
        progress.message(decision.reason)
    return decision


def _before_update(checkpointer: Checkpointer):
    """Waits for a background save (the update donates the Adam moments it may still be reading),
    then returns to the OS what the batch's generation and the save freed but kept in the heaps
    (launch/host_memory.py): otherwise it stays resident through the gradient pass."""
    trim = HeapTrimmer()

    def before():
        checkpointer.wait()
        trim()

    return before


def _noting(on_step, note: str):
    """on_step, with `note` added to the first record's controller/decision (a re-plan for the mesh
    takes effect from the first update after a start)."""
    if not note:
        return on_step
    pending = [note]

    def noted(step, state, metrics):
        if pending:
            metrics["controller/decision"] = "; ".join(filter(None, (pending.pop(), metrics.get("controller/decision"))))
        return on_step(step, state, metrics)

    return noted


def _drive(cfg: Config, run_dir: str, learner: _Learner, run: _Run, progress: Progress):
    """Runs the pipeline and the loop to the last step or a stop signal, then saves the final
    checkpoint and stops everything the run started. Returns (state, preempted)."""
    pipe, loop, summary = run.pipe, run.loop, learner.begin.summary
    preempted = False
    with Lifecycle(cfg.checkpoint.signal_timeout_seconds, on_stop=[pipe.abort], message=progress.message) as life:
        pipe.start()
        try:
            if run.record0 is not None:  # the actors evaluate the starting weights once they joined
                _write_record0(run.sinks, progress, run.record0, run.evaluate(learner.state.params))
            state = loop.run(learner.state, cfg.run.steps, on_step=run.on_step, stop=life.stop,
                             start_step=learner.begin.step0)
            preempted = life.signalled is not None
            if learner.eval_on_actors and not preempted and not summary.get("last_eval"):
                summary["last_eval"] = run.evaluate(state.params)  # the final one, while the actors are here
            pipe.stop(time.monotonic() + life.remaining(cap=30.0), finished=not preempted)
            summary.update(run_dir=run_dir, steps=state.step, samples=loop.samples, dropped=dict(loop.dropped),
                           dropped_stale=loop.dropped.get("stale", 0), reward_errors=dict(loop.reward_errors),
                           preempted=preempted)
            release_free_heap()  # the final evaluation's leftovers, before the write's own transient
            run.recorder.save(state, finished=not preempted, wait=True)
            release_free_heap()  # what the writer's threads freed (launch/host_memory.py)
        finally:
            pipe.stop(time.monotonic() + life.remaining(cap=5.0), finished=False)  # no-op after a clean stop
            run.sinks.close()
            learner.checkpointer.close()
            if run.actor_engine is not learner.engine:
                run.actor_engine.close()  # stops the servers it launched
            learner.scorer.close()  # stops the reward workers
    return state, preempted


def _restore_controller(controller, meta: dict) -> None:
    """The checkpoint's controller state, at the course the run was in: the loop's B and the
    dispatcher's concurrency as the checkpoint recorded them (before the controller owned them, its
    own record of B could lag a change made at the checkpoint's step)."""
    course = {k: meta[k] for k in ("batch_size", "concurrency") if meta.get(k)}
    controller.load_state_dict({**(meta.get("controller") or {}), **course})


def _generation_meter(cfg, pipe: Pipeline, actor_engine, begin):
    """(step, record) -> the generation side's Generation counters for the controller; adds the
    generation-side measurements to the step's record."""
    clock = begin.clock
    c = begin.ledger.counts()
    before = 0 if not begin.restored else cfg.learner.group_size * (c["consumed"] + c["queued"] + c["dropped"])
    last = {"t": clock(), "tokens": 0}

    def measure(step, m) -> Generation:
        now = clock()
        pm = pipe.metrics()
        tokens = pm.pop("actors/tokens_received")
        m["wall_time"] = now
        m["actors/tokens_per_second"] = (tokens - last["tokens"]) / max(now - last["t"], 1e-9)
        m["actors/generate_seconds"] = pm.pop("actors/generate_seconds")
        if pipe.actors:  # actor threads: time blocked waiting for a grant (the staleness bound)
            m["actors/admission_wait_seconds"] = sum(a.stats.wait_seconds for a in pipe.actors)
        # cumulative over the run's life (a resumed run starts from what its checkpoint had produced)
        m["actors/samples"] = before + pm.pop("actors/samples_received")
        m.update(pm)
        m["queue/depth"] = pipe.queue.qsize()  # groups waiting for the learner (sinks: Prometheus)
        # the engine's own counters (SGLang in this process, for actor threads: cumulative; the built-in: none)
        m.update({f"{actor_engine.name}/{k}": v for k, v in actor_engine.counters().items()})
        last.update(t=now, tokens=tokens)
        return Generation(wall_time=now, tokens_per_second=m["actors/tokens_per_second"],
                          generate_seconds=m["actors/generate_seconds"], concurrency=m["actors/concurrency"])

    return measure


def _snapshot(cfg, loop: LearnerLoop, pipe: Pipeline, begin, controller, clock, lora_base, state,
              finished: bool) -> dict:
    """Everything besides arrays that the run needs to continue, taken at a step boundary."""
    ledger, stream = begin.ledger, begin.stream
    with ledger.lock:  # the dispatcher cannot move prompts between states while we look
        meta = {"stream_position": stream.position, "reissue": stream.pending_reissue, "ledger": ledger.state_dict()}
    meta.update({
        "step": state.step, "version": pipe.version, "samples": loop.samples, "wall_time": clock(),
        "finished": finished, "dropped": dict(loop.dropped), "batch_size": loop.batch_size,
        "concurrency": pipe.concurrency,
        "controller": controller.state_dict(),
        "summary": {k: v for k, v in begin.summary.items() if k != "last_eval"},
        "actors_seed": cfg.actors.seed, "config": to_dict(cfg),
    })
    if lora_base:  # the arrays are adapters: which base they belong to (the base is never written)
        meta["lora_base"] = lora_base
    return meta


def _finish(cfg: Config, run_dir: str, learner: _Learner, state, preempted: bool, procs: LearnerProcesses) -> dict:
    """The ledger's verdict, the final weights and eval (unless preempted), and summary.json."""
    begin, summary = learner.begin, learner.begin.summary
    summary["ledger"] = begin.ledger.verify(begin.stream.position, begin.stream.pending_reissue)
    summary["wall_time"] = begin.clock()
    summary["checkpoint_blocked_seconds"] = learner.checkpointer.blocked_seconds
    if not preempted:
        if learner.lora is None:
            params = state.params
            procs.save_params(run_dir, params, artifacts.save_params)  # [sharded learner] every process
        else:  # every process merges its shards of base + adapters and writes them; exports: whole here
            procs.save_params(run_dir, state.params, save_merged(learner.train_step, artifacts.save_params))
            adapters = learner.lora.whole_adapters(state.params)
            params = learner.lora.merged(adapters)
        release_free_heap()  # what orbax's threads freed
        if cfg.model.path:  # a checkpoint came in: ship the trained weights in the same format
            summary["hf_export"] = os.path.join(run_dir, "hf")
            export_policy(learner.policy, params, summary["hf_export"], fetch=procs.fetch)  # a shard at a time
        if learner.lora is not None:  # and the adapters alone, as PEFT loads them
            summary["peft_adapter"] = lora.write_peft_adapter(adapters, cfg.learner.lora,
                                                              os.path.join(run_dir, "peft"), cfg.model.path)
        del params
        final = summary.get("last_eval")
        if not final and learner.evaluate_params is not None:  # the actors' final one ran in _drive
            final = learner.evaluate_params(state.params)
        summary["final_eval"] = final or {}
    summary.pop("last_eval", None)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary

