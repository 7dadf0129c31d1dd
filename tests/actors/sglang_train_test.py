"""`cadence train actors.engine=sglang`: a real sglang-jax server generates, the JAX learner trains.

Weight sync on sglang-jax is a server restart (13-25 s on CPU with the shared compilation cache),
so the run syncs only when the staleness bound needs it: with actors.max_staleness=S the server is
restarted about every S versions. Needs $CADENCE_SGLANG_PYTHON (see sglang_engine_test.py).

Calibration (an in-process simulation of exactly this sync policy: a JAX engine that refreshes its
weights only when the bound forces it, seeds 0-2): at S=5 the mean training reward of the samples
from the last versions beat the version-0 samples by 0.13-0.17; at S=13 (3 versions in 40 steps)
the gain was -0.04..+0.06, too small to test, since most 13-version-old samples fall outside the
coupled trust region.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cadence.actors.sglang.testing import SKIP_REASON, sglang_python
from cadence.launch.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.sglang,
              pytest.mark.skipif(not sglang_python(), reason=SKIP_REASON)]

STEPS, STALENESS = 60, 5  # about 12 restarts after the first start (measured: 13 starts)


def test_cli_train_with_sglang_engine_improves_reward(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    args = [f"run.dir={run}", f"run.steps={STEPS}", "run.eval_every=0", "run.progress=false",
            "learner.sft.steps=10", "task.num_digits=3", "task.heldout_size=128", "engine.max_new_tokens=4",
            "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=256", "model.n_layers=1",
            "learner.batch_size=64", "actors.prompts_per_call=8", f"actors.max_staleness={STALENESS}",
            "actors.engine=sglang", f"actors.sglang.launch_python={sglang_python()}"]
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", *args], capture_output=True,
                         text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert summary["samples"] == STEPS * 64 and summary["dropped_stale"] == 0
    assert summary["ledger"]["in_flight"] == 0  # ledger.verify() passed at the end of train()
    assert max(r["staleness/max"] for r in rows[1:]) <= STALENESS
    # The reward of what the server sampled rose: the learner improved on server samples AND the
    # restarts brought the improvement back to the server. Version-0 samples against the last 15
    # steps' (all from later versions), each a mean over >= 6 batches of 64.
    oldest = [r["step"] - 1 - r["staleness/max"] for r in rows[1:]]  # version of a step's oldest sample
    first = [r["reward/mean"] for r, v in zip(rows[1:], oldest) if v == 0]
    last = [r["reward/mean"] for r in rows[-15:]]
    assert min(oldest[-15:]) > 0 and len(first) >= 6
    assert np.mean(last) > np.mean(first) + 0.08, (np.mean(first), np.mean(last))
    logs = os.listdir(run / "sglang" / "logs")
    assert logs, "no server log: the SGLang engine did not run"
    starts = sum(open(run / "sglang" / "logs" / f).read().count("=== start") for f in logs)
    # A sync lands when the served version would fall out of the bound: about every S versions
    # (measured: 13 starts in 60 steps at S=5), far from every step.
    assert 2 <= starts <= STEPS // STALENESS + 2, starts
    rewards = [r["reward/mean"] for r in rows[1:]]
    assert np.isfinite(rewards).all()
    assert rows[-1]["sglang/syncs"] >= 2 and rows[-1]["sglang/completions"] >= STEPS * 64  # engine counters in the metrics
