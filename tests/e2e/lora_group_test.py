"""LoRA on a learner of two processes (`learner.processes=2`, 2 CPU devices each: a fsdp 2 x
tensor 2 mesh across them), from the sort-6 fixture, with a supervised warm-up of the adapters and
adapter dropout: it trains as one process does, and a run stopped and resumed on the group equals
an uninterrupted one, bit for bit."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cadence.launch.config import load_config
from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train

from tests.e2e.lora_run_test import _deterministic, _last_state, fixture_dir  # noqa: F401

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ("loss", "pg_loss", "grad_norm", "clip_frac", "reward/mean", "eval/exact_match", "sft/loss")


def _args(model_path, run_dir, *extra):
    return [f"model.path={model_path}", "learner.sft.steps=3", "learner.lora.rank=4", "learner.lora.alpha=8",
            "learner.lora.dropout=0.1",
            "learner.optimizer.lr=3e-3", "learner.batch_size=32", "learner.microbatch_size=16",
            "actors.max_staleness=0", "task.heldout_size=16", "run.eval_every=2", "run.progress=false",
            "checkpoint.every_steps=0", "task.seed=0", "actors.seed=0", "learner.seed=0", f"run.dir={run_dir}",
            *extra]


def _arrays(path):
    """The leaves of an orbax checkpoint, whatever mesh wrote them, as NumPy arrays."""
    import jax
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as c:
        meta = c.metadata(path)
        meta = getattr(meta, "item_metadata", meta)
        template = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
        return [np.asarray(x) for x in jax.tree.leaves(c.restore(path, template))]


def _group(model_path, run_dir, *extra, resume=False):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = [sys.executable, "-m", "cadence.launch.cli", "train", *(["--resume"] if resume else []),
           "--config", os.path.join(ROOT, "benchmarks", "configs", "reference.yaml"),
           *_args(model_path, run_dir, "learner.processes=2", "learner.mesh.fsdp=2", "learner.mesh.tensor=2", *extra)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(open(os.path.join(run_dir, "summary.json")).read())


def test_lora_on_two_learner_processes_trains_as_one_and_resumes_exactly(tmp_path, fixture_dir):  # noqa: F811
    one, straight, broken = (str(tmp_path / n) for n in ("one", "straight", "broken"))
    train(load_config([os.path.join(ROOT, "benchmarks", "configs", "reference.yaml")],
                      _args(fixture_dir, one, "run.steps=4")))
    summary = _group(fixture_dir, straight, "run.steps=4")
    assert summary["steps"] == 4
    rows1, rows2 = read_metrics(one), read_metrics(straight)
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1] == list(range(5))
    for a, b in zip(rows1, rows2):  # the same samples, the same updates (float sums in another order)
        for key in COMPARED:
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5, err_msg=f"step {a['step']} {key}")
    # the merged policy both wrote (every process its shards) and the PEFT adapters
    for x, y in zip(_arrays(os.path.join(one, "params")), _arrays(os.path.join(straight, "params")), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)
    assert json.load(open(os.path.join(straight, "peft", "adapter_config.json")))["r"] == 4

    _group(fixture_dir, broken, "run.steps=2")
    summary = _group(fixture_dir, broken, "run.steps=4", resume=True)
    assert summary["resumed_from"][-1]["step"] == 2
    state = _arrays(_last_state(straight))  # adapters and their Adam moments, never the base
    assert sum(x.nbytes for x in state) < 0.5 * 135_488 * 4
    for x, y in zip(state, _arrays(_last_state(broken)), strict=True):
        assert np.array_equal(x, y)
    for x, y in zip(_arrays(os.path.join(straight, "params")), _arrays(os.path.join(broken, "params")), strict=True):
        assert np.array_equal(x, y)
    assert _deterministic(read_metrics(straight)) == _deterministic(read_metrics(broken))
