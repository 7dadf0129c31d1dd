"""`cadence train actors.engine=sglang`: a real sglang-jax server generates, the JAX learner trains.

Weight sync on sglang-jax is a server restart (~1 min on CPU), so the run syncs only when the
staleness bound needs it: with actors.max_staleness=S the server is restarted about every S + 1
versions. Needs $CADENCE_SGLANG_PYTHON (see sglang_engine_test.py).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from actors.sglang.testing import SKIP_REASON, sglang_python
from launch.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.sglang,
              pytest.mark.skipif(not sglang_python(), reason=SKIP_REASON)]

STEPS, STALENESS = 40, 13  # about 3 restarts after the first start


# Not yet calibrated: with these settings even the JAX engine did not raise the held-out reward in
# 24-40 steps (samples up to 13 versions stale are mostly clipped), and one run costs ~5 min of
# server restarts on CPU. Remove the skip once a setting that learns in few syncs is found.
@pytest.mark.skip(reason="settings not yet calibrated to learn within a few restart-syncs (see comment)")
def test_cli_train_with_sglang_engine_improves_reward(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    args = [f"run.dir={run}", f"run.steps={STEPS}", "run.eval_every=0", "run.progress=false",
            "learner.sft.steps=10", "task.num_digits=3", "task.heldout_size=128", "engine.max_new_tokens=4",
            "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=256", "model.n_layers=1",
            "learner.batch_size=64", "actors.prompts_per_call=8", f"actors.max_staleness={STALENESS}",
            "actors.engine=sglang", f"actors.sglang.launch_python={sglang_python()}"]
    out = subprocess.run([sys.executable, "-m", "launch.cli", "train", *args], capture_output=True,
                         text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert summary["samples"] == STEPS * 64 and summary["dropped_stale"] == 0
    assert summary["ledger"]["in_flight"] == 0  # ledger.verify() passed at the end of train()
    assert max(r["staleness/max"] for r in rows[1:]) <= STALENESS
    # The learner trained on server-generated samples: its held-out reward (greedy, JaxEngine on the
    # learner's params) rose from before RL to the end.
    before, after = rows[0]["eval/reward"], summary["final_eval"]["eval/reward"]
    assert after > before + 0.05, (before, after)
    logs = os.listdir(run / "sglang" / "logs")
    assert logs, "no server log: the SGLang engine did not run"
    starts = sum(open(run / "sglang" / "logs" / f).read().count("=== start") for f in logs)
    assert 2 <= starts <= STEPS // (STALENESS + 1) + 2, starts  # restarted to sync, not every step
    rewards = [r["reward/mean"] for r in rows[1:]]
    assert np.isfinite(rewards).all()
