"""throughput: generation samples/s against concurrency, learner samples/s against batch size,
with the controller's fitted curves (X_gen(c) = c r1 / (1 + c / c_sat); t_step = t_fix + B t_sample)
drawn over the measured points.

Generation is timed through Actor.step (one engine call of c prompts x G completions, scored), the
learner through GRPOTrainStep.update on real rollout groups. Each point is a rate over a window after
one untimed call (compilation): at least `repeats` calls and `min_seconds` of them, total work over
total time (sampled completion lengths vary from call to call, so work is counted per call).
"""
from __future__ import annotations

import os
import time

import jax
import numpy as np

from cadence.actors.actor_loop import Actor
from cadence.actors.engine import JaxEngine
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.tasks.registry import make_task
from cadence.launch.observe import plots
from cadence.launch.config import Config, seq_len as config_seq_len
from cadence.launch.experiments import common
from cadence.learner.models.policy import build_policy
from cadence.learner.batching import build_microbatches
from cadence.learner.controller.throughput import GenerationThroughput, LearnerThroughput
from cadence.learner.steps import make_train_step
from cadence.protocols.weights import InProcessWeights

QUICK = dict(concurrencies=(1, 2, 4, 8), batch_sizes=(16, 32, 64), repeats=2, min_seconds=0.0)
FULL = dict(concurrencies=(1, 2, 4, 8, 16, 32, 64), batch_sizes=(32, 64, 128, 256, 512, 1024), repeats=5,
            min_seconds=2.0)


def _window(fn, repeats: int, min_seconds: float) -> tuple[float, list]:
    """(seconds, results) of calls to fn: at least `repeats` calls and `min_seconds`, after one
    untimed call. Millisecond calls on shared cores need the window, not a median of five."""
    fn()  # compile / warm caches
    results, seconds = [], 0.0
    while len(results) < repeats or seconds < min_seconds:
        t0 = time.perf_counter()
        results.append(fn())
        seconds += time.perf_counter() - t0
    return seconds, results


def measure(base: Config, concurrencies, batch_sizes, repeats: int, min_seconds: float = 0.0,
            log=print) -> dict:
    """Measured points: generation (c, samples/s, tokens/s) and learner (B, seconds/step, samples/s)."""
    policy = build_policy(base)
    task = make_task(base.task)
    G = base.learner.group_size
    engine = JaxEngine(policy.model_cfg, policy.graphdef, base.engine, policy.tokenizer.eos_id,
                       policy.tokenizer.pad_id)
    stream = PromptStream(task)
    weights = InProcessWeights(policy.params, 0)
    actor = Actor("probe", engine, task, None, weights, G, 1, base.actors.seed)
    gen = []
    for c in concurrencies:
        prompts = stream.take(c)
        total, calls = _window(lambda: actor.step(prompts), repeats, min_seconds)
        tokens = sum(len(g.completion_tokens.values) for groups in calls for g in groups)
        secs = total / len(calls)  # per call
        gen.append({"concurrency": c, "seconds": secs, "samples_per_second": c * G / secs,
                    "tokens_per_second": tokens / total, "calls": len(calls)})
        log(f"  generation c={c:<4} {c * G / secs:8.1f} samples/s ({len(calls)} calls)")
    # learner: real groups from the engine, as many as the largest batch needs
    groups = actor.step(stream.take(max(batch_sizes) // G))
    ts = make_train_step(policy.graphdef, base.learner, completion_budget=base.engine.max_new_tokens,
                         temperature=base.engine.temperature)
    state = {"s": ts.init(policy.params)}  # each update donates the moments: keep the newest state
    L = config_seq_len(base, task.max_prompt_len)
    learn = []
    for b in batch_sizes:
        mb_size = min(base.learner.microbatch_size, b)
        mbs, stats = build_microbatches(groups[: b // G], L, mb_size, policy.tokenizer.pad_id, base.learner.grpo)

        def step():
            state["s"], m = ts.update(state["s"], mbs, stats["num_tokens"])  # host floats: synced
            return m

        total, calls = _window(step, repeats, min_seconds)
        secs = total / len(calls)
        learn.append({"batch_size": b, "seconds": secs, "samples_per_second": b / secs,
                      "tokens_per_second": stats["num_tokens"] / secs, "calls": len(calls)})
        log(f"  learner    B={b:<5} {b / secs:8.1f} samples/s")
    return {"generation": gen, "learner": learn, "group_size": G}


def fit(points: dict) -> tuple[GenerationThroughput, LearnerThroughput]:
    """The controller's models fitted to the measured points."""
    g = GenerationThroughput(num_engines=1, decay=0.0)
    for p in points["generation"]:
        g.observe(p["concurrency"], p["samples_per_second"])
    lt = LearnerThroughput(decay=0.0)
    for p in points["learner"]:
        lt.observe(p["batch_size"], p["seconds"])
    return g, lt


def plot(points, g, lt, path):
    cs = np.array([p["concurrency"] for p in points["generation"]], float)
    grid_c = np.geomspace(cs.min(), cs.max() * 2, 50)
    bs = np.array([p["batch_size"] for p in points["learner"]], float)
    grid_b = np.geomspace(bs.min(), bs.max() * 2, 50)
    plots.save_png([
        plots.Panel("", "concurrency (prompts per engine call)", "generation samples/s", [
            plots.Line(cs, [p["samples_per_second"] for p in points["generation"]], "measured", "o"),
            plots.Line(grid_c, [g.predict(c) for c in grid_c], "fit c r1 / (1 + c / c_sat)", "-")], xlog2=True),
        plots.Panel("", "batch size (samples)", "learner samples/s", [
            plots.Line(bs, [p["samples_per_second"] for p in points["learner"]], "measured", "o"),
            plots.Line(grid_b, [lt.predict(x) for x in grid_b], "fit B / (t_fix + B t_sample)", "-")], xlog2=True),
    ], path)


def run(base: Config, out: str, quick: bool, log=print, **opts) -> dict:
    p = {**(QUICK if quick else FULL), **{k: v for k, v in opts.items() if v is not None and k in QUICK}}
    log(f"throughput ({'quick' if quick else 'full'}): concurrency {p['concurrencies']}, B {p['batch_sizes']}")
    points = measure(base, p["concurrencies"], p["batch_sizes"], p["repeats"], p["min_seconds"], log=log)
    g, lt = fit(points)
    r1, c_sat = g.curve()
    t_fix, t_sample = lt.cost()
    results = {"experiment": "throughput", "quick": quick, "params": p, "points": points,
               "generation_fit": {"r1": r1, "c_sat": c_sat}, "learner_fit": {"t_fix": t_fix, "t_sample": t_sample},
               "device": str(jax.devices()[0])}
    common.write_json(os.path.join(out, "results.json"), results)
    plot(points, g, lt, os.path.join(out, "throughput.png"))
    report = "\n\n".join([
        "# Throughput",
        f"Device {results['device']}. Generation: one engine call of c prompts x G={points['group_size']} "
        "completions (Actor.step, scoring included). Learner: one GRPOTrainStep.update on real rollouts.",
        f"Generation fit: r1 = {r1:.4g} samples/s per unit concurrency, c_sat = {c_sat:.4g}. "
        f"Learner fit: t_fix = {t_fix * 1e3:.3g} ms, t_sample = {t_sample * 1e3:.3g} ms.",
        common.markdown_table(["concurrency", "samples/s", "tokens/s", "fit samples/s"],
                              [[q["concurrency"], q["samples_per_second"], q["tokens_per_second"],
                                g.predict(q["concurrency"])] for q in points["generation"]]),
        common.markdown_table(["batch size", "seconds/step", "samples/s", "fit samples/s"],
                              [[q["batch_size"], q["seconds"], q["samples_per_second"], lt.predict(q["batch_size"])]
                               for q in points["learner"]]),
        "![throughput](throughput.png)",
    ])
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report + "\n")
    log(f"throughput: report {out}/report.md")
    return results
