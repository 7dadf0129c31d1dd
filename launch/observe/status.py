"""`cadence status RUN_DIR [--watch]`: is the run healthy? One screen from the run's own files.

    st = run_status("runs/sort-...")     # dict: state, step, samples, reward and its trend, ...
    console.print(render(st))            # the screen; EXIT_CODES[st["state"]] is the exit status

States, from RUN_DIR/heartbeat.json (launch/observe/heartbeat.py), the process table and summary.json:
    running    the heartbeat is fresh and its process exists
    stalled    the heartbeat is fresh and its process exists, but no update has landed for
               run.stall_factor times the slowest of its recent updates (an evaluation or a
               checkpoint included): the process lives, training is stuck (a hung actor,
               reward or learner step). Judged once the process has written two records, and
               not after its last update (the final evaluation and export add no record).
    finished   the run ended normally (its final state, or summary.json without "preempted")
    preempted  SIGTERM/SIGINT ended it with a final checkpoint; `cadence train --resume` continues
    dead       the process is gone without a final word (kill -9, crash, lost machine), or its
               heartbeat went stale (hung, or another host stopped writing)
Everything else comes from the tail of metrics.jsonl, config.yaml and checkpoints/.
"""
from __future__ import annotations

import json
import os
import socket
import time

import numpy as np
import yaml

from cadence.launch.observe import heartbeat

EXIT_CODES = {"running": 0, "finished": 4, "preempted": 5, "dead": 6, "stalled": 7}
STALL_FACTOR = 10.0  # run.stall_factor's default (launch/config.py), for runs whose config lacks it
EXIT_NOT_A_RUN = 1
WINDOW = 20  # updates the trend and throughput are measured over


class NotARun(ValueError):
    """The directory holds no Cadence run (no config.yaml)."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def tail_records(path: str, min_evals: int = 2, max_bytes: int = 64 << 20) -> list[dict]:
    """The last records of metrics.jsonl: at least WINDOW * 2 updates and `min_evals` evaluations
    when the file has them, reading backwards from the end (a days-long run's file is large)."""
    if not os.path.isfile(path):
        return []
    size = os.path.getsize(path)
    n = 1 << 16
    while True:
        with open(path, "rb") as f:
            f.seek(max(0, size - n))
            chunk = f.read()
        lines = chunk.split(b"\n")
        if size > n:
            lines = lines[1:]  # the first one is cut
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # blank, or a line being written
        evals = sum(_is_eval(r) for r in rows)
        if n >= size or n >= max_bytes or (len(rows) >= 2 * WINDOW and evals >= min_evals):
            return rows
        n *= 4


def _is_eval(r: dict) -> bool:
    """A record that carries a held-out evaluation (every one has eval/reward; older runs only
    eval/exact_match)."""
    return r.get("eval/reward") is not None or r.get("eval/exact_match") is not None


def _load(path: str):
    try:
        with open(path) as f:
            return yaml.safe_load(f) if path.endswith(".yaml") else json.load(f)
    except (OSError, ValueError):
        return None


def _latest_checkpoint(run_dir: str) -> tuple[int | None, float | None]:
    d = os.path.join(run_dir, "checkpoints")
    steps = sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []
    if not steps:
        return None, None
    return steps[-1], os.path.getmtime(os.path.join(d, str(steps[-1])))


def _state(hb: dict | None, summary: dict | None, now: float) -> tuple[str, str]:
    """(state, why) from the heartbeat, the process table and the summary."""
    if hb is None:
        if summary is not None:
            return ("preempted" if summary.get("preempted") else "finished"), "summary.json (no heartbeat)"
        return "dead", "no heartbeat.json and no summary.json: the run never started or predates heartbeats"
    if hb["state"] in ("finished", "preempted"):
        return hb["state"], "its final heartbeat"
    if hb["state"] == "failed":
        return "dead", "the run stopped on an error (see its log)"
    age = now - hb["time"]
    stale_after = max(3 * hb.get("interval", 5.0), hb.get("interval", 5.0) + 10)
    here = hb.get("host") == socket.gethostname()
    if here and not pid_alive(hb["pid"]):
        return "dead", f"process {hb['pid']} is gone (killed or crashed) without a final checkpoint"
    if age > stale_after:
        where = f"process {hb['pid']} on {hb.get('host')}"
        return "dead", f"no heartbeat for {_duration(age)} from {where}"
    return "running", f"process {hb['pid']} on {hb.get('host')}, heartbeat {age:.0f} s ago"


def _stall(hb: dict, rows: list[dict], factor: float, now: float) -> str | None:
    """Why a live run counts as stalled, or None: its newest record is older than `factor` times
    the slowest gap between the recent records this process wrote (plus two heartbeat intervals:
    the file may lag the newest record by one)."""
    last_at, written = hb.get("last_record_at"), int(hb.get("records") or 0)
    if last_at is None or written < 2:
        return None  # still starting (compiling, the warm-up): no update time to compare with
    ours = rows[-min(written, WINDOW + 1):]  # the tail of the file is this process's records
    times = [r["wall_time"] for r in ours if isinstance(r.get("wall_time"), (int, float))]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    if not gaps:
        return None
    quiet, slowest = now - last_at, max(gaps)
    limit = factor * slowest + 2 * hb.get("interval", 5.0)
    if quiet <= limit:
        return None
    return (f"process {hb['pid']} on {hb.get('host')} is alive, but no update for {_duration(quiet)} "
            f"(the slowest of the last {len(gaps)} took {slowest:.1f} s; run.stall_factor={factor:g})")


def _finishing(last: dict, run_cfg: dict) -> bool:
    """Whether the newest record was the run's last update (steps, samples or the exact-match
    target reached): the process is in its final evaluation and export, which add no record."""
    def reached(value, limit) -> bool:
        return isinstance(value, (int, float)) and isinstance(limit, (int, float)) and 0 < limit <= value

    return (reached(last.get("step"), run_cfg.get("steps")) or reached(last.get("samples"), run_cfg.get("max_samples"))
            or reached(last.get("eval/exact_match"), run_cfg.get("stop_at_exact_match")))


def run_status(run_dir: str, now: float | None = None) -> dict:
    """Everything `cadence status` shows, as a dict (also `cadence status --json`)."""
    now = time.time() if now is None else now
    cfg = _load(os.path.join(run_dir, "config.yaml"))
    if not isinstance(cfg, dict):
        raise NotARun(f"{run_dir} is not a Cadence run directory (no config.yaml)")
    hb = heartbeat.read(run_dir)
    summary = _load(os.path.join(run_dir, "summary.json"))
    state, why = _state(hb, summary, now)
    rows = tail_records(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in rows if r.get("step", 0) > 0 and "reward/mean" in r]
    last = rows[-1] if rows else {}
    run_cfg = cfg.get("run") or {}
    if state == "running" and not _finishing(last, run_cfg):
        factor = run_cfg.get("stall_factor", STALL_FACTOR)
        stalled = _stall(hb, rows, float(factor) if isinstance(factor, (int, float)) else STALL_FACTOR, now)
        if stalled:
            state, why = "stalled", stalled
    st = {"run_dir": os.path.abspath(run_dir), "state": state, "why": why,
          "pid": hb and hb.get("pid"), "host": hb and hb.get("host"),
          "heartbeat_age": now - hb["time"] if hb else None,
          "step": last.get("step"), "steps_total": run_cfg.get("steps"), "samples": last.get("samples"),
          "wall_time": last.get("wall_time"), "sinks_failed": (hb or {}).get("sinks_failed") or {}}
    recent, before = steps[-WINDOW:], steps[-2 * WINDOW:-WINDOW]
    st["reward"] = float(np.mean([r["reward/mean"] for r in recent])) if recent else None
    st["reward_trend"] = (st["reward"] - float(np.mean([r["reward/mean"] for r in before]))) if before else None
    evals = [r for r in rows if r.get("eval/exact_match") is not None]
    st["exact_match"] = evals[-1]["eval/exact_match"] if evals else None
    st["exact_match_step"] = evals[-1]["step"] if evals else None
    st["exact_match_trend"] = (evals[-1]["eval/exact_match"] - evals[-2]["eval/exact_match"]) if len(evals) > 1 else None
    # The task's own numbers (a plug-in task may have no exact match): held-out reward and every
    # eval/<name> of the newest evaluation, and task/<name> (training) averaged over recent updates.
    heldout = [r for r in rows if _is_eval(r) and r.get("eval/reward") is not None]
    st["heldout_reward"] = heldout[-1]["eval/reward"] if heldout else None
    st["heldout_reward_step"] = heldout[-1].get("step") if heldout else None
    st["heldout_reward_trend"] = (heldout[-1]["eval/reward"] - heldout[-2]["eval/reward"]) if len(heldout) > 1 else None
    newest = [r for r in rows if _is_eval(r)]
    st["eval_metrics"] = {k.split("/", 1)[1]: v for k, v in (newest[-1] if newest else {}).items()
                          if k.startswith("eval/") and k not in ("eval/exact_match", "eval/reward")
                          and isinstance(v, (int, float))}
    names = sorted({k for r in recent for k in r if k.startswith("task/")})
    st["task_metrics"] = {k.split("/", 1)[1]: float(np.mean([r.get(k, 0.0) for r in recent if r.get(k) is not None]))
                          for k in names}
    span = (recent[-1]["wall_time"] - recent[0]["wall_time"]) if len(recent) > 1 else 0.0
    st["samples_per_second"] = (recent[-1]["samples"] - recent[0]["samples"]) / span if span > 0 else None
    steps_per_second = (recent[-1]["step"] - recent[0]["step"]) / span if span > 0 else None
    for key, name in (("actors/tokens_per_second", "generation_tokens_per_second"),
                      ("learner/tokens_per_second", "training_tokens_per_second"),
                      ("staleness/mean", "staleness_mean")):
        vals = [r[key] for r in recent if r.get(key) is not None]
        st[name] = float(np.mean(vals)) if vals else None
    st["staleness_max"] = max((r.get("staleness/max", 0) for r in recent), default=None)
    st["batch_size"] = last.get("batch_size")
    st["queue_depth"] = last.get("queue/depth")
    st["actors_alive"] = last.get("actors/alive")
    st["actors_configured"] = cfg.get("actors", {}).get("num_actors")
    st["dropped"] = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("dropped/")}
    ckpt_step, ckpt_time = _latest_checkpoint(run_dir)
    st["checkpoint_step"], st["checkpoint_age"] = ckpt_step, (now - ckpt_time) if ckpt_time else None
    st["eta_steps_seconds"] = None
    if state == "running" and steps_per_second and st["step"] is not None and st["steps_total"]:
        st["eta_steps_seconds"] = max(0, st["steps_total"] - st["step"]) / steps_per_second
    st["target"] = run_cfg.get("stop_at_exact_match") or None
    st["eta_target_seconds"] = _eta_target(evals, st["target"]) if state == "running" else None
    if summary is not None:
        st["target_reached_at"] = summary.get("target_reached_at")
    return st


def _eta_target(evals: list[dict], target: float | None) -> float | None:
    """Seconds until held-out exact match reaches `target`, by a straight line through the last
    (up to 5) evaluations; None without a target, with fewer than 2 evaluations, or if not rising."""
    pts = [(r["wall_time"], r["eval/exact_match"]) for r in evals[-5:] if r.get("wall_time") is not None]
    if not target or len(pts) < 2:
        return None
    if pts[-1][1] >= target:
        return 0.0
    t, v = np.array(pts).T
    slope = np.polyfit(t, v, 1)[0] if np.ptp(t) > 0 else 0.0
    return float((target - pts[-1][1]) / slope) if slope > 0 else None


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _num(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _trend(delta, fmt="{:+.3f}") -> str:
    if delta is None:
        return ""
    arrow = "↑" if delta > 0 else "↓" if delta < 0 else "→"
    return f" {arrow} {fmt.format(delta)}"


def _k(v) -> str:
    return "-" if v is None else (f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.0f}")


COLORS = {"running": "green", "stalled": "magenta", "finished": "blue", "preempted": "yellow", "dead": "red"}


def render(st: dict):
    """The status screen as a rich renderable."""
    from rich.panel import Panel
    from rich.table import Table

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    color = COLORS[st["state"]]
    t.add_row("state", f"[{color}]{st['state']}[/{color}]  ({st['why']})")
    total = f" / {st['steps_total']}" if st.get("steps_total") else ""
    t.add_row("step", f"{_num(st['step'], '{}')}{total}   samples {_num(st['samples'], '{:,}')}"
                      f"   batch {_num(st['batch_size'], '{}')}")
    t.add_row("reward", f"{_num(st['reward'])}{_trend(st['reward_trend'])}  (last {WINDOW} updates vs the "
                        f"{WINDOW} before)")
    em_at = f" at step {st['exact_match_step']}" if st["exact_match_step"] is not None else ""
    if st["exact_match"] is not None or st.get("heldout_reward") is None:
        t.add_row("held-out exact match", f"{_num(st['exact_match'])}{_trend(st['exact_match_trend'])}{em_at}")
    if st.get("heldout_reward") is not None:
        t.add_row("held-out reward", f"{_num(st['heldout_reward'])}{_trend(st['heldout_reward_trend'])}"
                                     f" at step {st['heldout_reward_step']}")
    if st.get("eval_metrics"):
        t.add_row("held-out metrics", "   ".join(f"{k} {_num(v)}" for k, v in st["eval_metrics"].items()))
    if st.get("task_metrics"):
        t.add_row("task metrics", "   ".join(f"{k} {_num(v)}" for k, v in st["task_metrics"].items())
                  + f"  (mean of the last {WINDOW} updates)")
    t.add_row("throughput", f"{_num(st['samples_per_second'], '{:.1f}')} samples/s   generation "
                            f"{_k(st['generation_tokens_per_second'])} tok/s   training "
                            f"{_k(st['training_tokens_per_second'])} tok/s")
    t.add_row("staleness", f"mean {_num(st['staleness_mean'], '{:.2f}')}   max {_num(st['staleness_max'], '{}')}"
                           f"   queue {_num(st['queue_depth'], '{}')}")
    alive = f"{st['actors_alive']} alive, " if st["actors_alive"] is not None else ""
    dropped = ", ".join(f"{k} {v}" for k, v in st["dropped"].items()) or "none"
    t.add_row("actors", f"{alive}{_num(st['actors_configured'], '{}')} configured   dropped groups: {dropped}")
    ckpt = "none yet" if st["checkpoint_step"] is None else \
        f"step {st['checkpoint_step']}, {_duration(st['checkpoint_age'])} ago"
    t.add_row("last checkpoint", ckpt)
    if st["state"] == "running":
        eta = f"{_duration(st['eta_steps_seconds'])} to step {st['steps_total']}"
        if st["target"]:
            tgt = _duration(st["eta_target_seconds"]) if st["eta_target_seconds"] is not None else "not rising yet"
            eta += f";  {tgt} to exact match {st['target']} (straight line through the last evaluations)"
        t.add_row("ETA", eta)
    elif st.get("target_reached_at"):
        hit = st["target_reached_at"]
        t.add_row("target", f"reached at step {hit['step']} ({hit['samples']:,} samples, {_duration(hit['wall_time'])})")
    if st["sinks_failed"]:
        t.add_row("metric sinks off", "; ".join(f"{k}: {v}" for k, v in st["sinks_failed"].items()))
    return Panel(t, title=st["run_dir"], title_align="left", border_style=color)


def watch(run_dir: str, interval: float, console) -> dict:
    """Refresh the screen every `interval` seconds until the run stops (or Ctrl-C); a stalled run
    is still watched (it may recover)."""
    from rich.live import Live

    st = run_status(run_dir)
    with Live(render(st), console=console, auto_refresh=False) as live:
        try:
            while st["state"] in ("running", "stalled"):
                time.sleep(interval)
                st = run_status(run_dir)
                live.update(render(st), refresh=True)
        except KeyboardInterrupt:
            pass
    return st
