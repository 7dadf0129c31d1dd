"""GRPOTrainStep: accumulation == full batch, no recompilation, alignment with the sampler, learning."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cadence.learner.batching import build_microbatches
from cadence.learner.config import GRPOConfig, LearnerConfig, OptimizerConfig, SFTConfig
from cadence.learner.steps.grpo_step import LearnerState, GRPOTrainStep
from cadence.protocols.testing import rollout_group

V, T, D = 16, 8, 8  # vocab, seq_len, width of the stand-in model
PAD = 0


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.normal(size=(V, D)) * 0.5, jnp.float32),
        "pos": jnp.asarray(rng.normal(size=(T, D)) * 0.3, jnp.float32),
        "head": jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32),
    }


def logits_fn(params, tokens, positions, mask):
    """Stand-in model: the next token depends on the current token and position only."""
    del mask
    h = jnp.tanh(params["embed"][tokens] + params["pos"][positions])  # [B, T, D]
    return h @ params["head"]  # [B, T, V]


def np_logprob(params, prev_token, prev_pos, token, temperature=1.0):
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    z = np.tanh(p["embed"][prev_token] + p["pos"][prev_pos]) @ p["head"] / temperature
    return z[token] - np.log(np.exp(z).sum())


def make_groups(num_groups, seed, group_size=4, params=None, temperature=1.0):
    """Random groups; behavior logprobs are noisy, or exact under `params` if given."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(num_groups):
        prompt = [1, int(rng.integers(2, V))]
        comps = [[int(x) for x in rng.integers(2, V, rng.integers(1, T - len(prompt) + 1))]
                 for _ in range(group_size)]
        behav = []
        for c in comps:
            seq = prompt + c
            if params is None:
                behav.append([float(-rng.random() * 4) for _ in c])
            else:
                behav.append([np_logprob(params, seq[t - 1], t - 1, seq[t], temperature)
                              for t in range(len(prompt), len(seq))])
        groups.append(rollout_group(f"g{i}", "t", prompt, comps, behav, [float(x) for x in rng.random(group_size)], 0))
    return groups


def _cfg(**grpo):
    return LearnerConfig(batch_size=16, microbatch_size=4, group_size=4,
                         optimizer=OptimizerConfig(lr=1e-2), grpo=dataclasses.replace(GRPOConfig(), **grpo))


def test_accumulated_gradient_equals_full_batch_gradient():
    cfg = _cfg(correction="coupled", entropy_coef=0.01)
    step = GRPOTrainStep(logits_fn, cfg)
    params = init_params()
    groups = make_groups(3, seed=1)  # 12 samples: 3 microbatches of 4, or one of 12
    mbs, stats = build_microbatches(groups, T, 4, PAD, cfg.grpo)
    (full,), full_stats = build_microbatches(groups, T, 12, PAD, cfg.grpo)
    n = stats["num_tokens"]
    assert len(mbs) == 3 and full_stats["num_tokens"] == n

    grads, per_mb = step.accumulate_gradients(params, mbs, n)
    grad_fn = jax.jit(jax.value_and_grad(step.loss_fn, has_aux=True))
    (ref_loss, ref_metrics), ref_grads = grad_fn(params, full, n)
    for k in params:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(ref_grads[k]), atol=1e-6, err_msg=k)
    # Each microbatch's grad-norm^2 is that of its own gradient contribution.
    for mb, stats_vec in zip(mbs, per_mb):
        _, g = grad_fn(params, mb, n)
        np.testing.assert_allclose(float(stats_vec[-1]), sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(g)),
                                   rtol=1e-4)

    state, metrics = step.update(step.init(params), mbs, n)
    np.testing.assert_allclose(metrics["loss"], float(ref_loss), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["clip_frac"], float(ref_metrics["clip_frac"]), atol=1e-6)
    ref_norm = float(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(ref_grads))))
    np.testing.assert_allclose(metrics["grad_norm"], ref_norm, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm_sq"], ref_norm**2, rtol=1e-5)
    assert metrics["microbatch_tokens"] == [float(mb.loss_mask.sum()) for mb in mbs]
    assert sum(metrics["microbatch_tokens"]) == n and metrics["step"] == 1 and state.step == 1
    assert 0 < metrics["ess"] <= 1 and metrics["entropy"] > 0
    np.testing.assert_allclose(metrics["learning_rate"], 1e-2, rtol=1e-6)
    assert not np.allclose(np.asarray(state.params["head"]), np.asarray(params["head"]))


def np_entropy_and_neg_logprob(params, groups):
    """Token means over all completion tokens of the exact entropy and of -log pi(token)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    ent, nlp = [], []
    for g in groups:
        for c in g.completion_tokens:
            seq = list(g.prompt_tokens) + list(c)
            for t in range(len(g.prompt_tokens), len(seq)):
                z = np.tanh(p["embed"][seq[t - 1]] + p["pos"][t - 1]) @ p["head"]
                logq = z - np.log(np.exp(z).sum())
                ent.append(-np.sum(np.exp(logq) * logq))
                nlp.append(-logq[seq[t]])
    return np.mean(ent), np.mean(nlp)


def test_exact_entropy_only_when_the_loss_needs_it():
    # entropy_coef = 0: no [M, T, V] softmax, the metric is the free sampled estimate;
    # entropy_coef > 0: the exact entropy, which the bonus differentiates.
    params = init_params(5)
    groups = make_groups(2, seed=6)
    want_entropy, want_sampled = np_entropy_and_neg_logprob(params, groups)
    for coef in (0.0, 0.01):
        cfg = _cfg(entropy_coef=coef)
        step = GRPOTrainStep(logits_fn, cfg)
        mbs, stats = build_microbatches(groups, T, 4, PAD, cfg.grpo)
        _, metrics = step.update(step.init(params), mbs, stats["num_tokens"])
        np.testing.assert_allclose(metrics["entropy_sampled"], want_sampled, rtol=1e-5)
        if coef:
            np.testing.assert_allclose(metrics["entropy"], want_entropy, rtol=1e-5)
        else:
            assert "entropy" not in metrics  # not computed (benchmarks/entropy_bench.py: its cost)


def test_padding_microbatch_adds_nothing():
    cfg = _cfg()
    step = GRPOTrainStep(logits_fn, cfg)
    params = init_params()
    mbs, stats = build_microbatches(make_groups(2, seed=2), T, 4, PAD, cfg.grpo)
    empty, _ = build_microbatches([rollout_group("e", "t", [1], [[]], [[]], [0.0], 0)], T, 4, PAD, cfg.grpo)
    g1, _ = step.accumulate_gradients(params, mbs, stats["num_tokens"])
    g2, _ = step.accumulate_gradients(params, mbs + empty, stats["num_tokens"])
    for k in params:
        np.testing.assert_array_equal(np.asarray(g1[k]), np.asarray(g2[k]))


def test_no_recompilation_across_batch_sizes_and_hyperparameters():
    cfg = _cfg()
    step = GRPOTrainStep(logits_fn, cfg)
    state = step.init(init_params())
    for k, (num_groups, lr) in enumerate([(3, 1e-2), (1, 3e-3), (2, 5e-3), (4, 1e-3)]):
        state = step.set_hyperparams(state, lr=lr, b1=0.9 - 0.05 * k, b2=0.99 - 0.01 * k, eps=1e-8 * (k + 1))
        mbs, stats = build_microbatches(make_groups(num_groups, seed=k), T, 4, PAD, cfg.grpo)
        state, metrics = step.update(state, mbs, stats["num_tokens"])
        assert metrics["num_microbatches"] == num_groups  # group_size 4 == microbatch_size
        np.testing.assert_allclose(metrics["learning_rate"], lr, rtol=1e-6)
        np.testing.assert_allclose(metrics["b1"], 0.9 - 0.05 * k, rtol=1e-6)
        assert np.isfinite(metrics["loss"])
    # one microbatch (num_groups 1) runs accumulate and apply as one program, compiled once too
    assert step.cache_sizes() == {"zeros": 1, "accumulate": 1, "apply": 1, "accumulate_apply": 1}
    assert isinstance(state, LearnerState) and state.step == 4


@pytest.mark.parametrize("correction", ["coupled", "decoupled"])
def test_one_microbatch_update_equals_accumulate_then_apply(correction):
    """The fused program of a one-microbatch minibatch computes what the separate programs do."""
    cfg = dataclasses.replace(_cfg(correction=correction), minibatches=2)
    fused, separate = GRPOTrainStep(logits_fn, cfg), GRPOTrainStep(logits_fn, cfg)
    params = init_params()
    mbs, stats = build_microbatches(make_groups(2, seed=3), T, 4, PAD, cfg.grpo)  # 2 microbatches
    state, metrics = fused.update(fused.init(params), mbs, stats["num_tokens"])  # 2 updates of 1 each
    assert metrics["optimizer_updates"] == 2 and "accumulate_apply" in fused.cache_sizes()

    ref = separate.init(params)
    proximal = separate.proximal_logprobs(params, mbs) if correction == "decoupled" else None
    for i, mb in enumerate(mbs):
        n = int(np.asarray(mb.loss_mask).sum())
        grads, _ = separate.accumulate_gradients(ref.params, [mb], n, None if proximal is None else [proximal[i]])
        p, o, _ = separate._apply(ref.params, ref.opt_state, grads)
        ref = ref._replace(params=p, opt_state=o)
    assert "accumulate_apply" not in separate.cache_sizes()
    for k in params:
        np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(ref.params[k]), rtol=1e-5,
                                   atol=1e-6, err_msg=k)


@pytest.mark.parametrize("correction", ["decoupled", "coupled", "none"])
def test_sampler_equal_to_learner_shows_no_mismatch(correction):
    # Behavior logprobs computed by a NumPy copy of the model at the sampling temperature: if the
    # learner scores the same token in the same column at the same temperature, there is no
    # mismatch at all (this fails if the layout or the temperature is off by anything).
    params = init_params(3)
    cfg = _cfg(correction=correction)
    groups = make_groups(2, seed=4, params=params, temperature=0.7)
    mbs, stats = build_microbatches(groups, T, 4, PAD, cfg.grpo)
    step = GRPOTrainStep(logits_fn, cfg, temperature=0.7)  # the sampler's
    _, metrics = step.update(step.init(params), mbs, stats["num_tokens"])
    assert metrics["logprob_diff_abs"] < 1e-5 and abs(metrics["mismatch_kl"]) < 1e-6
    np.testing.assert_allclose(metrics["ess"], 1.0, atol=1e-5)
    np.testing.assert_allclose(metrics["is_weight_mean"], 1.0, atol=1e-5)
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, atol=1e-5)
    if correction != "decoupled":
        return
    # Scoring at the wrong temperature is visible as a mismatch.
    wrong_step = GRPOTrainStep(logits_fn, cfg, temperature=1.0)
    _, m_wrong = wrong_step.update(wrong_step.init(params), mbs, stats["num_tokens"])
    assert m_wrong["logprob_diff_abs"] > 1e-2 and m_wrong["ess"] < 1.0


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match=r"^temperature: must be > 0 \(the sampler's, engine.temperature\)"):
        GRPOTrainStep(logits_fn, _cfg(), temperature=0.0)


def test_updates_make_the_rewarded_completion_more_likely():
    cfg = dataclasses.replace(_cfg(correction="decoupled"), optimizer=OptimizerConfig(lr=3e-2))
    step = GRPOTrainStep(logits_fn, cfg)
    params = init_params(5)
    before = (np_logprob(params, 3, 1, 5), np_logprob(params, 3, 1, 6))
    group = rollout_group("g", "t", [1, 3], [[5], [6], [5], [6]],
                  [[float(np_logprob(params, 3, 1, 5))], [float(np_logprob(params, 3, 1, 6))]] * 2,
                  [1.0, 0.0, 1.0, 0.0], 0)
    mbs, stats = build_microbatches([group], T, 4, PAD, cfg.grpo)
    state = step.init(params)
    losses = []
    for _ in range(8):
        state, metrics = step.update(state, mbs, stats["num_tokens"])
        losses.append(metrics["loss"])
    after = (np_logprob(state.params, 3, 1, 5), np_logprob(state.params, 3, 1, 6))
    assert after[0] > before[0] + 0.5 and after[1] < before[1] - 0.5
    assert metrics["mismatch_kl"] > 0.01  # the sampler's old logprobs are now stale


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=100), "^batch_size: must be a multiple of microbatch_size"),
    (dict(batch_size=96, microbatch_size=32, group_size=5), "^batch_size: must be a multiple of group_size"),
    (dict(microbatch_size=0), "^microbatch_size:"),
    (dict(grpo=GRPOConfig(clip_low=1.0)), "^grpo.clip_low:"),
    (dict(optimizer=OptimizerConfig(lr=-1.0)), "^optimizer.lr:"),
    (dict(sft=SFTConfig(batch_size=0)), "^sft.batch_size:"),
    (dict(minibatches=5), r"^minibatches: must be in \[1, batch_size / microbatch_size = 4\]"),
    (dict(minibatches=2, algorithm="ppo"), "^minibatches: .* not ppo yet"),
])
def test_learner_config_validation_names_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(LearnerConfig(), **kw).validate()
    LearnerConfig().validate()


def test_with_the_real_model():
    llama = pytest.importorskip("cadence.learner.models.llama")
    from cadence.learner.models.config import ModelConfig

    mcfg = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=T)
    graphdef, params = llama.init_params(mcfg, 0)
    cfg = _cfg(correction="coupled")
    step = GRPOTrainStep(functools.partial(llama.forward, graphdef), cfg)
    groups = make_groups(2, seed=6)
    mbs, stats = build_microbatches(groups, T, 4, PAD, cfg.grpo)
    (full,), _ = build_microbatches(groups, T, 8, PAD, cfg.grpo)
    n = stats["num_tokens"]

    # Our temperature-1 log-probs agree with the model's own on the completion tokens.
    from cadence.learner.algorithms.logprobs import token_logprobs_and_entropy

    @jax.jit
    def both(params, mb):
        theirs = llama.token_logprobs(graphdef, params, mb.tokens, mb.positions, mb.mask)
        ours, _ = token_logprobs_and_entropy(llama.forward(graphdef, params, mb.tokens, mb.positions, mb.mask),
                                             mb.tokens)
        return theirs, ours

    lp_model, lp_ours = both(params, full)
    m = full.loss_mask > 0
    np.testing.assert_allclose(np.asarray(lp_ours)[m], np.asarray(lp_model)[m], atol=1e-5)

    grads, _ = step.accumulate_gradients(params, mbs, n)
    ref = jax.jit(jax.grad(lambda p: step.loss_fn(p, full, n)[0]))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)

    state = step.init(params)
    state, m1 = step.update(state, mbs, n)
    state, m2 = step.update(step.set_hyperparams(state, lr=1e-3), mbs[:1], float(mbs[0].loss_mask.sum()))
    assert np.isfinite(m1["loss"]) and np.isfinite(m2["loss"]) and m2["learning_rate"] == pytest.approx(1e-3)
    assert step.cache_sizes() == {"zeros": 1, "accumulate": 1, "apply": 1, "accumulate_apply": 1}  # mbs[:1]: fused
    assert jax.tree.structure(state.params) == jax.tree.structure(params)


def test_donate_state_reuses_the_old_buffers():
    import warnings

    cfg = _cfg()
    step = GRPOTrainStep(logits_fn, cfg, donate_state=True)
    params = init_params()
    mbs, stats = build_microbatches(make_groups(2, seed=7), T, 4, PAD, cfg.grpo)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable" would fail here
        state, _ = step.update(step.init(params), mbs, stats["num_tokens"])
        state, metrics = step.update(state, mbs, stats["num_tokens"])
    assert params["head"].is_deleted() and not state.params["head"].is_deleted()
    assert np.isfinite(metrics["loss"]) and step.cache_sizes()["apply"] == 1


def test_adam_is_applied_without_a_model_sized_temporary():
    # XLA:CPU copies the old second moment (and materialises the clipped gradient) when Adam runs
    # as one program over donated buffers; the step's three programs make nothing but the params.
    step = GRPOTrainStep(logits_fn, _cfg())
    params = jax.eval_shape(init_params)
    opt_state = jax.eval_shape(step._init_opt, params)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    parts = ((step._apply.clip, (params,)), (step._apply.moments, (params, opt_state, params)),
             (step._apply.params, (params, opt_state, params)))
    for fn, args in parts:
        analysis = fn.lower(*args).compile().memory_analysis()
        assert analysis.temp_size_in_bytes < param_bytes / 4
        # every output but scalars (the norm, Adam's count and hyperparameters) in a donated buffer
        assert analysis.output_size_in_bytes - analysis.alias_size_in_bytes < param_bytes / 4


def _mb_logprobs(step, params, mb):
    return np.asarray(step.proximal_logprobs(params, [mb])[0], np.float64)  # [M, T]


def test_minibatches_are_sequential_updates_on_the_parts():
    # coupled: k = 2 updates per batch equal two one-update batches on the halves, bitwise.
    groups = make_groups(4, seed=3)  # 16 samples: 4 microbatches of 4
    mbs, stats = build_microbatches(groups, T, 4, PAD, GRPOConfig())
    two = GRPOTrainStep(logits_fn, dataclasses.replace(_cfg(correction="coupled"), minibatches=2))
    one = GRPOTrainStep(logits_fn, _cfg(correction="coupled"))
    params = init_params()
    s2, m2 = two.update(two.init(params), mbs, stats["num_tokens"])
    tokens = [int(sum(mb.loss_mask.sum() for mb in part)) for part in (mbs[:2], mbs[2:])]
    s1, ma = one.update(one.init(params), mbs[:2], tokens[0])
    s1, mb = one.update(s1, mbs[2:], tokens[1])
    for k in params:
        assert np.asarray(s2.params[k]).tobytes() == np.asarray(s1.params[k]).tobytes(), k
    assert s2.step == 1 and m2["step"] == 1 and m2["optimizer_updates"] == 2  # one policy version
    counts = [int(x.count) for x in jax.tree.leaves(s2.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
              if isinstance(x, optax.ScaleByAdamState)]
    assert counts == [2]  # Adam took two steps
    np.testing.assert_allclose(m2["pg_loss"], (ma["pg_loss"] + mb["pg_loss"]) / 2, rtol=1e-6)
    assert m2["microbatch_tokens"] == ma["microbatch_tokens"] + mb["microbatch_tokens"]


def test_decoupled_minibatches_clip_around_the_policy_at_the_batch_start():
    # The second update's ratio is pi_theta1 / pi_theta0 (theta0: the batch's start), so with a
    # large step its clip binds; NumPy reference of both updates' surrogate loss.
    cfg = dataclasses.replace(_cfg(correction="decoupled", clip_low=0.05, clip_high=0.05, is_cap=2.0),
                              optimizer=OptimizerConfig(lr=0.3), minibatches=2)
    groups = make_groups(4, seed=4)
    mbs, stats = build_microbatches(groups, T, 8, PAD, cfg.grpo)  # 2 microbatches: one per update
    step = GRPOTrainStep(logits_fn, cfg)
    p0 = init_params()
    state, metrics = step.update(step.init(p0), mbs, stats["num_tokens"])
    # theta1: one update on the first half (its proximal is theta0 = the current params).
    ref = GRPOTrainStep(logits_fn, dataclasses.replace(cfg, minibatches=1))
    p1 = ref.update(ref.init(p0), mbs[:1], int(mbs[0].loss_mask.sum()))[0].params

    def surrogate(mb, lp_theta, lp_prox):
        m = np.asarray(mb.loss_mask, np.float64)
        behav = np.asarray(mb.behavior_logprobs, np.float64)
        adv = np.asarray(mb.advantages, np.float64)[:, None]
        r = np.exp(lp_theta - lp_prox)
        w = np.minimum(np.exp(lp_prox - behav), cfg.grpo.is_cap)
        obj = np.minimum(r * adv, np.clip(r, 1 - 0.05, 1 + 0.05) * adv)
        clipped = (r * adv > np.clip(r, 1 - 0.05, 1 + 0.05) * adv) & (m > 0)
        return -(w * obj * m).sum() / m.sum(), clipped.sum() / m.sum()

    lp0_a = _mb_logprobs(step, p0, mbs[0])
    loss_a, clip_a = surrogate(mbs[0], lp0_a, lp0_a)
    loss_b, clip_b = surrogate(mbs[1], _mb_logprobs(step, p1, mbs[1]), _mb_logprobs(step, p0, mbs[1]))
    assert clip_a == 0 and clip_b > 0  # the trust region binds only on the second update
    np.testing.assert_allclose(metrics["pg_loss"], (loss_a + loss_b) / 2, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac"], (clip_a + clip_b) / 2, atol=1e-6)
    assert metrics["optimizer_updates"] == 2 and state.step == 1
