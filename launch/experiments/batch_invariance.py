"""batch-invariance: fixed batch sizes x scaling rule x seeds, held-out score against cumulative samples.

The invariance number is the spread of samples-to-target across batch sizes (max - min) relative to
their mean, each batch size's samples-to-target being the median over seeds. With the sqrt rule it
should be small (acceptance: <= 25%) and visibly smaller than with `none`. The per-seed spread
(each seed's spread across B, median over seeds) removes the part of the variation that a seed's
initial model and warm-up share across batch sizes.
"""
from __future__ import annotations

import os

from cadence.launch.observe import plots
from cadence.launch.config import Config
from cadence.launch.experiments import common

QUICK = dict(batch_sizes=(32, 64), scalings=("sqrt", "none", "linear"), seeds=(0,), max_samples=1024,
             eval_samples=128, target="auto", metric="eval/reward", overrides=("learner.sft.steps=10",
                                                                               "task.heldout_size=64"))
FULL = dict(batch_sizes=(64, 128, 256, 512), scalings=("sqrt", "none", "linear"), seeds=(0, 1, 2),
            max_samples=80_000, eval_samples=2048, target="0.5", metric="eval/exact_match",
            overrides=("task.heldout_size=2048",))


def run_grid(base: Config, out: str, batch_sizes, scalings, seeds, max_samples, eval_samples, metric,
             stop_at: float = 0.0, log=print) -> list[dict]:
    """Train every (B, scaling, seed) at fixed B; one record per run."""
    base_b = base.controller.base_batch_size or base.learner.batch_size
    records = []
    trained: dict[tuple, dict] = {}  # at B = base_b every rule gives the same run: train it once
    for scaling in scalings:
        for b in batch_sizes:
            for seed in seeds:
                run_dir = os.path.join(out, "runs", f"B{b}-{scaling}-s{seed}")
                cfg = common.fixed_batch_config(base, b, scaling, seed, base_batch_size=base_b,
                                                max_samples=max_samples, eval_samples=eval_samples,
                                                run_dir=run_dir, stop_at=stop_at,
                                                smallest_batch_size=min(batch_sizes))
                same = (b, seed, cfg.learner.optimizer)
                if same in trained:
                    log(f"  B={b:<4} {scaling:<6} seed {seed}: the same run as {trained[same]['run_dir']}")
                    records.append({**trained[same], "scaling": scaling})
                    continue
                summary = common.train_or_reuse(cfg, run_dir, common.observer(cfg), log=log)
                rec = common.run_record(cfg, run_dir, metric, batch_size=b, scaling=scaling, seed=seed,
                                        summary_wall=summary["wall_time"])
                trained[same] = rec
                log(f"  B={b:<4} {scaling:<6} seed {seed}: final {metric} {rec['curve'][-1][2]:.3f} "
                    f"at {rec['curve'][-1][0]} samples, {rec['samples_per_second'] or 0:.3g} samples/s")
                records.append(rec)
    return records


def summarize(records, batch_sizes, scalings) -> dict:
    """Per scaling: median samples-to-target per B and the relative spread across B."""
    out = {}
    for scaling in scalings:
        per_b, reached = {}, {}
        for b in batch_sizes:
            runs = [r for r in records if r["scaling"] == scaling and r["batch_size"] == b]
            value, ok = common.median_to_target(runs, "samples_to_target")
            per_b[b] = value if ok else None
            reached[str(b)] = common.seeds_reached(runs)
        all_reached = all(v is not None for v in per_b.values())
        paired, n_paired = paired_spread([r for r in records if r["scaling"] == scaling], batch_sizes)
        out[scaling] = {"samples_to_target": {str(b): v for b, v in per_b.items()},
                        "reached": reached,
                        "spread": common.relative_spread(per_b.values()) if all_reached else None,
                        "all_reached": all_reached,
                        "paired_spread": paired, "paired_seeds": n_paired}
    return out


def paired_spread(runs, batch_sizes) -> tuple[float | None, int]:
    """Median over seeds of each seed's own spread across B, and how many seeds it covers.

    A seed fixes the initial model and warm-up, which moves samples-to-target more than B does
    on small tasks; comparing B within a seed removes that shared part. Only seeds that reached
    the target at every B count.
    """
    by_seed: dict[int, dict[int, float]] = {}
    for r in runs:
        if r["batch_size"] in batch_sizes:
            by_seed.setdefault(r["seed"], {})[r["batch_size"]] = r["samples_to_target"]
    spreads = [common.relative_spread(v.values()) for v in by_seed.values()
               if len(v) == len(batch_sizes) and all(x is not None for x in v.values())]
    return common.median_or_none(spreads), len(spreads)


def _cell(summary: dict, b: int) -> str:
    """The median samples-to-target, with the seeds that reached it when not all did."""
    value, reached = summary["samples_to_target"][str(b)], summary["reached"][str(b)]
    n_ok, n = reached.split("/")
    if value is None:
        return f"not reached ({reached})"
    return f"{value:.4g}" + ("" if n_ok == n else f" ({reached})")


def _paired_cell(summary: dict, n_seeds: int) -> str:
    value, n = summary["paired_spread"], summary["paired_seeds"]
    if value is None:
        return f"no seed reached at every B (0/{n_seeds})"
    return f"{value:.4g}" + ("" if n == n_seeds else f" ({n}/{n_seeds} seeds)")


def plot(records, batch_sizes, scalings, target, metric, path):
    palette = plots.colors(len(batch_sizes))
    panels = []
    for j, scaling in enumerate(scalings):
        lines = []
        for color, b in zip(palette, batch_sizes):
            for i, r in enumerate(x for x in records if x["scaling"] == scaling and x["batch_size"] == b):
                s, _, v = zip(*r["curve"])
                lines.append(plots.Line(s, v, label=f"B={b}" if i == 0 else None, color=color, alpha=0.8))
        panels.append(plots.Panel(f"scaling = {scaling}", "cumulative samples",
                                  f"held-out {metric.split('/')[-1]}" if j == 0 else "", lines, hlines=[target],
                                  legend=j == len(scalings) - 1))
    plots.save_png(panels, path, sharey=True)


def run(base: Config, out: str, quick: bool, log=print, **opts) -> dict:
    """Run the experiment into `out`; returns the results (also results.json, report.md, PNG)."""
    p = {**(QUICK if quick else FULL), **{k: v for k, v in opts.items() if v is not None}}
    log(f"batch-invariance ({'quick' if quick else 'full'}): B {p['batch_sizes']} x {p['scalings']} x "
        f"seeds {p['seeds']}, {p['max_samples']} samples each")
    fixed_target = None if p["target"] == "auto" else float(p["target"])
    stop = fixed_target if (fixed_target is not None and p["metric"] == "eval/exact_match") else 0.0
    records = run_grid(base, out, p["batch_sizes"], p["scalings"], p["seeds"], p["max_samples"],
                       p["eval_samples"], p["metric"], stop_at=stop, log=log)
    target = fixed_target if fixed_target is not None else common.auto_target(records)
    common.add_time_to_target(records, target)
    summary = summarize(records, p["batch_sizes"], p["scalings"])
    results = {"experiment": "batch-invariance", "quick": quick, "params": {k: v for k, v in p.items()},
               "target": target, "summary": summary, "runs": records}
    common.write_json(os.path.join(out, "results.json"), results)
    plot(records, p["batch_sizes"], p["scalings"], target, p["metric"], os.path.join(out, "curves.png"))
    rows = [[s, *[_cell(summary[s], b) for b in p["batch_sizes"]], summary[s]["spread"],
             _paired_cell(summary[s], len(p["seeds"]))] for s in p["scalings"]]
    sqrt, none = summary.get("sqrt", {}).get("spread"), summary.get("none", {}).get("spread")
    verdict = ""
    if sqrt is not None:
        verdict = (f"sqrt spread {sqrt:.1%} ({'<=' if sqrt <= 0.25 else '>'} 25%)"
                   + (f"; none {none:.1%}" if none is not None else ""))
    report = "\n\n".join([
        "# Batch invariance",
        f"{'Quick' if quick else 'Full'} size. Batch sizes {list(p['batch_sizes'])}, scaling rules "
        f"{list(p['scalings'])}, seeds {list(p['seeds'])}, up to {p['max_samples']} samples per run; "
        f"held-out `{p['metric']}` every {p['eval_samples']} samples; target {target:.4g}"
        f"{' (auto: halfway from the start to the median best of all runs)' if fixed_target is None else ''}.",
        "Samples to target (median over seeds; a seed that never reached it counts as slowest, and the "
        "seeds that reached it are shown when not all did) and spread = (max - min) / mean across batch sizes:",
        common.markdown_table(["scaling", *[f"B={b}" for b in p["batch_sizes"]], "spread",
                               "per-seed spread"], rows),
        "Per-seed spread: each seed's own (max - min) / mean across batch sizes, median over the seeds "
        "that reached the target at every B (the seed's initial model and warm-up are shared, so "
        "this removes their part of the variation).",
        verdict,
        "![curves](curves.png)",
    ])
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report + "\n")
    log(f"batch-invariance: {verdict or 'no spread (target not reached by all)'}; report {out}/report.md")
    return results
