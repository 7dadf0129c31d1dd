"""Checks of the sharded learner on 4 CPU devices; run by sharded_step_test.py in a subprocess.

XLA fixes the number of CPU devices when JAX initializes, and the rest of the suite runs on one,
so these checks live in their own process: `python tests/learner/sharded_checks.py NAME...`
(names: see CHECKS). Each prints "ok NAME" or raises.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 4)  # before anything initializes the backend

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cadence.learner import sharding  # noqa: E402
from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from cadence.learner.config import GRPOConfig, LearnerConfig, MeshConfig, OptimizerConfig, PPOConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.packing import layout_microbatches  # noqa: E402
from cadence.learner.steps import make_train_step  # noqa: E402
from cadence.protocols.testing import rollout_group  # noqa: E402

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
T, PAD, G, MB = 16, 0, 4, 4
TOL = dict(rtol=1e-5, atol=1e-5)
# Params after an Adam step: an element whose gradient is near 0 moves by up to lr * m / sqrt(v),
# so a 1e-8 gradient difference there (the gradients themselves agree within TOL) can move it by
# ~3e-5; seen once the entropy bonus became the default.
PARAMS_AFTER_ADAM_TOL = dict(rtol=1e-5, atol=1e-4)


def groups(num_groups: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_groups):
        prompt = [1] + [int(x) for x in rng.integers(3, MODEL.vocab_size, 3)]
        comps = [[int(x) for x in rng.integers(3, MODEL.vocab_size, rng.integers(2, T - 4))] for _ in range(G)]
        behav = [[float(-rng.exponential()) for _ in c] for c in comps]
        out.append(rollout_group(f"g{i}", "t", prompt, comps, behav, [float(rng.random() < 0.5) for _ in comps], 0))
    return out


def learner_cfg(algorithm: str, **kw) -> LearnerConfig:
    ppo = PPOConfig(critic="separate", kl_coef=0.05) if algorithm == "ppo" else PPOConfig()
    if algorithm == "ppo" and "grpo" not in kw:
        # PPO's equivalence keeps the entropy bonus off, as when it was written: with it, one
        # near-zero-gradient element of the critic moved 1.2e-4 apart after Adam (lr 3e-3) while
        # the gradients agreed within TOL; the entropy on a mesh is checked by
        # chunked_logprobs_same_result and the GRPO checks (default bonus on).
        kw["grpo"] = GRPOConfig(entropy_coef=0.0)
    return LearnerConfig(algorithm=algorithm, batch_size=16, microbatch_size=MB, group_size=G,
                         optimizer=OptimizerConfig(lr=3e-3), ppo=ppo, **kw)


def layout_for(mesh: MeshConfig, abstract, devices=None):
    return sharding.make_layout(mesh, abstract, devices=devices, force=True)


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_trees_close(a, b, what: str, tol=TOL) -> None:
    for i, (x, y) in enumerate(zip(host(a), host(b))):
        np.testing.assert_allclose(x, y, err_msg=f"{what}: leaf {i}", **tol)


def grads_of(step, state, mbs, n):
    if hasattr(state, "critic_params"):  # PPO: (policy, critic) gradients
        return step.accumulate_gradients(state, mbs, n)[0]
    return step.accumulate_gradients(state.params, mbs, n)[0]


def step_equivalence(algorithm: str, mesh: MeshConfig) -> None:
    """3 updates (4, 2 and 3 microbatches, a controller rescale in between) on the mesh equal the
    same updates on one device: loss, gradients, params; no recompilation."""
    cfg = learner_cfg(algorithm)
    graphdef, params = llama.init_params(MODEL, 0)
    layout = layout_for(mesh, params)
    single = make_train_step(graphdef, cfg)
    sharded = make_train_step(graphdef, cfg, layout)
    s1 = single.init(params)
    s2 = sharded.init(layout.place(params))
    for leaf, want in zip(jax.tree.leaves(s2.params), jax.tree.leaves(layout.params)):
        assert leaf.sharding == want, (leaf.sharding, want)
    schedule = [(4, None), (2, dict(lr=3e-3 * math.sqrt(0.5), b1=0.9 ** 0.5, b2=0.99 ** 0.5, eps=1e-8 / math.sqrt(0.5))),
                (3, dict(lr=3e-3, b1=0.9, b2=0.99, eps=1e-8)),
                (1, None)]  # one microbatch: GRPO's fused accumulate-and-apply program
    for k, (num_groups, hyper) in enumerate(schedule):
        if hyper:  # what the batch-size controller does between steps
            s1, s2 = single.set_hyperparams(s1, **hyper), sharded.set_hyperparams(s2, **hyper)
        mbs, stats = build_microbatches(groups(num_groups, seed=k), T, MB, PAD, cfg.grpo)
        assert len(mbs) == num_groups
        assert_trees_close(grads_of(single, s1, mbs, stats["num_tokens"]),
                           grads_of(sharded, s2, mbs, stats["num_tokens"]), f"grads step {k}")
        s1, m1 = single.update(s1, mbs, stats["num_tokens"])
        s2, m2 = sharded.update(s2, mbs, stats["num_tokens"])
        for key in ("loss", "pg_loss", "grad_norm", "clip_frac", "learning_rate"):
            np.testing.assert_allclose(m2[key], m1[key], err_msg=f"{key} step {k}", **TOL)
        assert_trees_close(s1.params, s2.params, f"params after step {k}", PARAMS_AFTER_ADAM_TOL)
        assert_trees_close(s1.opt_state, s2.opt_state, f"Adam state after step {k}")
    sizes = sharded.cache_sizes()
    assert all(v == 1 for v in sizes.values()), sizes
    for leaf, want in zip(jax.tree.leaves(s2.params), jax.tree.leaves(layout.params)):
        assert leaf.sharding == want  # the out_shardings held


def check_grpo_fsdp_tensor():
    step_equivalence("grpo", MeshConfig(fsdp=2, tensor=2))


def check_grpo_data_fsdp():
    step_equivalence("grpo", MeshConfig(data=2, fsdp=2))


def check_grpo_packed_data_fsdp():
    """Packed microbatches (learner.microbatch_tokens: segment ids, [4, 6T] buffers, rows over
    data x fsdp) on the mesh equal one device; microbatch counts 3, 2, 1 compile once."""
    cfg = learner_cfg("grpo", microbatch_tokens=MB * T, grpo=GRPOConfig(aggregation="seq_mean_token_mean"))
    graphdef, params = llama.init_params(MODEL, 0)
    layout = layout_for(MeshConfig(data=2, fsdp=2), params)
    single, sharded = make_train_step(graphdef, cfg), make_train_step(graphdef, cfg, layout)
    s1, s2 = single.init(params), sharded.init(layout.place(params))
    counts = []
    for k, num_groups in enumerate([6, 4, 1]):
        # in two units of whole groups (the noise scale's): each unit's gradient summed apart
        mbs, stats = layout_microbatches(groups(num_groups, seed=10 + k), T, MB, MB * T, PAD, cfg.grpo, units=2)
        units = stats["unit_microbatches"]
        counts.append(len(mbs))
        assert_trees_close(grads_of(single, s1, mbs, stats["num_tokens"]),
                           grads_of(sharded, s2, mbs, stats["num_tokens"]), f"packed grads step {k}")
        objective = "unclipped" if k == 1 else "trained"  # the units' own pass, on the mesh too
        s1, m1 = single.update(s1, mbs, stats["num_tokens"], units=units, unit_objective=objective)
        s2, m2 = sharded.update(s2, mbs, stats["num_tokens"], units=units, unit_objective=objective)
        np.testing.assert_allclose(m2["loss"], m1["loss"], err_msg=f"packed loss step {k}", **TOL)
        np.testing.assert_allclose(m2["unit_grad_norm_sq"], m1["unit_grad_norm_sq"], rtol=1e-4,
                                   err_msg=f"unit norms step {k}")
        assert ("unit_batch_grad_norm_sq" in m2) == (k == 1)
        if k == 1:
            np.testing.assert_allclose(m2["unit_batch_grad_norm_sq"], m1["unit_batch_grad_norm_sq"], rtol=1e-4)
        assert len(units) == (1 if num_groups == 1 else 2)
        # Adam's first steps divide by sqrt(v) + eps: a gradient near eps turns a 1e-9 difference
        # into ~1e-5 of the param, so the params get a looser bound than the gradients above.
        for i, (x, y) in enumerate(zip(host(s1.params), host(s2.params))):
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4, err_msg=f"packed params step {k}: leaf {i}")
    assert len(set(counts)) == 3, counts
    sizes = sharded.cache_sizes()
    assert all(v == 1 for v in sizes.values()), sizes


def check_ppo_fsdp_tensor():
    step_equivalence("ppo", MeshConfig(fsdp=2, tensor=2))


def check_ppo_data_fsdp():
    step_equivalence("ppo", MeshConfig(data=2, fsdp=2))


def check_bytes_per_device():
    """Per-device params and Adam moments are total / (fsdp x tensor), from the shardings; the
    data axis replicates."""
    graphdef, params = llama.init_params(MODEL, 0)
    for mesh, split in ((MeshConfig(fsdp=2, tensor=2), 4), (MeshConfig(fsdp=4), 4),
                        (MeshConfig(data=2, fsdp=2), 2), (MeshConfig(tensor=4), 4)):
        layout = layout_for(mesh, params)
        step = make_train_step(graphdef, learner_cfg("grpo"), layout)
        state = step.init(layout.place(params))
        total = sharding.tree_bytes(params)
        assert sharding.shard_bytes(params, layout.params) * split == total, mesh
        # what the arrays really hold on each device
        for d in jax.devices():
            held = sum(s.data.nbytes for x in jax.tree.leaves(state.params) for s in x.addressable_shards
                       if s.device == d)
            assert held * split == total, (mesh, d, held, total)
        mu, nu = state.opt_state[-1].inner_state[0].mu, state.opt_state[-1].inner_state[0].nu
        for moment in (mu, nu):
            assert sharding.shard_bytes(moment, layout.params) * split == sharding.tree_bytes(moment)


def check_bf16_params_fp32_moments():
    """bf16 params and compute train with float32 Adam moments; master weights keep fp32 params."""
    mcfg = dataclasses.replace(MODEL, param_dtype="bfloat16", compute_dtype="bfloat16")
    graphdef, params = llama.init_params(mcfg, 0)
    layout = layout_for(MeshConfig(fsdp=2, tensor=2), params)
    mbs, stats = build_microbatches(groups(2, seed=0), T, MB, PAD, learner_cfg("grpo").grpo)
    for master in (False, True):
        step = make_train_step(graphdef, learner_cfg("grpo", master_weights=master, remat="full"), layout)
        state = step.init(layout.place(params))
        mu = state.opt_state[-1].inner_state[0].mu
        assert {x.dtype for x in jax.tree.leaves(mu)} == {np.dtype(np.float32)}
        want = np.float32 if master else jax.numpy.bfloat16
        assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(want)}
        new, metrics = step.update(state, mbs, stats["num_tokens"])
        assert np.isfinite(metrics["loss"]) and {x.dtype for x in jax.tree.leaves(new.params)} == {np.dtype(want)}


def check_remat_same_result():
    """learner.remat changes memory, not math: block and full give the none gradients."""
    graphdef, params = llama.init_params(MODEL, 0)
    layout = layout_for(MeshConfig(fsdp=2, tensor=2), params)
    mbs, stats = build_microbatches(groups(2, seed=0), T, MB, PAD, learner_cfg("grpo").grpo)
    out = {}
    for remat in ("none", "block", "full"):
        step = make_train_step(graphdef, learner_cfg("grpo", remat=remat), layout)
        out[remat] = step.accumulate_gradients(layout.place(params), mbs, stats["num_tokens"])[0]
    assert_trees_close(out["none"], out["block"], "block remat")
    assert_trees_close(out["none"], out["full"], "full remat")


def check_chunked_logprobs_same_result():
    """learner.logits_chunk on (fsdp 2, tensor 2) (vocabulary split over tensor) gives the
    unchunked one-device loss and gradients, entropy bonus and temperature included."""
    from cadence.learner.config import GRPOConfig

    graphdef, params = llama.init_params(MODEL, 0)
    layout = layout_for(MeshConfig(fsdp=2, tensor=2), params)
    grpo = GRPOConfig(entropy_coef=0.01)
    mbs, stats = build_microbatches(groups(2, seed=0), T, MB, PAD, grpo)
    out = {}
    for chunk, lay in ((0, None), (5, layout)):
        step = make_train_step(graphdef, learner_cfg("grpo", grpo=grpo, logits_chunk=chunk), lay, temperature=0.7)
        p = params if lay is None else lay.place(params)
        grads, per_mb = step.accumulate_gradients(p, mbs, stats["num_tokens"])
        out[chunk] = grads, per_mb
    assert_trees_close(out[0][0], out[5][0], "chunked sharded gradients")
    assert_trees_close(out[0][1], out[5][1], "chunked sharded metrics")


def check_checkpoint_reshards():
    """Saved on (fsdp 2) -> restored on 1 device and on (tensor 2): identical params and Adam
    state, and training continues identically from each."""
    cfg = learner_cfg("grpo")
    graphdef, params = llama.init_params(MODEL, 0)
    devices = jax.devices()
    fsdp = layout_for(MeshConfig(fsdp=2), params, devices[:2])
    tensor = layout_for(MeshConfig(fsdp=1, tensor=2), params, devices[2:])
    mbs, stats = build_microbatches(groups(2, seed=0), T, MB, PAD, cfg.grpo)
    step = make_train_step(graphdef, cfg, fsdp)
    saved, _ = step.update(step.init(fsdp.place(params)), mbs, stats["num_tokens"])
    arrays = {"params": saved.params, "opt_state": saved.opt_state}
    with tempfile.TemporaryDirectory() as d:
        ckpt = Checkpointer(d, CheckpointConfig(async_save=False))
        ckpt.save(1, arrays, {"step": 1})
        results = []
        for layout in (None, tensor):
            target = make_train_step(graphdef, cfg, layout)
            fresh = target.init(params if layout is None else layout.place(params))
            step_, restored, meta = ckpt.restore_latest({"params": fresh.params, "opt_state": fresh.opt_state})
            assert step_ == 1 and meta["step"] == 1
            assert_trees_close(arrays, restored, f"restored on {layout and layout.mesh.shape}")
            for x, y in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(fresh.params)):
                assert x.sharding.is_equivalent_to(y.sharding, x.ndim)  # laid out for the new mesh
            state = fresh._replace(**restored, step=1)
            state, m = target.update(state, mbs, stats["num_tokens"])
            results.append((state.params, m["loss"]))
        ckpt.close()
    (p1, l1), (p2, l2) = results
    np.testing.assert_allclose(l1, l2, **TOL)
    assert_trees_close(p1, p2, "continued training")


def check_lora_fsdp_tensor():
    """A LoRA step on (fsdp 2, tensor 2) equals one device; adapters shard like their kernels'
    axes (A by the input axis, B by the output axis), the base stays bit-identical, and the
    merged policy comes out with the base's shardings."""
    from cadence.learner.config import LoraConfig
    from cadence.learner.models import lora

    lc = LoraConfig(rank=4, alpha=8.0)
    cfg = learner_cfg("grpo", sft=dataclasses.replace(LearnerConfig().sft, steps=0), lora=lc)
    graphdef, base = llama.init_params(MODEL, 0)
    layout = layout_for(MeshConfig(fsdp=2, tensor=2), base)
    lgraphdef, adapters = lora.init_adapters(MODEL, lc, seed=0)
    single, sharded = make_train_step(lgraphdef, cfg), make_train_step(lgraphdef, cfg, layout)
    s1 = single.init(lora.join(base, adapters))
    placed = layout.place(base)
    s2 = sharded.init(lora.join(placed, adapters))
    q = s2.params["layers"][0]["self_attn"]["q_proj"]["lora"]
    kernel = placed["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value().sharding.spec  # (embed, heads)
    assert tuple(q["lora_a"].get_value().sharding.spec) == (kernel[0], None), q["lora_a"].get_value().sharding
    assert tuple(q["lora_b"].get_value().sharding.spec) == (None, kernel[1]), q["lora_b"].get_value().sharding
    for k, num_groups in enumerate((4, 1)):  # accumulate + apply (two units of 2), then the fused program
        mbs, stats = layout_microbatches(groups(num_groups, seed=k), T, MB, 0, PAD, cfg.grpo, units=2)
        units, objective = stats["unit_microbatches"], "unclipped" if k == 0 else "trained"
        s1, m1 = single.update(s1, mbs, stats["num_tokens"], units=units, unit_objective=objective)
        s2, m2 = sharded.update(s2, mbs, stats["num_tokens"], units=units, unit_objective=objective)
        np.testing.assert_allclose(m2["loss"], m1["loss"], **TOL)
        np.testing.assert_allclose(m2["unit_grad_norm_sq"], m1["unit_grad_norm_sq"], rtol=1e-4)
        if k == 0:  # the unclipped units' pass with the adapters' shardings
            np.testing.assert_allclose(m2["unit_batch_grad_norm_sq"], m1["unit_batch_grad_norm_sq"], rtol=1e-4)
        assert_trees_close(s1.params, s2.params, f"adapters after step {k}", PARAMS_AFTER_ADAM_TOL)
    assert all(np.array_equal(x, y) for x, y in zip(host(sharded.frozen), host(base)))
    merged = sharded.policy_params(s2.params)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(placed)):
        assert x.sharding == y.sharding
    assert_trees_close(single.policy_params(s1.params), merged, "merged policy", PARAMS_AFTER_ADAM_TOL)
    assert all(v == 1 for v in sharded.cache_sizes().values()), sharded.cache_sizes()


def check_lora_ppo_and_warm_up_fsdp_tensor():
    """LoRA's warm-up and PPO (separate critic of adapters, KL reference, adapter dropout) on
    (fsdp 2, tensor 2) equal one device; every adapter-sized tree shards like the policy's."""
    from cadence.learner.config import LoraConfig, SFTConfig
    from cadence.learner.models import lora
    from cadence.learner.steps.scoring import llama_logits
    from cadence.learner.steps.sft_step import SFTStep, build_sft_batch

    lc = LoraConfig(rank=4, alpha=8.0, dropout=0.2)
    cfg = learner_cfg("ppo", lora=lc)
    graphdef, base = llama.init_params(MODEL, 0)
    layout = layout_for(MeshConfig(fsdp=2, tensor=2), base)
    lgraphdef, adapters = lora.init_adapters(MODEL, lc, seed=0)
    placed = layout.place(base)
    rng = np.random.default_rng(0)
    prompts = [[1, *map(int, rng.integers(3, 32, 3))] for _ in range(4)]
    batch = build_sft_batch(prompts, [list(reversed(p[1:])) for p in prompts], T, PAD)
    warmed = []
    for lay, b in ((None, base), (layout, placed)):
        sft = SFTStep(llama_logits(lgraphdef), SFTConfig(steps=2, lr=1e-2), lay, lora=lc)
        params = lora.join(b, adapters)
        opt = sft.init(params)
        for _ in range(2):
            params, opt, m = sft.update(params, opt, batch)
        warmed.append((params, m["loss"]))
    np.testing.assert_allclose(warmed[1][1], warmed[0][1], **TOL)
    single, sharded = make_train_step(lgraphdef, cfg), make_train_step(lgraphdef, cfg, layout)
    s1, s2 = single.init(warmed[0][0]), sharded.init(warmed[1][0])
    a_spec = s2.params["layers"][0]["self_attn"]["q_proj"]["lora"]["lora_a"].get_value().sharding
    for tree in (s2.critic_params["trunk"], s2.ref_params):
        assert tree["layers"][0]["self_attn"]["q_proj"]["lora"]["lora_a"].get_value().sharding == a_spec
    for k in range(2):
        mbs, stats = build_microbatches(groups(4, seed=k), T, MB, PAD, cfg.grpo)
        s1, m1 = single.update(s1, mbs, stats["num_tokens"])
        s2, m2 = sharded.update(s2, mbs, stats["num_tokens"])
        np.testing.assert_allclose(m2["loss"], m1["loss"], **TOL)
        np.testing.assert_allclose(m2["value_loss"], m1["value_loss"], **TOL)
    assert_trees_close(s1.params, s2.params, "policy adapters", PARAMS_AFTER_ADAM_TOL)
    assert_trees_close(s1.critic_params, s2.critic_params, "critic", PARAMS_AFTER_ADAM_TOL)
    assert all(np.array_equal(x, y) for x, y in zip(host(sharded.frozen), host(base)))


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        print(f"ok {name}", flush=True)
