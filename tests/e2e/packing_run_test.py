"""A short run of the default pipeline with packed microbatches (learner.microbatch_tokens)."""
import pytest

from cadence.launch.config_loader import ConfigError
from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train


def test_a_run_with_packed_microbatches_trains_and_reports_the_row_fill(small_config, tmp_path):
    # seq_len 16 on the default sort task: 128 samples in microbatches of 8 rows x 16
    cfg = small_config("run.steps=3", "learner.sft.steps=0", "task.heldout_size=16",
                       "learner.microbatch_tokens=128")
    summary = train(cfg, str(tmp_path / "run"))
    assert summary["steps"] == 3 and summary["samples"] == 3 * cfg.learner.batch_size
    rows = [m for m in read_metrics(str(tmp_path / "run")) if m["step"] > 0]
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert 0 < m["learner/row_fill"] <= 1
        assert m["tokens"] > 0 and m["loss"] == m["loss"]  # finite, not NaN


def test_a_budget_below_one_row_is_a_config_error(small_config, tmp_path):
    cfg = small_config("run.steps=1", "learner.sft.steps=0", "learner.microbatch_tokens=8")
    with pytest.raises(ConfigError, match=r"learner\.microbatch_tokens: 8 is less than one row of 16 tokens"):
        train(cfg, str(tmp_path / "run"))
    cfg = small_config("run.steps=1", "learner.sft.steps=0", "learner.microbatch_tokens=128", "learner.row_tokens=8")
    with pytest.raises(ConfigError, match=r"learner\.row_tokens: 8 is shorter than seq_len = 16"):
        train(cfg, str(tmp_path / "run"))


def test_a_run_with_shared_prompts_and_flat_groups_skipped(small_config, tmp_path):
    # rows of 64 hold a prompt and several of its group's completions; the sort task's partial
    # credit leaves some groups flat (all equal rewards), whose microbatches are skipped
    cfg = small_config("run.steps=3", "learner.sft.steps=0", "task.heldout_size=16",
                       "learner.microbatch_tokens=128", "learner.row_tokens=64", "learner.share_prompts=true",
                       "learner.skip_zero_advantage=true")
    summary = train(cfg, str(tmp_path / "run"))
    assert summary["steps"] == 3
    rows = [m for m in read_metrics(str(tmp_path / "run")) if m["step"] > 0]
    for m in rows:
        assert m["learner/shared_prompt_tokens"] > 0 and 0 < m["learner/row_fill"] <= 1
        assert m["skipped_microbatches"] >= 0 and m["loss"] == m["loss"]
