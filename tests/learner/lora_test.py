"""LoRA: the adapted layer against NumPy, only adapters train, rank 0 is the full path, PEFT loads the export."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cadence.learner.config import LearnerConfig, LoraConfig, OptimizerConfig, SFTConfig
from cadence.learner.models import llama, lora
from cadence.learner.models.config import ModelConfig
from cadence.learner.steps import make_train_step
from cadence.learner.batching import build_microbatches
from cadence.protocols.testing import rollout_group

TINY = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
T = 12


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _bitwise_equal(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return la.keys() == lb.keys() and all(la[k].dtype == lb[k].dtype and la[k].tobytes() == lb[k].tobytes()
                                          for k in la)


def test_lora_linear_forward_and_gradients_match_numpy():
    lc = LoraConfig(rank=2, alpha=3.0, targets=("q",))
    layer = llama._linear(TINY, 3, 4, nnx.Rngs(0), ("embed", "heads"), lora=lc, target="q")
    rng = np.random.default_rng(0)
    W, A, B = rng.normal(size=(3, 4)), rng.normal(size=(3, 2)), rng.normal(size=(2, 4))
    layer.kernel.set_value(jnp.asarray(W, jnp.float32))
    layer.lora.lora_a.set_value(jnp.asarray(A, jnp.float32))
    layer.lora.lora_b.set_value(jnp.asarray(B, jnp.float32))
    graphdef, state = nnx.split(layer)
    x, g = rng.normal(size=(5, 3)), rng.normal(size=(5, 4))
    s = 3.0 / 2

    def objective(state):
        return jnp.sum(nnx.merge(graphdef, state)(jnp.asarray(x, jnp.float32)) * jnp.asarray(g, jnp.float32))

    y = nnx.merge(graphdef, state)(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(y), x @ W + s * (x @ A) @ B, rtol=1e-5, atol=1e-5)
    grads = jax.grad(objective)(state)
    np.testing.assert_allclose(np.asarray(grads["kernel"][...]), x.T @ g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora"]["lora_a"][...]), s * x.T @ (g @ B.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora"]["lora_b"][...]), s * (x @ A).T @ g, rtol=1e-5, atol=1e-5)


def test_adapter_dropout_masks_the_adapter_input_only_and_only_inside_its_context():
    lc = LoraConfig(rank=2, alpha=3.0, targets=("q",), dropout=0.4)
    layer = llama._linear(TINY, 6, 4, nnx.Rngs(0), ("embed", "heads"), lora=lc, target="q")
    rng = np.random.default_rng(1)
    W, A, B = rng.normal(size=(6, 4)), rng.normal(size=(6, 2)), rng.normal(size=(2, 4))
    layer.kernel.set_value(jnp.asarray(W, jnp.float32))
    layer.lora.lora_a.set_value(jnp.asarray(A, jnp.float32))
    layer.lora.lora_b.set_value(jnp.asarray(B, jnp.float32))
    graphdef, state = nnx.split(layer)
    x = rng.normal(size=(3, 5, 6)).astype(np.float32)
    s, p, key = 3.0 / 2, 0.4, jax.random.key(7)

    def run(x):  # two calls in one pass: the second adapter reached draws another mask
        layer = nnx.merge(graphdef, state)
        return layer(x), layer(x)

    with lora.adapter_dropout(key, p):
        y1, y2 = jax.jit(run)(jnp.asarray(x))
    # NumPy reference: the masks are the ones jax.random draws from fold_in(key, n) for the n-th call
    for n, y in enumerate((y1, y2)):
        keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, n), 1 - p, x.shape))
        dropped = np.where(keep, x / (1 - p), 0.0)
        np.testing.assert_allclose(np.asarray(y), x @ W + s * (dropped @ A) @ B, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(y1), np.asarray(y2))
    assert 0.3 < 1 - np.asarray(jax.random.bernoulli(jax.random.fold_in(key, 0), 1 - p, x.shape)).mean() < 0.5
    y0, _ = run(jnp.asarray(x))  # outside the context (sampling, evaluation): the adapters whole
    np.testing.assert_allclose(np.asarray(y0), x @ W + s * (x @ A) @ B, rtol=1e-5, atol=1e-5)


def test_dropout_acts_in_the_gradient_pass_only_and_its_masks_follow_the_step():
    lc = LoraConfig(rank=4, alpha=8.0, dropout=0.3)
    cfg = dataclasses.replace(_learner_cfg(lc), minibatches=2, microbatch_size=4,
                              grpo=dataclasses.replace(LearnerConfig().grpo, correction="decoupled"))
    _, base = llama.init_params(TINY, 0)
    lgraphdef, adapters = lora.init_adapters(TINY, lc, seed=0)
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # B != 0: the adapters matter
    params = lora.join(base, adapters)
    batches = [build_microbatches(_groups(i), T, 4, 0, cfg.grpo) for i in range(2)]

    def two_updates(cfg, stop_after=2):
        step = make_train_step(lgraphdef, cfg)
        state = step.init(params)
        losses = []
        for mbs, stats in batches[:stop_after]:
            state, m = step.update(state, mbs, stats["num_tokens"])
            losses.append(m["loss"])
        return step, state, losses

    step, dropped, losses = two_updates(cfg)
    _, whole, losses0 = two_updates(dataclasses.replace(cfg, lora=dataclasses.replace(lc, dropout=0.0)))
    assert losses[0] != losses0[0]  # the masks reach the loss...
    # ...but not the proximal log-probs (the trust region's centre is the policy actors sample)
    mbs = batches[0][0]
    prox = step.proximal_logprobs(step.init(params).params, mbs)
    prox0 = make_train_step(lgraphdef, dataclasses.replace(cfg, lora=dataclasses.replace(lc, dropout=0.0)))
    prox0 = prox0.proximal_logprobs(prox0.init(params).params, mbs)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(prox, prox0))
    # the same step, minibatch and microbatch draw the same masks: a fresh learner at the
    # checkpointed step (as a resume builds it) ends where the uninterrupted one did
    _, first, _ = two_updates(cfg, stop_after=1)
    again = make_train_step(lgraphdef, cfg)
    again.init(params)
    resumed, m = again.update(first, *[batches[1][0], batches[1][1]["num_tokens"]])
    assert m["loss"] == losses[1]
    assert _bitwise_equal(resumed.params, dropped.params)
    assert not _bitwise_equal(dropped.params, whole.params)
    # another seed, other masks
    _, _, other = two_updates(dataclasses.replace(cfg, seed=1))
    assert other[0] != losses[0]


def _batch(seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (2, T), 1, TINY.vocab_size)
    positions = jnp.tile(jnp.arange(T), (2, 1))
    return tokens, positions, jnp.ones((2, T), bool)


def test_adapters_start_at_the_base_shard_like_their_kernel_and_merge_exactly():
    lc = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down"))
    graphdef, base = llama.init_params(TINY, 0)
    lgraphdef, adapters = lora.init_adapters(TINY, lc, seed=1)
    paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(adapters)}
    assert paths == {f"layers/{i}/{m}/lora/lora_{ab}" for i in range(2) for ab in "ab"
                     for m in ("self_attn/q_proj", "self_attn/v_proj", "mlp/down_proj")}
    q = adapters["layers"][0]["self_attn"]["q_proj"]["lora"]
    assert q["lora_a"].get_value().shape == (32, 4) and q["lora_b"].get_value().shape == (4, 32)
    assert q["lora_a"].get_value().dtype == jnp.float32 and not np.any(np.asarray(q["lora_b"][...]))
    specs = nnx.get_partition_spec(lora.lora_graphdef(TINY, lc)[1])["layers"][0]["mlp"]["down_proj"]["lora"]
    assert tuple(specs["lora_a"].get_value()) == ("mlp", None)  # the kernel is ("mlp", "embed")
    assert tuple(specs["lora_b"].get_value()) == (None, "embed")

    batch = _batch()
    params = lora.join(base, adapters)
    assert _bitwise_equal(lora.split(params)[1], base)
    same = llama.forward(lgraphdef, params, *batch)
    assert np.array_equal(np.asarray(same), np.asarray(llama.forward(graphdef, base, *batch)))  # B = 0

    moved = jax.tree.map(lambda x: x + 0.03, adapters)
    unmerged = llama.forward(lgraphdef, lora.join(base, moved), *batch)
    merged = llama.forward(graphdef, lora.merge_weights(base, moved, lc), *batch)
    assert np.abs(np.asarray(unmerged - same)).max() > 1e-2
    np.testing.assert_allclose(np.asarray(unmerged), np.asarray(merged), atol=1e-5)


def _groups(seed, n=4, g=4):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [1] + [int(x) for x in rng.integers(2, TINY.vocab_size, 3)]
        comps = [[int(x) for x in rng.integers(2, TINY.vocab_size, rng.integers(2, T - 4))] for _ in range(g)]
        behav = [[float(-rng.random() * 3) for _ in c] for c in comps]
        out.append(rollout_group(f"g{i}", "t", prompt, comps, behav, [float(x) for x in rng.random(g)], 0))
    return out


def _learner_cfg(lc: LoraConfig, lr=1e-2):
    return LearnerConfig(batch_size=16, microbatch_size=8, group_size=4, optimizer=OptimizerConfig(lr=lr),
                         sft=SFTConfig(steps=0), lora=lc)


def _train(cfg: LearnerConfig, graphdef, params, steps=2):
    step = make_train_step(graphdef, cfg)
    state = step.init(params)
    for i in range(steps):
        mbs, stats = build_microbatches(_groups(i), T, cfg.microbatch_size, 0, cfg.grpo)
        state, metrics = step.update(state, mbs, stats["num_tokens"])
    return step, state, metrics


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_an_update_trains_only_the_adapters(param_dtype):
    model = dataclasses.replace(TINY, param_dtype=param_dtype)
    lc = LoraConfig(rank=4, alpha=8.0)
    _, base = llama.init_params(model, 0)
    base_copy = jax.tree.map(lambda x: np.array(x), base)
    lgraphdef, adapters = lora.init_adapters(model, lc, seed=0)
    step, state, metrics = _train(_learner_cfg(lc), lgraphdef, lora.join(base, adapters))

    assert _bitwise_equal(step.frozen, base_copy)  # the frozen base: every bit as it was
    assert _bitwise_equal(base, base_copy)
    assert _leaves(state.params).keys() == _leaves(adapters).keys()  # the state trains adapters only
    b = state.params["layers"][0]["mlp"]["up_proj"]["lora"]["lora_b"].get_value()
    assert b.dtype == jnp.float32 and np.abs(np.asarray(b)).max() > 0
    # Adam's moments: float32, one per adapter, nothing for the base
    moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
    assert all(x.dtype == jnp.float32 for x in moments)
    assert metrics["grad_norm"] > 0
    # the controller's rescale reaches the adapters' optimizer; the base is still untouched
    state = step.set_hyperparams(state, lr=2e-2, b1=0.81, eps=1e-9)
    assert step.get_hyperparams(state)["learning_rate"] == pytest.approx(2e-2)
    mbs, stats = build_microbatches(_groups(9), T, 8, 0, step.cfg.grpo)
    state, _ = step.update(state, mbs, stats["num_tokens"])
    assert _bitwise_equal(step.frozen, base_copy)
    # what actors get: the base with W + alpha/r A B, in the base's dtype
    merged = step.policy_params(state.params)
    assert _leaves(merged).keys() == _leaves(base).keys()
    q = "['layers'][0]['self_attn']['q_proj']['kernel'].value"
    assert _leaves(merged)[q].dtype == _leaves(base)[q].dtype
    assert not np.array_equal(_leaves(merged)[q], _leaves(base)[q])


@pytest.mark.parametrize("extra", [dict(minibatches=2), dict(microbatch_tokens=48)], ids=["minibatches", "packed"])
def test_lora_minibatches_and_packed_rows_keep_the_base(extra):
    lc = LoraConfig(rank=2, alpha=4.0, targets=("v", "o"))
    cfg = dataclasses.replace(_learner_cfg(lc), microbatch_size=4, **extra)
    if "minibatches" in extra:  # the decoupled correction's proximal pass runs too
        cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, correction="decoupled"))
    _, base = llama.init_params(TINY, 0)
    base_copy = jax.tree.map(lambda x: np.array(x), base)
    lgraphdef, adapters = lora.init_adapters(TINY, lc, seed=0)
    step = make_train_step(lgraphdef, cfg)
    state = step.init(lora.join(base, adapters))
    groups = _groups(0)
    if cfg.microbatch_tokens:
        from cadence.learner.packing import pack_microbatches, rows_per_microbatch
        mbs, stats = pack_microbatches(groups, T, rows_per_microbatch(cfg.microbatch_tokens, T), 0, cfg.grpo)
    else:
        mbs, stats = build_microbatches(groups, T, cfg.microbatch_size, 0, cfg.grpo)
    state, metrics = step.update(state, mbs, stats["num_tokens"])
    assert metrics.get("optimizer_updates", 1) == extra.get("minibatches", 1)
    assert _bitwise_equal(step.frozen, base_copy)
    assert np.abs(np.asarray(state.params["layers"][1]["self_attn"]["o_proj"]["lora"]["lora_b"][...])).max() > 0


def test_rank_zero_is_the_full_fine_tuning_path():
    graphdef, params = llama.init_params(TINY, 0)
    full = _learner_cfg(LoraConfig())
    off = _learner_cfg(LoraConfig(rank=0, alpha=3.0, targets=("q",)))
    s_full, a, _ = _train(full, graphdef, params)
    s_off, b, _ = _train(off, graphdef, params)
    assert s_off.lora is None and s_off.policy_params(b.params) is b.params
    assert _bitwise_equal(a.params, b.params) and _bitwise_equal(a.opt_state, b.opt_state)
    # the compiled program is the very same one
    mbs, stats = build_microbatches(_groups(0), T, 8, 0, full.grpo)
    packed, n, s = s_full._prepare(params, mbs, stats["num_tokens"], None)
    state = s_full.init(params)
    texts = [st._accumulate_apply.lower(params, state.opt_state, st._zeros(params), packed[0], n, s).as_text()
             for st in (s_full, s_off)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("kw, match", [
    (dict(rank=-1), "lora.rank: must be >= 0"),
    (dict(rank=4, alpha=0.0), "lora.alpha: must be > 0"),
    (dict(rank=4, targets=("q", "w")), "lora.targets: unknown projection 'w'"),
    (dict(rank=4, targets=()), "lora.targets: must name at least one"),
    (dict(rank=4, dropout=1.0), r"lora.dropout: must be in \[0, 1\)"),
    (dict(rank=4, dropout=-0.1), r"lora.dropout: must be in \[0, 1\)"),
])
def test_lora_config_errors_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(LearnerConfig(sft=SFTConfig(steps=0)), lora=LoraConfig(**kw)).validate()


def test_the_supervised_warm_up_trains_the_adapters_alone():
    from cadence.learner.steps.scoring import llama_logits
    from cadence.learner.steps.sft_step import SFTStep, build_sft_batch

    lc = LoraConfig(rank=4, alpha=8.0)
    LearnerConfig(lora=lc).validate()  # sft.steps > 0 with LoRA: allowed
    _, base = llama.init_params(TINY, 0)
    base_copy = jax.tree.map(lambda x: np.array(x), base)
    lgraphdef, adapters = lora.init_adapters(TINY, lc, seed=0)
    sft = SFTStep(llama_logits(lgraphdef), SFTConfig(steps=5, lr=3e-2), lora=lc)
    params = lora.join(base, adapters)
    opt_state = sft.init(params)
    moments = [x for x in jax.tree.leaves(opt_state) if getattr(x, "ndim", 0) > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
    rng = np.random.default_rng(0)
    prompts = [[1, *map(int, rng.integers(2, 40, 3))] for _ in range(4)]
    batch = build_sft_batch(prompts, [list(reversed(p[1:])) for p in prompts], T, 0)
    losses = []
    for _ in range(5):
        params, opt_state, m = sft.update(params, opt_state, batch)
        losses.append(m["loss"])
    assert losses[-1] < losses[0]
    trained, kept = lora.split(params)
    assert _bitwise_equal(kept, base_copy)  # the base: every bit as it was
    assert np.abs(np.asarray(trained["layers"][0]["mlp"]["up_proj"]["lora"]["lora_b"][...])).max() > 0
    # the RL step starts from the warmed-up adapters on the same base
    step = make_train_step(lgraphdef, _learner_cfg(lc))
    state = step.init(params)
    assert _bitwise_equal(state.params, trained) and _bitwise_equal(step.frozen, base_copy)


@pytest.mark.parametrize("critic, dropout", [("value_head", 0.0), ("separate", 0.0), ("separate", 0.2)])
def test_ppo_trains_the_policy_adapters_the_value_head_and_a_critic_of_adapters(critic, dropout):
    from cadence.learner.config import PPOConfig

    lc = LoraConfig(rank=4, alpha=8.0, dropout=dropout)
    cfg = dataclasses.replace(_learner_cfg(lc), algorithm="ppo",
                              ppo=dataclasses.replace(PPOConfig(), critic=critic, kl_coef=0.1))
    cfg.validate()  # PPO with LoRA: allowed
    _, base = llama.init_params(TINY, 0)
    base_copy = jax.tree.map(lambda x: np.array(x), base)
    lgraphdef, adapters = lora.init_adapters(TINY, lc, seed=0)
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B != 0: the reference is not the base
    step = make_train_step(lgraphdef, cfg)
    state = step.init(lora.join(base, adapters))
    ref0 = jax.tree.map(np.array, state.ref_params)
    for i in range(2):
        mbs, stats = build_microbatches(_groups(i), T, 8, 0, cfg.grpo)
        state, metrics = step.update(state, mbs, stats["num_tokens"])
    # what trains: the policy's adapters, the value head, a separate critic's own adapters; never the base
    assert _leaves(state.params).keys() == _leaves(adapters).keys()
    assert not _bitwise_equal(state.params, adapters)
    assert np.abs(np.asarray(state.critic_params["head"]["w"])).max() > 0
    if critic == "separate":
        trunk = state.critic_params["trunk"]
        assert _leaves(trunk).keys() == _leaves(adapters).keys() and not _bitwise_equal(trunk, adapters)
        assert not _bitwise_equal(trunk, state.params)
    else:
        assert set(state.critic_params) == {"head"}
    assert _bitwise_equal(step.frozen, base_copy)
    assert _bitwise_equal(state.ref_params, ref0) and _bitwise_equal(ref0, adapters)  # the reference: frozen
    moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
    assert metrics["kl_ref"] != 0 and np.isfinite(metrics["value_loss"])
    merged = step.policy_params(state.params)  # what actors get
    assert _leaves(merged).keys() == _leaves(base).keys()
    if dropout:  # the masks reach the loss's forward: another loss than without them
        nodrop = make_train_step(lgraphdef, dataclasses.replace(cfg, lora=dataclasses.replace(lc, dropout=0.0)))
        s0 = nodrop.init(lora.join(base, adapters))
        mbs, stats = build_microbatches(_groups(0), T, 8, 0, cfg.grpo)
        fresh = step.init(lora.join(base, adapters))
        _, m1 = step.update(fresh, mbs, stats["num_tokens"])
        _, m0 = nodrop.update(s0, mbs, stats["num_tokens"])
        assert m1["loss"] != m0["loss"] and m1["advantage_mean"] == m0["advantage_mean"]  # start-of-step: no masks


def test_peft_loads_the_adapter_directory_and_matches_cadence(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from cadence.learner.models import hf_load
    from cadence.learner.models.hf_random import write_random_checkpoint

    model = dataclasses.replace(TINY, tie_embeddings=False)
    src = tmp_path / "base"
    write_random_checkpoint(str(src), model, seed=3, tokenizer=False)
    cfg, graphdef, base = hf_load.load_checkpoint(str(src), ModelConfig())
    lc = LoraConfig(rank=4, alpha=12.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    lgraphdef, adapters = lora.init_adapters(cfg, lc, seed=0)
    key = jax.random.key(7)  # trained-looking adapters: B non-zero, so the adapters matter
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.fold_in(key, x.size), x.shape),
                            adapters)
    out = lora.write_peft_adapter(adapters, lc, str(tmp_path / "peft"), str(src))
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 12.0 and "gate_proj" in config["target_modules"]

    tokens, positions, mask = _batch(5)
    ours = np.asarray(llama.forward(lgraphdef, lora.join(base, adapters), tokens, positions, mask))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        plain = hf_base(torch.tensor(np.asarray(tokens))).logits.numpy()
    peft_model = peft.PeftModel.from_pretrained(hf_base, out).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
    assert np.abs(theirs - plain).max() > 1e-2  # the adapters were applied
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
