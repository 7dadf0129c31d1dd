"""Checkpoint stall: how long a save blocks the training loop, as a fraction of one train step.

A ~20M-parameter model (d=512, 6 layers, V=256) and its Adam state are saved asynchronously with
the same Checkpointer the trainer uses; the baseline is the bare jitted train step of that model.
The blocked time includes the snapshot of everything else (train.py's `_snapshot` + the Recorder's
deep copy), with the sample ledger of a 100k-step run (1.6M prompts, 16 groups per step) built
through the real transitions. Also measures SIGTERM -> exit of a real `cadence train` process
(final checkpoint included). Prints one JSON line.

    python benchmarks/checkpoint_bench.py
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cadence.learner.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from cadence.learner.config import OptimizerConfig  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.models.llama import count_params, init_params, token_logprobs  # noqa: E402
from cadence.learner.optimizer import make_optimizer  # noqa: E402


def stall(repeats: int = 5) -> dict:
    cfg = ModelConfig(vocab_size=256, d_model=512, n_layers=6, n_heads=8, n_kv_heads=8, d_ff=2048,
                      max_seq_len=128)
    graphdef, params = init_params(cfg, 0)
    opt = make_optimizer(OptimizerConfig())
    opt_state = opt.init(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, 256, (8, 64)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(64), tokens.shape)
    mask = jnp.ones(tokens.shape, bool)

    @jax.jit
    def step(params, opt_state):
        loss, g = jax.value_and_grad(lambda p: -token_logprobs(graphdef, p, tokens, pos, mask).mean())(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return jax.tree.map(lambda a, b: a + b, params, updates), opt_state

    params, opt_state = jax.block_until_ready(step(params, opt_state))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        params, opt_state = jax.block_until_ready(step(params, opt_state))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    ledger, ledger_seconds = long_run_ledger()
    blocked, complete, snapshots = [], [], []
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(d, CheckpointConfig(keep=2, async_save=True))
        for i in range(repeats):
            t0 = time.perf_counter()
            meta = json.loads(json.dumps({"ledger": ledger.state_dict()}))  # what a save snapshots
            snapshots.append(time.perf_counter() - t0)
            ck.save(i + 1, {"params": params, "opt_state": opt_state}, meta)
            blocked.append(time.perf_counter() - t0)
            params, opt_state = jax.block_until_ready(step(params, opt_state))  # train meanwhile
            ck.wait()
            complete.append(time.perf_counter() - t0)
        ck.close()
    return {"params": count_params(params), "step_seconds": step_s,
            "ledger_prompts": ledger.counts()["consumed"], "ledger_build_seconds": ledger_seconds,
            "snapshot_seconds": statistics.median(snapshots[1:]),
            "save_blocked_seconds": statistics.median(blocked[1:]),
            "save_complete_seconds": statistics.median(complete[1:]),
            "stall_fraction_of_step": statistics.median(blocked[1:]) / step_s}


def long_run_ledger(steps: int = 100_000, groups: int = 16):
    """The ledger of a run of `steps` updates, through issue -> queue -> consume; 32 groups queued."""
    from cadence.protocols.ledger import SampleLedger
    from cadence.protocols.messages import EngineTimings, RolloutGroup

    class P:
        __slots__ = ("prompt_id", "index")

        def __init__(self, i):
            self.prompt_id, self.index = f"sort6/train/{i}", i

    t = EngineTimings(queued_at=0, started_at=0, finished_at=0, generate_seconds=0, num_tokens=56, engine="jax")
    led = SampleLedger()
    t0 = time.perf_counter()
    n = steps * groups
    for lo in range(0, n + 32, groups):
        batch = [P(i) for i in range(lo, lo + groups)]
        led.issue(batch)
        for p in batch:
            if lo < n:
                led.queue(p)
                led.consume(p, lo // groups + 1)
            else:  # waiting for the learner at the checkpoint: full groups, through the codec
                led.queue(RolloutGroup(prompt_id=p.prompt_id, task="sort6", prompt_tokens=[1] * 8,
                                       completion_tokens=[[3] * 7] * 8, behavior_logprobs=[[-1.0] * 7] * 8,
                                       rewards=[0.5] * 8, policy_version=steps, actor_id="a", timings=t))
    return led, time.perf_counter() - t0


def sigterm_to_exit() -> float:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PYTHONPATH=ROOT)
        p = subprocess.Popen([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={d}/run", "run.steps=100000",
                              "run.progress=false", "run.eval_every=0"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = os.path.join(d, "run", "metrics.jsonl")
        while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) > 20):
            time.sleep(0.05)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
        return time.perf_counter() - t0


if __name__ == "__main__":
    out = {"bench": "checkpoint", **stall(), "sigterm_to_exit_seconds": sigterm_to_exit()}
    print(json.dumps(out))
