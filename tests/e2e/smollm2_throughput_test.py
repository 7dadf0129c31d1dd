"""The regime the batch-size controller is for, on a real model: generation is memory-bound at low
concurrency, so SmolLM2-135M's built-in engine makes more tokens per second when it decodes more
sequences at once (41 / 96 / 186 / 236 tokens/s at batch 1 / 4 / 16 / 64 on this CPU, issue 33).
The throughput experiment's generation part, at two concurrencies: the rate must rise with the batch.
A property of the regime, not a timing threshold: it fails if decoding a batch cost as much per
sequence as decoding one (a compute-bound engine, or one that decoded rows one at a time)."""
import json
import os

import pytest

from cadence.launch.config import load_config
from cadence.launch.experiments import throughput

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_generation_throughput_rises_with_the_batch_on_smollm2(smollm2_dir):
    cfg = load_config([os.path.join(ROOT, "examples", "smollm2-word-problems", "config.yaml")], [
        f"model.path={smollm2_dir}", "task.max_ops=1", "task.heldout_size=4", "engine.max_new_tokens=24",
        "learner.group_size=4", "learner.batch_size=32"])
    points = throughput.measure(cfg, concurrencies=(1, 8), batch_sizes=(), repeats=2, log=lambda *_: None)
    print(json.dumps(points["generation"]))  # the run's numbers, for the log
    one, eight = points["generation"]
    assert (one["concurrency"], eight["concurrency"]) == (1, 8) and points["learner"] == []
    assert one["calls"] >= 2 and eight["calls"] >= 2
    # 4 sequences a call against 32: tokens/s (the sampled lengths vary between calls)
    assert eight["tokens_per_second"] > one["tokens_per_second"], points
