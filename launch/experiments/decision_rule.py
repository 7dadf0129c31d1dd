"""decision-rule: for each fixed B, predicted vs measured time-to-target; then the controller on.

Predicted T(B) = (1 + B / B_noise) / X(B) (up to a constant), with B_noise the median of the
noise-scale estimates logged in the fixed runs and X(B) each run's measured samples/s; both the
predicted and the measured times are shown relative to the best fixed B. The controller run starts
at the middle batch size (or the smallest: `controller_start`) with the same sqrt rule; acceptance:
within 1.15x of the best fixed B and at least 1.3x better than the worst.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil

from cadence.launch.observe import plots
from cadence.launch.config import Config
from cadence.launch.experiments import common
from cadence.launch.experiments.batch_invariance import run_grid
from cadence.learner.controller import make_controller
from cadence.learner.controller.decision import time_to_target_score
from cadence.learner.controller.scaling import lr_shortfall, max_k

QUICK = dict(batch_sizes=(16, 32, 64), seeds=(0,), max_samples=1024, eval_samples=128, target="auto",
             metric="eval/reward", window=2, dwell=4, controller_start="middle")
FULL = dict(batch_sizes=(64, 128, 256, 512), seeds=(0, 1, 2), max_samples=80_000, eval_samples=2048,
            target="0.5", metric="eval/exact_match", window=10, dwell=20, controller_start="middle")


def controller_runs(base: Config, out: str, p: dict, stop_at: float = 0.0, log=print) -> list[dict]:
    bs = sorted(p["batch_sizes"])
    start = controller_start(p)
    base_b = base.controller.base_batch_size or base.learner.batch_size
    records = []
    for seed in p["seeds"]:
        run_dir = os.path.join(out, "runs", f"controller-s{seed}")
        cfg = common.fixed_batch_config(base, start, "sqrt", seed, base_batch_size=base_b,
                                        max_samples=p["max_samples"], eval_samples=p["eval_samples"],
                                        run_dir=run_dir, stop_at=stop_at, smallest_batch_size=bs[0])
        # the same sample budget and evaluation schedule (in samples) as the fixed runs, whatever B
        # the controller picks: step-based ones would evaluate a small B more often (costing it wall
        # time) and end its budget early
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(
            cfg.run, steps=p["max_samples"] // bs[0], max_samples=p["max_samples"],
            eval_every_samples=p["eval_samples"]),
            controller=dataclasses.replace(cfg.controller, enabled=True, window=p["window"], dwell=p["dwell"],
                                           min_batch_size=bs[0], max_batch_size=bs[-1], scaling="sqrt",
                                           base_batch_size=0))
        ctrl = run_controller(base, cfg, base_b)
        decisions_path = os.path.join(run_dir, "controller_decisions.json")
        if os.path.exists(run_dir) and not os.path.isfile(decisions_path):
            shutil.rmtree(run_dir)  # unfinished (its decisions were never written): redone whole
        # a finished run of the same config is reused, as the fixed runs are: an experiment can
        # then grow by seeds over several sessions
        common.train_or_reuse(cfg, run_dir, ctrl, log=log)
        if not os.path.isfile(decisions_path):  # trained just now
            common.write_json(decisions_path, ctrl.decisions)
        with open(decisions_path) as f:
            decisions = json.load(f)
        rec = common.run_record(cfg, run_dir, p["metric"], batch_size="controller", scaling="sqrt", seed=seed)
        rec["controller_decisions"] = decisions
        log(f"  controller seed {seed}: B path {_path(rec['batch_sizes'])}")
        records.append(rec)
    return records


def run_controller(base: Config, cfg: Config, base_b: int):
    """The controller of a controller run (cfg: its config at the start B, from fixed_batch_config).
    Its reference point is its start and the values it trains with there; a start past the
    scaling rule's ceiling has values off the rule's curve (capped), so that controller rescales
    from the experiment's own reference point instead (base_b and the base config's values)."""
    ceiling = base.controller.max_scaled_batch_size
    if ceiling and cfg.learner.batch_size > ceiling:
        return make_controller(dataclasses.replace(cfg.controller, base_batch_size=base_b),
                               dataclasses.replace(cfg.learner, optimizer=base.learner.optimizer), cfg.actors)
    return make_controller(cfg.controller, cfg.learner, cfg.actors)


def controller_start(p: dict) -> int:
    """The batch size the controller run starts at: the middle of the fixed ones, or the smallest."""
    bs = sorted(p["batch_sizes"])
    if p["controller_start"] not in ("smallest", "middle"):
        raise ValueError(f"controller_start: 'smallest' or 'middle', got {p['controller_start']!r}")
    return bs[0] if p["controller_start"] == "smallest" else bs[len(bs) // 2]


def _path(sizes) -> str:
    path = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:]) if a != b]
    return " -> ".join(str(b) for b in path)


def run(base: Config, out: str, quick: bool, log=print, **opts) -> dict:
    p = {**(QUICK if quick else FULL), **{k: v for k, v in opts.items() if v is not None and k in QUICK}}
    log(f"decision-rule ({'quick' if quick else 'full'}): fixed B {p['batch_sizes']} (sqrt) x seeds {p['seeds']}, "
        "then the controller")
    fixed_target = None if p["target"] == "auto" else float(p["target"])
    # With a fixed exact-match target every run stops there (as batch-invariance's do, so its
    # sqrt runs are these fixed runs and a shared folder reuses them).
    stop = fixed_target if (fixed_target is not None and p["metric"] == "eval/exact_match") else 0.0
    fixed = run_grid(base, out, p["batch_sizes"], ("sqrt",), p["seeds"], p["max_samples"], p["eval_samples"],
                     p["metric"], stop_at=stop, log=log)
    ctrl = controller_runs(base, out, p, stop_at=stop, log=log)
    target = fixed_target if fixed_target is not None else common.auto_target(fixed + ctrl)
    common.add_time_to_target(fixed + ctrl, target)
    bn = common.median_or_none(r["noise_scale"] for r in fixed)
    base_b = base.controller.base_batch_size or base.learner.batch_size
    ceiling = max_k(base.controller.max_scaled_batch_size, base_b)
    rows, table = {}, []
    for b in p["batch_sizes"]:
        runs = [r for r in fixed if r["batch_size"] == b]
        x = common.median_or_none(r["samples_per_second"] for r in runs)
        # a B whose median seed never reached the target: its wall is a lower bound ("reached" False)
        wall, reached = common.median_to_target(runs, "wall_to_target")
        samples, _ = common.median_to_target(runs, "samples_to_target")
        rows[b] = {"measured_wall": wall, "samples_to_target": samples, "reached": reached,
                   "seeds_reached": common.seeds_reached(runs),
                   "samples_per_second": x,
                   "predicted": time_to_target_score(b, bn, x, lr_shortfall(b / base_b, "sqrt", ceiling))
                   if (bn and x) else None}
    measured = {b: r["measured_wall"] for b, r in rows.items() if r["reached"]}
    predicted = {b: r["predicted"] for b, r in rows.items() if r["predicted"] is not None}
    best_b = min(measured, key=measured.get) if measured else None
    # the worst includes a B that did not reach the target: its time is then at least its wall
    walls = {b: r["measured_wall"] for b, r in rows.items() if r["measured_wall"] is not None}
    worst_b = max(walls, key=walls.get) if walls else None
    ctrl_wall, ctrl_reached = common.median_to_target(ctrl, "wall_to_target") if ctrl else (None, False)
    for b, r in rows.items():
        rel_m = r["measured_wall"] / measured[best_b] if (best_b and r["measured_wall"]) else None
        rel_p = (r["predicted"] / predicted[best_b]) if (best_b in predicted and r["predicted"]) else None
        r.update(measured_relative=rel_m, predicted_relative=rel_p)
        bound = "" if r["reached"] else ">= "
        table.append([b, f"{bound}{r['samples_to_target']:.4g} ({r['seeds_reached']})", r["samples_per_second"],
                      f"{bound}{r['measured_wall']:.4g}", None if rel_m is None else f"{bound}{rel_m:.4g}", rel_p])
    # a controller that did not reach the target: its wall is a lower bound, so its ratio to the
    # best is one too, and the worst's ratio to it an upper bound (unknown if the worst missed too)
    vs_best = ctrl_wall / measured[best_b] if (ctrl_wall and best_b) else None
    worst_is_bound = worst_b is not None and not rows[worst_b]["reached"]
    vs_worst = (walls[worst_b] / ctrl_wall if (ctrl_wall and worst_b and (ctrl_reached or not worst_is_bound))
                else None)
    predicted_best = min(predicted, key=predicted.get) if predicted else None
    results = {"experiment": "decision-rule", "quick": quick, "params": p, "target": target, "noise_scale": bn,
               "fixed": {str(b): r for b, r in rows.items()}, "best_fixed": best_b, "worst_fixed": worst_b,
               "predicted_best": predicted_best, "controller_wall_to_target": ctrl_wall,
               "controller_vs_best": vs_best, "worst_vs_controller": vs_worst,
               "worst_vs_controller_is_lower_bound": worst_is_bound and ctrl_reached,
               "controller_reached": ctrl_reached, "runs": fixed + ctrl}
    common.write_json(os.path.join(out, "results.json"), results)
    _plot(rows, ctrl, fixed, os.path.join(out, "decision_rule.png"), noise_scale=bn)
    report = "\n\n".join([
        "# Decision rule",
        f"{'Quick' if quick else 'Full'} size; target {target:.4g} on held-out `{p['metric']}`; "
        f"B_noise (median of the fixed runs' estimates) = {bn if bn is None else f'{bn:.4g}'}"
        + (f"; the scaling rule stops at B = {base.controller.max_scaled_batch_size} (`controller."
           f"max_scaled_batch_size`): a larger B trains on its Adam values and is predicted with E(B) "
           f"times the lr withheld." if ceiling else "."),
        common.markdown_table(["B", "samples to target", "samples/s", "wall to target (s)", "measured / best",
                               "predicted / best"], table),
        f"Best fixed B (measured) {best_b}, predicted best {predicted_best}, worst {worst_b}.",
        f"Controller (start B={controller_start(p)}): wall to target "
        f"{ctrl_wall if ctrl_wall is None else ('' if ctrl_reached else '>= ') + f'{ctrl_wall:.1f} s'}; vs best fixed "
        f"{vs_best if vs_best is None else ('' if ctrl_reached else '>= ') + f'{vs_best:.2f}x'} (acceptance <= 1.15x); "
        f"worst fixed / controller "
        f"{vs_worst if vs_worst is None else ('<= ' if not ctrl_reached else '>= ' if worst_is_bound else '') + f'{vs_worst:.2f}x'} "
        f"(acceptance >= 1.3x{'; the worst B did not reach the target, so its wall is a lower bound' if worst_is_bound else ''}). "
        f"B paths: {'; '.join(_path(r['batch_sizes']) for r in ctrl)}.",
        "![decision rule](decision_rule.png)",
    ])
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report + "\n")
    log(f"decision-rule: report {out}/report.md")
    return results


def _plot(rows, ctrl, fixed, path, noise_scale=None):
    """Panels: X(B) and E(B) (samples to target) by B, time to target (measured and predicted)
    relative to the best B, the held-out curves, and the controller's B path (with a controller run)."""
    bx = [x for x in rows if rows[x]["samples_per_second"] is not None]
    x_panel = plots.Panel("throughput X(B)", "batch size", "samples/s (fixed-B runs, evaluations included)",
                          [plots.Line(bx, [rows[x]["samples_per_second"] for x in bx], "measured", "o-")],
                          xlog2=True)
    be = [x for x in rows if rows[x]["samples_to_target"] is not None]
    e = _measured(rows, be, "samples_to_target")
    reached = [x for x in be if rows[x]["reached"]]
    if noise_scale and reached:  # 1 + B / B_noise through the best reached point
        b0 = min(reached, key=lambda x: rows[x]["samples_to_target"])
        c = rows[b0]["samples_to_target"] / (1 + b0 / noise_scale)
        e.append(plots.Line(be, [c * (1 + x / noise_scale) for x in be],
                            f"1 + B/B_noise (B_noise {noise_scale:.3g}), through B={b0}", "s--"))
    e_panel = plots.Panel("samples to target E(B)", "batch size", "samples", e, xlog2=True)
    a = _measured(rows, [x for x in rows if rows[x]["measured_relative"] is not None], "measured_relative")
    bp = [x for x in rows if rows[x]["predicted_relative"] is not None]
    a.append(plots.Line(bp, [rows[x]["predicted_relative"] for x in bp], "predicted (1 + B/B_noise) / X(B)", "s--"))
    b = []
    for r in fixed:
        s, w, v = zip(*r["curve"])
        b.append(plots.Line(w, v, f"B={r['batch_size']} s{r['seed']}", alpha=0.6))
    path_lines = []
    for r in ctrl:
        s, w, v = zip(*r["curve"])
        b.append(plots.Line(w, v, f"controller s{r['seed']}", "k-", lw=2))
        path_lines.append(plots.Line(list(itertools.accumulate(r["batch_sizes"])), r["batch_sizes"],
                                     f"controller s{r['seed']}", "-", lw=2))
    panels = [x_panel, e_panel,
              plots.Panel("", "batch size", "time to target / best fixed B", a, xlog2=True),
              plots.Panel("", "wall seconds (RL)", "held-out score", b, legend_fontsize=7)]
    if path_lines:
        panels.append(plots.Panel("the controller's path (dashed: the fixed B)", "samples", "batch size",
                                  path_lines, hlines=sorted(rows)))
    plots.save_png(panels, path, ncols=3)


def _measured(rows, bs, key):
    """The measured `key` by B (median seed), with the B whose median seed did not reach the
    target marked as lower bounds."""
    lines = [plots.Line(bs, [rows[x][key] for x in bs], "measured (median seed)", "o-")]
    low = [x for x in bs if not rows[x]["reached"]]
    if low:
        lines.append(plots.Line(low, [rows[x][key] for x in low], "lower bound (median seed did not reach)",
                                "^", ms=10, mfc="none"))
    return lines
