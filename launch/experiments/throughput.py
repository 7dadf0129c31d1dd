"""throughput: generation samples/s against concurrency, learner samples/s against batch size,
with the controller's fitted curves (X_gen(c) = c r1 / (1 + c / c_sat); t_step = t_fix + B t_sample)
drawn over the measured points, and optionally the whole pipeline's samples/s X(B): a short real
run per batch size (asynchronous, the base config's max_staleness), timed between its updates.

Generation is timed through Actor.step (one engine call of c prompts x G completions, scored), the
learner through GRPOTrainStep.update on real rollout groups. Each point is a rate over a window after
one untimed call (compilation): at least `repeats` calls and `min_seconds` of them, total work over
total time (sampled completion lengths vary from call to call, so work is counted per call).
"""
from __future__ import annotations

import dataclasses
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
from cadence.launch.metrics import read_metrics
from cadence.learner.models.policy import build_policy
from cadence.learner.packing import layout_microbatches, packed_row_len
from cadence.learner.controller.throughput import GenerationThroughput, LearnerThroughput, pipeline_throughput
from cadence.learner.steps import make_train_step
from cadence.protocols.weights import InProcessWeights

QUICK = dict(concurrencies=(1, 2, 4, 8), batch_sizes=(16, 32, 64), repeats=2, min_seconds=0.0,
             pipeline_batch_sizes=(), pipeline_updates=4)
FULL = dict(concurrencies=(1, 2, 4, 8, 16, 32, 64), batch_sizes=(32, 64, 128, 256, 512, 1024), repeats=5,
            min_seconds=2.0, pipeline_batch_sizes=(), pipeline_updates=6)


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
    task = make_task(base.task, policy.tokenizer)  # a checkpoint's task needs its tokenizer
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
    if not batch_sizes:
        return {"generation": gen, "learner": [], "group_size": G}
    # learner: real groups from the engine, as many as the largest batch needs
    groups = actor.step(stream.take(max(batch_sizes) // G))
    ts = make_train_step(policy.graphdef, base.learner, completion_budget=base.engine.max_new_tokens,
                         temperature=base.engine.temperature)
    state = {"s": ts.init(policy.params)}  # each update donates the moments: keep the newest state
    L = packed_row_len(base.learner, config_seq_len(base, task.max_prompt_len))
    learn = []
    for b in batch_sizes:
        mb_size = min(base.learner.microbatch_size, b)
        mbs, stats = layout_microbatches(groups[: b // G], L, mb_size, base.learner.microbatch_tokens,
                                         policy.tokenizer.pad_id, base.learner.grpo,
                                         separate_flat=base.learner.skip_zero_advantage,
                                         share_prompts=base.learner.share_prompts)

        def step():
            state["s"], m = ts.update(state["s"], mbs, stats["num_tokens"])  # host floats: synced
            return m

        total, calls = _window(step, repeats, min_seconds)
        secs = total / len(calls)
        learn.append({"batch_size": b, "seconds": secs, "samples_per_second": b / secs,
                      "tokens_per_second": stats["num_tokens"] / secs, "calls": len(calls)})
        log(f"  learner    B={b:<5} {b / secs:8.1f} samples/s")
    return {"generation": gen, "learner": learn, "group_size": G}


def pipeline(base: Config, batch_sizes, updates: int, out: str, log=print) -> list[dict]:
    """X(B): for each B a real run of `updates` updates at that fixed batch size (the base config's
    actors, engine and max_staleness; a one-prompt held-out set, so evaluation costs nothing), its
    samples/s timed from the end of update 2 to the end of the last (update 1 compiles). updates >= 3."""
    from cadence.launch.run.train import train

    points = []
    for b in batch_sizes:
        run_dir = os.path.join(out, "runs", f"pipeline-b{b}")
        cfg = dataclasses.replace(base, learner=dataclasses.replace(
            base.learner, batch_size=b, microbatch_size=min(base.learner.microbatch_size, b)),
            task=dataclasses.replace(base.task, heldout_size=1),
            run=dataclasses.replace(base.run, dir=run_dir, steps=updates, eval_every=0, progress=False,
                                    stop_at_exact_match=0.0),
            controller=dataclasses.replace(base.controller, enabled=False))
        train(cfg, run_dir)
        steps = {m["step"]: m for m in read_metrics(run_dir) if "learner/train_seconds" in m}
        first, last = steps[2], steps[updates]
        secs = last["wall_time"] - first["wall_time"]
        samples = last["samples"] - first["samples"]  # cumulative counts
        points.append({"batch_size": b, "samples_per_second": samples / secs, "seconds_per_update": secs / (updates - 2),
                       "learner_seconds": float(np.median([steps[k]["learner/train_seconds"]
                                                            for k in range(2, updates + 1)])),
                       "updates_timed": updates - 2})
        log(f"  pipeline   B={b:<5} {samples / secs:8.2f} samples/s ({secs / (updates - 2):.1f} s an update)")
    return points


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
    panels = [plots.Panel("", "concurrency (prompts per engine call)", "generation samples/s", [
        plots.Line(cs, [p["samples_per_second"] for p in points["generation"]], "measured", "o"),
        plots.Line(grid_c, [g.predict(c) for c in grid_c], "fit c r1 / (1 + c / c_sat)", "-")], xlog2=True)]
    if points["learner"]:
        bs = np.array([p["batch_size"] for p in points["learner"]], float)
        grid_b = np.geomspace(bs.min(), bs.max() * 2, 50)
        panels.append(plots.Panel("", "batch size (samples)", "learner samples/s", [
            plots.Line(bs, [p["samples_per_second"] for p in points["learner"]], "measured", "o"),
            plots.Line(grid_b, [lt.predict(x) for x in grid_b], "fit B / (t_fix + B t_sample)", "-")], xlog2=True))
    if points.get("pipeline"):
        panels.append(plots.Panel("", "batch size (samples)", "pipeline samples/s X(B)", [
            plots.Line([p["batch_size"] for p in points["pipeline"]],
                       [p["samples_per_second"] for p in points["pipeline"]], "measured (real runs)", "o")],
            xlog2=True))
    plots.save_png(panels, path)


def run(base: Config, out: str, quick: bool, log=print, **opts) -> dict:
    p = {**(QUICK if quick else FULL), **{k: v for k, v in opts.items() if v is not None and k in QUICK}}
    if p["pipeline_batch_sizes"] and p["pipeline_updates"] < 3:
        raise ValueError(f"pipeline_updates: must be >= 3 (update 1 compiles, then update 2 to the last are "
                         f"timed), got {p['pipeline_updates']}")
    log(f"throughput ({'quick' if quick else 'full'}): concurrency {p['concurrencies']}, B {p['batch_sizes']}"
        + (f", pipeline B {p['pipeline_batch_sizes']}" if p["pipeline_batch_sizes"] else ""))
    points = measure(base, p["concurrencies"], p["batch_sizes"], p["repeats"], p["min_seconds"], log=log)
    if p["pipeline_batch_sizes"]:
        points["pipeline"] = pipeline(base, p["pipeline_batch_sizes"], p["pipeline_updates"], out, log=log)
    g, lt = fit(points)
    r1, c_sat = g.curve()
    t_fix, t_sample = lt.cost() or (None, None)
    results = {"experiment": "throughput", "quick": quick, "params": p, "points": points,
               "generation_fit": {"r1": r1, "c_sat": c_sat}, "learner_fit": {"t_fix": t_fix, "t_sample": t_sample},
               "device": str(jax.devices()[0])}
    common.write_json(os.path.join(out, "results.json"), results)
    plot(points, g, lt, os.path.join(out, "throughput.png"))
    G = points["group_size"]
    sections = [
        "# Throughput",
        f"Device {results['device']}. Generation: one engine call of c prompts x G={G} "
        "completions (Actor.step, scoring included). Learner: one GRPOTrainStep.update on real rollouts.",
        f"Generation fit: r1 = {r1:.4g} samples/s per unit concurrency, c_sat = {c_sat:.4g}."
        + (f" Learner fit: t_fix = {t_fix * 1e3:.3g} ms, t_sample = {t_sample * 1e3:.3g} ms." if t_fix is not None
           else ""),
        common.markdown_table(["concurrency", "samples/s", "tokens/s", "fit samples/s"],
                              [[q["concurrency"], q["samples_per_second"], q["tokens_per_second"],
                                g.predict(q["concurrency"])] for q in points["generation"]])]
    if points["learner"]:
        sections.append(common.markdown_table(
            ["batch size", "seconds/step", "samples/s", "fit samples/s"],
            [[q["batch_size"], q["seconds"], q["samples_per_second"], lt.predict(q["batch_size"])]
             for q in points["learner"]]))
    if points.get("pipeline"):
        # the two sides' fits at concurrency B / G: overlapped (min) where they have their own
        # devices, alternating (harmonic) where they share them, as generation and learner share
        # a CPU's cores
        rows = []
        for q in points["pipeline"]:
            xg = g.predict(q["batch_size"] / G)
            xt = lt.predict(q["batch_size"]) if points["learner"] else None
            rows.append([q["batch_size"], q["samples_per_second"], q["seconds_per_update"], q["learner_seconds"],
                         pipeline_throughput(xg, xt, True) if xt else None,
                         pipeline_throughput(xg, xt, False) if xt else None])
        sections += [f"Pipeline X(B): real runs of {p['pipeline_updates']} updates per batch size (the base "
                     f"config's actors and max_staleness {base.actors.max_staleness}), timed from update 2 to "
                     "the last.",
                     common.markdown_table(["batch size", "samples/s", "seconds/update", "learner s/update",
                                            "predicted, overlapped", "predicted, alternating"], rows)]
    sections.append("![throughput](throughput.png)")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n\n".join(sections) + "\n")
    log(f"throughput: report {out}/report.md")
    return results
