"""`cadence report RUN_DIR [RUN_DIR ...] [--out FILE.html]`: one self-contained HTML file comparing runs.

    path = write_report(["runs/a", "runs/b"], "compare.html")

Plots (launch/observe/plots.py, PNG inlined as data: URIs; nothing is fetched when the file opens):
reward and held-out exact match against samples and against wall time, held-out reward,
staleness, ESS and the sampler/learner mismatch KL, generation and training tokens/s, batch size,
learning rate and the noise-scale estimate over time with the controller's decisions marked, loss
and gradient norm, and the task's own metrics (every eval/<name> and task/<name> a run reports: a
plug-in task's own numbers). Each run is one colour in every plot. Above them: a table of the
runs (state, steps, samples, final held-out exact match and reward, target, wall time) and the
config keys on which the runs differ; below: the controller's decisions. Per-update curves noisier
than a few hundred points are shown as a moving average (the caption says how wide).
"""
from __future__ import annotations

import datetime
import html
import json
import os

import numpy as np

from cadence.launch.observe import plots
from cadence.launch.metrics import read_metrics
from cadence.launch.config_loader import flatten
from cadence.launch.observe.status import NotARun, run_status

MAX_POINTS = 2000  # points per line after smoothing (a days-long run has 10^5 updates)
SAMPLES, TIME = ("samples", "samples"), ("wall_time", "wall seconds since the run started")

# (section, metrics key, title, x axis, y label, smoothed, marked with controller decisions)
PANELS = [
    ("Learning", "reward/mean", "training reward", SAMPLES, "mean reward per batch", True, False),
    ("Learning", "reward/mean", "training reward over time", TIME, "mean reward per batch", True, False),
    ("Learning", "eval/exact_match", "held-out exact match", SAMPLES, "greedy exact match", False, False),
    ("Learning", "eval/exact_match", "held-out exact match over time", TIME, "greedy exact match", False, False),
    ("Learning", "eval/reward", "held-out reward", SAMPLES, "greedy mean reward", False, False),
    ("Off-policy", "staleness/mean", "staleness", SAMPLES, "mean policy-version lag", True, False),
    ("Off-policy", "ess", "effective sample size", SAMPLES, "ESS / batch", True, False),
    ("Off-policy", "mismatch_kl", "sampler / learner mismatch KL", SAMPLES, "KL per token", True, False),
    ("Throughput", "actors/tokens_per_second", "generation throughput", TIME, "tokens / s", True, False),
    ("Throughput", "learner/tokens_per_second", "training throughput", TIME, "tokens / s", True, False),
    ("Batch size and learning rate", "batch_size", "batch size", TIME, "samples per update", False, True),
    ("Batch size and learning rate", "learning_rate", "learning rate", TIME, "Adam lr", False, True),
    ("Batch size and learning rate", "controller/noise_scale", "noise-scale estimate", TIME,
     "B_noise (samples)", False, True),
    ("Optimisation", "loss", "loss", SAMPLES, "loss", True, False),
    ("Optimisation", "grad_norm", "gradient norm", SAMPLES, "global grad norm", True, False),
]


def load_run(run_dir: str) -> dict:
    """A run's records, summary, status and config, for the report."""
    status = run_status(run_dir)  # raises NotARun without config.yaml
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise NotARun(f"{run_dir} has no metrics.jsonl")
    summary = None
    if os.path.isfile(os.path.join(run_dir, "summary.json")):
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as f:
        config = yaml.safe_load(f)
    return {"dir": os.path.abspath(run_dir), "rows": read_metrics(run_dir), "summary": summary,
            "status": status, "config": config}


def _labels(dirs: list[str]) -> list[str]:
    """Shortest distinct names: the folder name, with its parent when two runs share it."""
    names = [os.path.basename(d) for d in dirs]
    if len(set(names)) == len(names):
        return names
    return [os.path.join(os.path.basename(os.path.dirname(d)), os.path.basename(d)) for d in dirs]


def moving_average(y: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over up to w points (the first points average what exists so far)."""
    if w <= 1:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(0, idx - w)
    return (c[idx] - c[lo]) / (idx - lo)


def series(rows: list[dict], key: str, xkey: str, smooth: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """(x, y, window) of `key` against `xkey` over the records that hold both (updates only when
    smoothing), averaged over `window` updates and thinned to MAX_POINTS."""
    pts = [(r[xkey], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r.get(xkey) is not None
           and (not smooth or r.get("step", 0) > 0)]
    if not pts:
        return np.zeros(0), np.zeros(0), 1
    x, y = (np.asarray(v, float) for v in zip(*pts))
    w = max(1, len(y) // 200) if smooth else 1
    y = moving_average(y, w)
    stride = max(1, -(-len(x) // MAX_POINTS))
    keep = np.r_[np.arange(0, len(x), stride), len(x) - 1] if stride > 1 else np.arange(len(x))
    return x[np.unique(keep)], y[np.unique(keep)], w


def decisions(rows: list[dict]) -> list[dict]:
    """Controller decisions that changed something (not holds): step, samples, time, reason."""
    out = []
    for r in rows:
        reason = r.get("controller/decision")
        action = r.get("controller/action")
        if isinstance(reason, str) and (action not in (None, "hold") or reason.startswith("initial scaling")):
            out.append({"step": r["step"], "samples": r.get("samples"), "wall_time": r.get("wall_time"),
                        "action": action or "initial scaling", "reason": reason})
    return out


def _short(d: dict) -> str:
    import re

    m = re.search(r"B (\d+) -> (\d+)", d["reason"])
    return f"B {m.group(1)}→{m.group(2)}" if m else d["action"]


TASK_SECTION = "The task's own metrics"
_FIXED = {p[1] for p in PANELS} | {"eval/reward_errors", "eval/seconds", "eval/generate_seconds", "eval/reissued_chunks"}


def task_panels(runs: list[dict]) -> list[tuple]:
    """PANELS rows for the task's own metrics (a plug-in task's eval/<name> and task/<name>),
    for every such key in any run."""
    keys = sorted({k for run in runs for r in run["rows"] for k, v in r.items()
                   if k.startswith(("eval/", "task/")) and k not in _FIXED and isinstance(v, (int, float))})
    return [(TASK_SECTION, k, f"held-out {k[5:]}" if k.startswith("eval/") else f"training {k[5:]}", SAMPLES,
             k, k.startswith("task/"), False) for k in keys]


def build_panels(runs: list[dict]) -> list[tuple[str, plots.Panel, str]]:
    """(section, panel, caption) for every plot that has data in at least one run."""
    labels = _labels([r["dir"] for r in runs])
    out = []
    for section, key, title, (xkey, xlabel), ylabel, smooth, marked in PANELS + task_panels(runs):
        lines, marks, windows = [], [], set()
        for i, (run, label) in enumerate(zip(runs, labels)):
            x, y, w = series(run["rows"], key, xkey, smooth)
            if len(x):
                lines.append(plots.Line(x, y, label=label, color=f"C{i % 10}", lw=1.2,
                                        fmt="o-" if key.startswith("eval/") else "-", ms=3))
                windows.add(w)
            if marked:
                marks += [plots.Mark(d[xkey], _short(d), f"C{i % 10}")
                          for d in decisions(run["rows"])[:40] if d.get(xkey) is not None]
        if not lines:
            continue
        caption = f"{title} ({key}) against {xlabel}"
        if max(windows) > 1:
            caption += f"; moving average of {max(windows)} updates"
        if marks:
            caption += "; dotted lines: the controller's decisions"
        out.append((section, plots.Panel(title, xlabel, ylabel, lines, marks=marks,
                                         legend=len(runs) > 1, legend_fontsize=7), caption))
    return out


def _config_differences(runs: list[dict]) -> list[tuple[str, list]]:
    flat = [flatten(r["config"]) for r in runs]
    keys = sorted(set().union(*flat))
    return [(k, [f.get(k) for f in flat]) for k in keys
            if k != "run.dir" and len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]


def _fmt(v, spec="{:.3f}") -> str:
    if v is None:
        return "-"
    return spec.format(v) if isinstance(v, float) else str(v)


CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.grid { display: grid; grid-template-columns: repeat(2, 560px); gap: 16px; }
figure { margin: 0; } figcaption { font-size: 12px; color: #555; }
img.plot { width: 560px; height: 400px; display: block; border: 1px solid #eee; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; }
"""
TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
         "#bcbd22", "#17becf"]  # matplotlib's C0..C9, for the run table's swatches


def render_html(runs: list[dict]) -> str:
    labels = _labels([r["dir"] for r in runs])
    e = html.escape
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>Cadence report: {e(', '.join(labels))}</title>", f"<style>{CSS}</style></head><body>",
             "<h1>Cadence report</h1>",
             f"<p>{len(runs)} run(s), made {e(datetime.datetime.now().strftime('%Y-%m-%d %H:%M'))} "
             "from each run's metrics.jsonl, summary.json and heartbeat.</p>",
             "<table><tr><th>run</th><th>state</th><th>task</th><th>steps</th><th>samples</th>"
             "<th>final held-out exact match</th><th>final held-out reward</th>"
             "<th>target reached at</th><th>wall time (s)</th><th>folder</th></tr>"]
    for i, (run, label) in enumerate(zip(runs, labels)):
        rows, st = run["rows"], run["status"]
        evals = [r["eval/exact_match"] for r in rows if r.get("eval/exact_match") is not None]
        heldout = [r["eval/reward"] for r in rows if r.get("eval/reward") is not None]
        hit = (run["summary"] or {}).get("target_reached_at")
        hit_text = f"step {hit['step']}, {hit['samples']} samples, {hit['wall_time']:.1f} s" if hit else "-"
        parts.append(
            f'<tr><td><span class="swatch" style="background:{TAB10[i % 10]}"></span>{e(label)}</td>'
            f"<td>{e(st['state'])}</td><td>{e(str(run['config'].get('task', {}).get('name', '-')))}</td>"
            f"<td>{_fmt(st['step'])}</td><td>{_fmt(st['samples'])}</td><td>{_fmt(evals[-1] if evals else None)}</td>"
            f"<td>{_fmt(heldout[-1] if heldout else None)}</td>"
            f"<td>{e(hit_text)}</td><td>{_fmt(st['wall_time'], '{:.1f}')}</td><td>{e(run['dir'])}</td></tr>")
    parts.append("</table>")
    diffs = _config_differences(runs) if len(runs) > 1 else []
    if diffs:
        parts.append("<h2>Config differences</h2><table><tr><th>key</th>" +
                     "".join(f"<th>{e(label)}</th>" for label in labels) + "</tr>")
        for key, vals in diffs:
            parts.append(f"<tr><td>{e(key)}</td>" + "".join(f"<td>{e(json.dumps(v))}</td>" for v in vals) + "</tr>")
        parts.append("</table>")
    section = None
    for sec, panel, caption in build_panels(runs):
        if sec != section:
            parts.append(("</div>" if section else "") + f"<h2>{e(sec)}</h2><div class=\"grid\">")
            section = sec
        png = plots.png_bytes([panel], dpi=100, panel_size=(5.6, 4.0))
        parts.append(f'<figure><img class="plot" alt="{e(panel.title)}" src="{plots.data_uri(png)}">'
                     f"<figcaption>{e(caption)}</figcaption></figure>")
    if section:
        parts.append("</div>")
    decided = [(label, d) for run, label in zip(runs, labels) for d in decisions(run["rows"])]
    parts.append("<h2>Controller decisions</h2>")
    if decided:
        parts.append("<table><tr><th>run</th><th>step</th><th>samples</th><th>wall s</th><th>decision</th></tr>")
        parts += [f"<tr><td>{e(label)}</td><td>{d['step']}</td><td>{_fmt(d['samples'])}</td>"
                  f"<td>{_fmt(d['wall_time'], '{:.1f}')}</td><td>{e(d['reason'])}</td></tr>" for label, d in decided]
        parts.append("</table>")
    else:
        parts.append("<p>none (controller off, or it held the batch size throughout).</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dirs: list[str], out: str | None = None) -> str:
    """Write the report; returns its path (default: RUN_DIR/report.html for one run, else ./report.html)."""
    runs = [load_run(d) for d in run_dirs]
    out = out or (os.path.join(run_dirs[0], "report.html") if len(run_dirs) == 1 else "report.html")
    text = render_html(runs)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out)
    return os.path.abspath(out)
