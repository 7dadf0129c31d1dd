"""LoRA runs end to end from the sort-6 fixture checkpoint: exact resume, the base check, learning."""
import json
import os
import shutil

import numpy as np
import pytest

from cadence.launch.config import load_config
from cadence.launch.config_loader import ConfigError
from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# ../shared beside the checkout (CI), or beside the directory of worktrees
FIXTURES = [os.path.join(up, "shared", "fixtures", "sort6-sft-llama")
            for up in (os.path.dirname(ROOT), os.path.dirname(os.path.dirname(ROOT)))]
TIMING = ("seconds", "per_second", "wall_time", "checkpoint/", "actors/", "actor/", "queue/")


@pytest.fixture
def fixture_dir():
    for path in FIXTURES:
        if os.path.isdir(path):
            return path
    if os.environ.get("CI"):
        pytest.fail(f"{FIXTURES[0]} is missing (CI lays shared/ beside the clone)")
    pytest.skip(f"{FIXTURES[0]} is missing")


def _cfg(model_path, run_dir, *extra):
    return load_config([os.path.join(ROOT, "benchmarks", "configs", "reference.yaml")], [
        f"model.path={model_path}", "learner.sft.steps=0", "learner.lora.rank=4", "learner.lora.alpha=8",
        "learner.optimizer.lr=3e-3", "learner.batch_size=32", "learner.microbatch_size=16",
        "actors.max_staleness=0", "task.heldout_size=16", "run.eval_every=2", "run.progress=false",
        "checkpoint.every_steps=0", "task.seed=0", "actors.seed=0", "learner.seed=0", f"run.dir={run_dir}",
        *extra])


def _arrays(path):
    import jax
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as c:
        return [np.asarray(x) for x in jax.tree.leaves(c.restore(path))]


def _last_state(run_dir):
    step = max(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit())
    return os.path.join(run_dir, "checkpoints", str(step), "state")


def _deterministic(rows):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


@pytest.mark.slow
def test_a_stopped_and_resumed_lora_run_equals_an_uninterrupted_one(tmp_path, fixture_dir):
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    train(_cfg(fixture_dir, straight, "run.steps=4"))
    train(_cfg(fixture_dir, broken, "run.steps=2"))
    summary = train(_cfg(fixture_dir, broken, "run.steps=4"), resume="yes")
    assert summary["resumed_from"][-1]["step"] == 2

    # the checkpoint: adapters and their Adam state, a few KB, never the base
    state = _arrays(_last_state(straight))
    assert sum(x.nbytes for x in state) < 0.5 * 135_488 * 4
    for x, y in zip(state, _arrays(_last_state(broken)), strict=True):
        assert np.array_equal(x, y)
    for x, y in zip(_arrays(os.path.join(straight, "params")), _arrays(os.path.join(broken, "params")), strict=True):
        assert np.array_equal(x, y)  # the merged policy
    assert _deterministic(read_metrics(straight)) == _deterministic(read_metrics(broken))
    meta = json.load(open(os.path.join(_last_state(straight), "..", "meta", "metadata")))
    assert meta["lora_base"]["path"] == fixture_dir and len(meta["lora_base"]["sha256"]) == 64
    # the exports: a merged HF checkpoint and a PEFT adapter directory
    assert os.path.isfile(os.path.join(straight, "hf", "config.json"))
    assert json.load(open(os.path.join(straight, "peft", "adapter_config.json")))["r"] == 4


def test_resume_refuses_another_base_and_a_full_weight_resume(tmp_path, fixture_dir):
    base = str(tmp_path / "base")
    shutil.copytree(fixture_dir, base)
    run = str(tmp_path / "run")
    small = ("run.eval_every=0", "task.heldout_size=4")
    train(_cfg(base, run, "run.steps=1", *small))
    # the same path, other weights: the digest tells
    from safetensors.numpy import load_file, save_file
    tensors = load_file(os.path.join(base, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name] + np.float32(1e-3)
    save_file(tensors, os.path.join(base, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model.path: .* LoRA adapters trained on the base .* sha256"):
        train(_cfg(base, run, "run.steps=2", *small), resume="yes")
    with pytest.raises(ConfigError, match="learner.lora.rank: the checkpoint .* holds LoRA adapters"):
        train(_cfg(base, run, "run.steps=2", *small, "learner.lora.rank=0"), resume="yes")
    shutil.copy(os.path.join(fixture_dir, "model.safetensors"), os.path.join(base, "model.safetensors"))
    with pytest.raises(ConfigError, match="learner.lora.rank: the checkpoint .* has 4, this run 8"):
        train(_cfg(base, run, "run.steps=2", *small, "learner.lora.rank=8"), resume="yes")
    summary = train(_cfg(base, run, "run.steps=2", *small), resume="yes")  # the same base: goes on
    assert summary["steps"] == 2


def test_actor_processes_fetch_adapters_only_and_run_the_merged_policy(tmp_path, fixture_dir):
    run = str(tmp_path / "run")
    summary = train(_cfg(fixture_dir, run, "run.steps=3", "actors.processes=1", "actors.num_actors=0",
                         "run.eval_every=0", "task.heldout_size=8"))
    assert summary["steps"] == 3 and summary["ledger"]["consumed"] == 3 * 32 // 8
    last = read_metrics(run)[-1]
    # rank 4 on all seven projections of the 2-layer, d=64 fixture: 20,480 float32 adapter scalars
    adapters_bytes = 2 * 4 * 4 * (4 * (64 + 64) + 3 * (64 + 256))
    assert last["actors/weights_sent"] >= 1
    assert last["actors/weights_sent_bytes"] == last["actors/weights_sent"] * adapters_bytes
    # the actor sampled from the learner's policy: base + adapters, merged there (sync mode)
    assert all(r["logprob_diff_abs"] < 1e-4 for r in read_metrics(run) if "logprob_diff_abs" in r)


@pytest.mark.slow
def test_a_lora_run_learns_sort6_from_the_fixture(tmp_path, fixture_dir):
    """Rank 8 on every projection, lr 3e-3 (10x full fine-tuning's), sampled at temperature 0.5.

    At temperature 1 the fixture samples almost uniformly (2.85 nats per token) and adapters cannot
    sharpen it: the final RMSNorm fixes the hidden state's scale and the norm weight and lm_head
    stay frozen, so the logits' scale cannot grow (sampling entropy stayed at 2.84 nats over 800
    updates at lr 1e-3 and 3e-3, held-out exact match <= 0.18, where full fine-tuning fell to 0.14
    nats). At 0.5 the sampler draws near its argmax and the adapters move the argmax."""
    run = str(tmp_path / "run")
    summary = train(load_config([os.path.join(ROOT, "benchmarks", "configs", "reference.yaml")], [
        f"model.path={fixture_dir}", "learner.sft.steps=0", "learner.lora.rank=8", "learner.lora.alpha=16",
        "learner.optimizer.lr=3e-3", "engine.temperature=0.5", "task.heldout_size=256", "run.eval_every=20",
        "run.stop_at_exact_match=0.5", "run.steps=600", "checkpoint.every_steps=0", "run.progress=false",
        "task.seed=0", "actors.seed=0", "learner.seed=0", f"run.dir={run}"]))
    evals = [m["eval/exact_match"] for m in read_metrics(run) if "eval/exact_match" in m]
    assert summary["target_reached_at"] is not None, f"held-out exact match stayed at {max(evals):.3f}"
    assert evals[0] < 0.2 and evals[-1] >= 0.5


@pytest.mark.slow
def test_a_ppo_lora_run_after_a_warm_up_resumes_exactly(tmp_path, fixture_dir):
    """PPO with a separate critic and a KL reference, after a supervised warm-up that trains the
    adapters alone: what the checkpoint holds is adapters (policy, critic trunk, reference), the
    value head and their Adam moments, and a resumed run ends where an uninterrupted one does."""
    extra = ("learner.algorithm=ppo", "learner.ppo.critic=separate", "learner.ppo.kl_coef=0.05",
             "learner.sft.steps=3", "learner.lora.dropout=0.1", "task.heldout_size=8")
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    first = train(_cfg(fixture_dir, straight, "run.steps=2", *extra))
    assert first["steps"] == 2 and read_metrics(straight)[0]["sft/steps"] == 3
    train(_cfg(fixture_dir, broken, "run.steps=1", *extra))
    train(_cfg(fixture_dir, broken, "run.steps=2", *extra), resume="yes")
    state = _arrays(_last_state(straight))
    assert sum(x.nbytes for x in state) < 135_488 * 4  # less than one copy of the base
    for x, y in zip(state, _arrays(_last_state(broken)), strict=True):
        assert np.array_equal(x, y)
    def updates(run):  # the stopped run also evaluated at its last step, 1
        return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in _deterministic(read_metrics(run))]

    assert updates(straight) == updates(broken)
    assert os.path.isfile(os.path.join(straight, "peft", "adapter_model.safetensors"))
