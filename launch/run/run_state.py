"""Resuming a run: which config changes are allowed, and putting the run directory back in order.

A resume continues from the newest complete checkpoint. Keys that change what the checkpoint
means (the model's shape, the task's prompt stream, the group layout) must be unchanged; anything
else (steps, eval cadence, learning rate, staleness bound, number of actors) may change.
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple

from cadence.actors.prompt_stream import PromptStream
from cadence.launch import artifacts
from cadence.launch.config_loader import ConfigError, flatten, load_yaml, to_dict
from cadence.launch.metrics import Clock
from cadence.protocols.ledger import SampleLedger

# Dotted prefixes that a resumed run must share with the run it continues.
# (learner.mesh and learner.processes may change: a checkpoint reshards onto the new layout.)
FROZEN_PREFIXES = ("model.", "task.", "learner.group_size", "learner.seed", "engine.max_new_tokens",
                   "learner.master_weights")


class RunFinished(RuntimeError):
    """The run directory holds a finished run: resuming would train zero steps."""


def incompatible_keys(saved: dict, current: dict) -> list[str]:
    """Frozen keys whose values differ between the saved config and the current one."""
    a, b = flatten(saved), flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k.startswith(FROZEN_PREFIXES) and a.get(k) != b.get(k)]


def check_compatible(run_dir: str, saved_cfg: dict, current_cfg: dict) -> None:
    bad = incompatible_keys(saved_cfg, current_cfg)
    if bad:
        pairs = "; ".join(f"{k}: {flatten(saved_cfg).get(k)!r} -> {flatten(current_cfg).get(k)!r}" for k in bad)
        raise ConfigError(f"cannot resume {run_dir} with a changed {', '.join(bad)} ({pairs}); "
                          "start a new run.dir instead")


def newest_meta(checkpoint_dir: str) -> dict:
    """The JSON metadata of the newest checkpoint step that has one ({} if none), read before
    orbax restores arrays into a template (a mismatch is then named, not a failed restore)."""
    steps = sorted((int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()), reverse=True) \
        if os.path.isdir(checkpoint_dir) else []
    for step in steps:
        try:
            with open(os.path.join(checkpoint_dir, str(step), "meta", "metadata")) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue
    return {}


def check_lora_base(run_dir: str, meta: dict, current: dict | None) -> None:
    """A LoRA checkpoint holds adapters only: refuse to resume them on another base (other
    weights at model.path, or other adapter shapes), and refuse to mix LoRA and full-weight
    checkpoints. current: the run's base record (path, sha256, rank, alpha, targets), None for a
    full-weight run. Raises ConfigError naming what differs."""
    saved = meta.get("lora_base")
    if current is None:
        if saved:
            raise ConfigError(f"learner.lora.rank: the checkpoint in {run_dir} holds LoRA adapters "
                              f"(rank {saved.get('rank')}); resume it with the same learner.lora settings")
        return
    if not saved:
        raise ConfigError(f"learner.lora.rank: the checkpoint in {run_dir} holds full weights, not LoRA "
                          "adapters; resume it with learner.lora.rank=0 or start a new run.dir")
    if saved.get("sha256") != current["sha256"]:
        raise ConfigError(
            f"model.path: the checkpoint in {run_dir} holds LoRA adapters trained on the base at "
            f"{saved.get('path')!r} (weights sha256 {saved.get('sha256')}); the base at "
            f"{current['path']!r} has sha256 {current['sha256']}. Resume on the same base weights")
    for key in ("rank", "alpha", "targets"):
        if saved.get(key) != current[key]:
            raise ConfigError(f"learner.lora.{key}: the checkpoint in {run_dir} has {saved.get(key)!r}, "
                              f"this run {current[key]!r}; start a new run.dir to change it")


def saved_config(run_dir: str) -> dict:
    return load_yaml(os.path.join(run_dir, "config.yaml"))


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep metrics lines up to and including `last_step` (the checkpoint's); drop the rest,
    including a half-written last line. Returns the number of lines kept."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by the crash
            if row.get("step", 0) > last_step:
                break
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(kept)


def locate(cfg, run_dir: str | None, resume: str) -> tuple[str, bool]:
    """The run directory, and whether this start continues a checkpoint there.

    resume: "no" (a new run), "auto" (continue if there is a checkpoint), "yes" (must continue).
    Raises ConfigError for "yes" with nothing to continue, or a resume that changes frozen keys."""
    run_dir = os.path.abspath(run_dir or cfg.run.dir or artifacts.default_run_dir(cfg))
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if resume == "yes" and not has_ckpt:
        raise ConfigError(f"run.resume: nothing to resume in {run_dir} (no complete checkpoint)")
    resuming = resume in ("yes", "auto") and has_ckpt
    if resuming:
        check_compatible(run_dir, saved_config(run_dir), to_dict(cfg))
    else:  # before anything writes there (actor processes start right after this)
        artifacts.check_fresh(run_dir, overwrite=resume == "auto")
    return run_dir, resuming


class Begin(NamedTuple):
    """Where a run starts: restored from its newest checkpoint, or fresh."""
    step0: int
    arrays: dict | None  # the checkpoint's arrays (None for a fresh run)
    restored: bool
    meta: dict  # the checkpoint's metadata ({} for a fresh run)
    ledger: SampleLedger
    stream: PromptStream
    clock: Clock
    summary: dict


def begin(cfg, run_dir: str, checkpointer, template: dict, task, progress, resume: str, resuming: bool) -> Begin:
    """Restore the newest complete checkpoint (arrays, ledger with its queued groups, in-flight
    prompts to re-issue, metrics truncated to the step), or prepare a fresh run directory.

    template: the learner state's arrays ({name: tree}), for orbax to restore into."""
    if not resuming:
        artifacts.prepare_run_dir(cfg, run_dir, overwrite=resume == "auto")
        return Begin(0, None, False, {}, SampleLedger(), PromptStream(task), Clock(), {"target_reached_at": None})
    restored = checkpointer.restore_latest(template)
    if restored is None:
        raise ConfigError(f"run.resume: no checkpoint in {checkpointer.directory} restores (see the warnings above)")
    step0, arrays, meta = restored
    saved_steps = meta["config"]["run"]["steps"]
    if meta.get("finished") and cfg.run.steps <= max(saved_steps, step0):
        raise RunFinished(
            f"{run_dir} already finished at step {step0} (run.steps={cfg.run.steps}); "
            "raise run.steps to train further, or start a new run.dir")
    ledger = SampleLedger.from_state_dict(meta["ledger"])
    # prompts in flight at the checkpoint were never answered (as far as this timeline knows)
    reissue = sorted(set(ledger.release(list(ledger.in_flight))) | set(meta["reissue"]))
    stream = PromptStream(task, start=meta["stream_position"], reissue=reissue)
    lines = truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), step0)
    summary = dict(meta["summary"])
    summary.setdefault("resumed_from", []).append(
        {"step": step0, "queued_restored": len(ledger.queued), "reissued": len(reissue)})
    artifacts.write_config(cfg, run_dir)
    progress.message(f"resumed {run_dir} at step {step0} ({lines} metrics lines kept, "
                     f"{len(ledger.queued)} queued groups restored, {len(reissue)} prompts re-issued)")
    return Begin(step0, arrays, True, meta, ledger, stream, Clock(offset=meta["wall_time"]), summary)
