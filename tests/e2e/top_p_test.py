"""Top-p end to end: the truncation the sampler applied reaches the learner's metrics."""
import math

import pytest

from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train


@pytest.mark.parametrize("behavior", ["full", "nucleus"])
def test_top_p_run_reports_the_truncation_kl(small_config, tmp_path, behavior):
    cfg = small_config("run.steps=3", "run.eval_every=0", "learner.batch_size=16", "learner.microbatch_size=8",
                       "learner.sft.steps=0", "task.heldout_size=8", "engine.top_p=0.9",
                       f"learner.grpo.behavior_logprobs={behavior}")
    train(cfg, str(tmp_path / "run"))
    rows = [m for m in read_metrics(str(tmp_path / "run")) if m["step"] > 0]
    assert len(rows) == 3 and all(0 < m["truncation_kl"] <= -math.log(0.9) + 1e-6 for m in rows)
    if behavior == "nucleus":  # the behavior logprobs are the truncated ones: the learner's are lower
        assert all(m["logprob_diff_abs"] > 0 for m in rows)
