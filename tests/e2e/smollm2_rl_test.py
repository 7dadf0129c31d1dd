"""GRPO through the whole loop on a real pretrained model: SmolLM2-135M-Instruct (the real-model
fixture) on one-operation word problems, full fine-tuning in float32 on the CPU, in its own process.

What it holds, in one run of 18 updates of 32 samples (~10-12 minutes on 2 quiet cores):
- the setting learns: the sampled reward of the last 6 updates is at least twice that of the first
  6 (0.057 -> 0.160 when this test was written), and held-out exact match (64 problems, greedy)
  rises by at least 3 problems (0.156 -> 0.234). At lr 2e-5 and 32 samples an update a rise within
  ~20 updates is not every seed's (three seeds over 30 updates: 0.156 -> 0.750 / 0.250 / 0.172,
  docs/results/smollm2_rl.md), so the test pins seed 0 and a modest margin;
- memory: the process's peak resident size over the whole run. The issue's goal is 4.5 x 10^9
  bytes; this run's updates peaked at 4.13 GiB (4.43 x 10^9 B: shared prompts make 256-token rows;
  the documented setting without them, 3.99 GiB for the whole run, docs/results/smollm2_memory.md),
  the final checkpoint (file per array) ~3.3 GiB. The bound, 4.5 GiB, catches the losses this stop
  fixed (remat undone by XLA, Adam's model-sized temporary: ~0.5 GiB each) and the old growth
  (a run once peaked at 12.7 GB, ~1.2 GB more an update).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 18
PEAK_LIMIT = 4.5 * 2**30  # bytes (measured: 4.13 GiB)
# ~7-12 minutes on 2 cores; past this the run is stuck, not slow: it is stopped with its threads'
# tracebacks in the log, so CI fails here with a cause instead of running out its own clock.
DEADLINE_S = 25 * 60


def _hwm_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _updates_logged(path: str) -> int:
    try:
        with open(path) as f:
            return sum('"learner/train_seconds"' in line for line in f)
    except OSError:
        return 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_grpo_on_smollm2_raises_heldout_accuracy_within_the_memory_goal(smollm2_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-X", "faulthandler", "-m", "cadence.launch.cli", "train",
           "--config", os.path.join(ROOT, "benchmarks", "configs", "smollm2_decision_rule.yaml"),
           f"model.path={smollm2_dir}", "task.heldout_size=64",
           # the memory setting: synchronous sampling, 256-token rows, remat, the KV cache in bf16,
           # the checkpoint a file per array
           "actors.max_staleness=0", "learner.microbatch_tokens=256", "learner.row_tokens=256",
           "learner.remat=full", "engine.kv_dtype=bfloat16", "checkpoint.ocdbt=false",
           # the learner's exact shortcuts: flat groups skipped, a group's prompt shared in its row
           "learner.skip_zero_advantage=true", "learner.share_prompts=true",
           "task.seed=0", "actors.seed=0", "learner.seed=0",
           f"run.steps={STEPS}", "run.eval_every=0", "run.progress=false", f"run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = ROOT
    metrics = os.path.join(run_dir, "metrics.jsonl")
    log_path = tmp_path / "run.log"
    # The run's output goes to a file, not a pipe: a pipe nobody reads until the end blocks the
    # run once it fills. -X faulthandler: SIGABRT at the deadline dumps every thread's stack.
    with open(log_path, "w") as log:
        # (ulimit -c 0: the abort leaves no 4 GB core file; exec keeps the pid, whose VmHWM is read)
        proc = subprocess.Popen(["sh", "-c", 'ulimit -c 0 && exec "$@"', "sh", *cmd], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    peak, updates_peak, start = 0, None, time.monotonic()
    while proc.poll() is None:  # VmHWM only grows: its reading once the last update is logged is the updates' peak
        peak = max(peak, _hwm_bytes(proc.pid) or 0)
        if updates_peak is None and _updates_logged(metrics) >= STEPS:
            updates_peak = peak
        if time.monotonic() - start > DEADLINE_S:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(f"the run was still going after {DEADLINE_S} s with {_updates_logged(metrics)} of "
                        f"{STEPS} updates logged; its output:\n{log_path.read_text()[-12000:]}")
        time.sleep(0.5)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(open(os.path.join(run_dir, "summary.json")).read())
    records = [json.loads(line) for line in open(metrics)]
    steps = [r for r in records if "learner/train_seconds" in r]
    before, after = records[0]["eval/exact_match"], summary["final_eval"]["eval/exact_match"]
    print(json.dumps({"updates_peak_gib": updates_peak and round(updates_peak / 2**30, 3),
                      "run_peak_gib": round(peak / 2**30, 3), "before": before, "after": after,
                      "reward": [round(r["reward/mean"], 3) for r in steps]}))
    assert summary["steps"] == STEPS and len(steps) == STEPS
    assert all(r["tokens"] > 0 and 0 < r["learner/row_fill"] <= 1 for r in steps)  # packed rows trained
    assert all(r["learner/shared_prompt_tokens"] > 0 and "skipped_microbatches" in r for r in steps)
    rewards = [r["reward/mean"] for r in steps]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last >= 2 * first and last > 0.1, f"sampled reward {first:.3f} -> {last:.3f} (first vs last 6 updates)"
    assert after >= before + 3 / 64, f"held-out exact match {before} -> {after} in {STEPS} updates"
    assert 2.16e9 < peak <= PEAK_LIMIT, f"the training process peaked at {peak / 2**30:.2f} GiB"
