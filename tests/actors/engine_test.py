"""Tests of the built-in JAX engine: agreement with the learner's logprobs, EOS, greedy, top-p,
RNG reproducibility, sampling frequencies and shape buckets."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.actors.engine import EngineConfig, JaxEngine, categorical, nucleus_log_mass, sample_step, sample_token
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
NO_EOS = MODEL.vocab_size  # outside the vocabulary: never sampled
PAD = 0
PROMPTS = [[3, 4, 5], [3], [3, 9, 8, 7, 6, 5, 4, 10, 11], [3, 12], [3, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model():
    graphdef, params = llama.init_params(MODEL, 0)
    # Sharper logits than the init gives, so argmax comparisons are not decided by rounding.
    embedding = params["embed_tokens"]["embedding"]
    embedding[...] = embedding[...] * 20.0
    logprobs = jax.jit(functools.partial(llama.token_logprobs, graphdef))
    forward = jax.jit(functools.partial(llama.forward, graphdef))
    return graphdef, params, logprobs, forward


@pytest.fixture(scope="module")
def engine(model):
    return JaxEngine(MODEL, model[0], EngineConfig(max_new_tokens=6), eos_id=NO_EOS, pad_id=PAD)


def _right_padded(prompts, result):
    """[prompt | completion | pad] rows, positions arange, mask real; also the completion mask."""
    t = max(len(p) for p in prompts) + result.tokens.shape[1]
    tokens = np.full((len(prompts), t), PAD, np.int32)
    mask = np.zeros((len(prompts), t), bool)
    completion = np.zeros((len(prompts), t), bool)
    for r, (p, n) in enumerate(zip(prompts, result.lengths)):
        tokens[r, : len(p)] = p
        tokens[r, len(p) : len(p) + n] = result.tokens[r, :n]
        mask[r, : len(p) + n] = True
        completion[r, len(p) : len(p) + n] = True
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
    return tokens, positions, mask, completion


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_equal_learner_recomputation(model, engine, temperature):
    _, params, logprobs, _ = model
    result = engine.generate(params, PROMPTS, jax.random.key(1), temperature=temperature)
    assert result.tokens.shape == result.logprobs.shape == (len(PROMPTS), 6)
    tokens, positions, mask, completion = _right_padded(PROMPTS, result)
    learner = np.asarray(logprobs(params, tokens, positions, mask, temperature=temperature))
    engine_lp = np.zeros_like(learner)
    for r, p in enumerate(PROMPTS):
        engine_lp[r, len(p) : len(p) + result.lengths[r]] = result.logprobs[r, : result.lengths[r]]
    assert np.abs(np.where(completion, engine_lp - learner, 0.0)).max() <= 1e-4
    assert np.all(result.logprobs < 0)  # genuinely sampled tokens, no zeros hidden in there


def test_greedy_is_deterministic_and_equals_teacher_forced_argmax(model, engine):
    _, params, logprobs, forward = model
    a = engine.generate(params, PROMPTS, jax.random.key(0), greedy=True)
    b = engine.generate(params, PROMPTS, jax.random.key(99), greedy=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    tokens, positions, mask, completion = _right_padded(PROMPTS, a)
    logits = np.asarray(forward(params, tokens, positions, mask))
    for r, p in enumerate(PROMPTS):
        # The logits predicting completion token i sit at column len(p) - 1 + i (causal, so this is
        # what step-by-step argmax decoding sees).
        np.testing.assert_array_equal(a.tokens[r], logits[r, len(p) - 1 : len(p) + 5].argmax(-1))
    # Greedy behavior logprobs are the T = 1 distribution's.
    learner = np.asarray(logprobs(params, tokens, positions, mask))
    np.testing.assert_allclose(np.where(completion, learner, 0).sum(1), a.logprobs.sum(1), atol=1e-4)


def test_tiny_top_p_equals_greedy(model, engine):
    params = model[1]
    greedy = engine.generate(params, PROMPTS, jax.random.key(0), greedy=True)
    nucleus = engine.generate(params, PROMPTS, jax.random.key(5), top_p=1e-6)
    np.testing.assert_array_equal(nucleus.tokens, greedy.tokens)


def test_same_rng_same_samples_and_other_rng_differs(model, engine):
    params = model[1]
    a = engine.generate(params, PROMPTS, jax.random.key(3))
    b = engine.generate(params, PROMPTS, jax.random.key(3))
    c = engine.generate(params, PROMPTS, jax.random.key(4))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.fixture(scope="module")
def eos_case(model, engine):
    """A free-running greedy reference and an engine whose EOS is row 2's first greedy token."""
    graphdef, params, _, _ = model
    ref = engine.generate(params, PROMPTS, jax.random.key(0), greedy=True)
    eos = int(ref.tokens[2, 0])
    return ref, eos, JaxEngine(MODEL, graphdef, EngineConfig(max_new_tokens=6), eos_id=eos, pad_id=PAD)


def test_eos_stops_a_row(model, eos_case):
    ref, eos, stopping = eos_case
    out = stopping.generate(model[1], PROMPTS, jax.random.key(0), greedy=True)
    for r in range(len(PROMPTS)):
        hits = np.flatnonzero(ref.tokens[r] == eos)
        n = hits[0] + 1 if hits.size else 6
        assert out.lengths[r] == n
        np.testing.assert_array_equal(out.tokens[r, :n], ref.tokens[r, :n])
        np.testing.assert_allclose(out.logprobs[r, :n], ref.logprobs[r, :n], atol=1e-6)
        assert np.all(out.tokens[r, n:] == PAD) and np.all(out.logprobs[r, n:] == 0)
    assert out.lengths[2] == 1
    assert out.num_tokens == int(out.lengths.sum())


def test_all_rows_hitting_eos_exits_early_with_pads(model, eos_case):
    _, eos, stopping = eos_case
    out = stopping.generate(model[1], [PROMPTS[2]] * 5, jax.random.key(0), greedy=True)
    np.testing.assert_array_equal(out.lengths, [1] * 5)
    np.testing.assert_array_equal(out.tokens[:, 0], eos)
    np.testing.assert_array_equal(out.tokens[:, 1:], PAD)
    assert stopping.num_compilations == 1  # same (8, 16) bucket as the previous call


def test_batch_sizes_in_one_bucket_compile_once(model):
    graphdef, params, _, _ = model
    eng = JaxEngine(MODEL, graphdef, EngineConfig(max_new_tokens=4), eos_id=NO_EOS, pad_id=PAD)
    for n in (3, 5, 7):
        out = eng.generate(params, PROMPTS[:1] * n, jax.random.key(n), temperature=0.5 + n / 10)
        assert out.tokens.shape == (n, 4)
    assert eng.num_compilations == 1
    eng.generate(params, PROMPTS[:1] * 9, jax.random.key(0))  # next batch bucket: 16
    assert eng.num_compilations == 2
    assert eng.compiled_shapes == {(8, 8), (16, 8)}


def test_rows_are_independent_of_batch_and_chunking(model, engine):
    graphdef, params, _, _ = model
    cfg = EngineConfig(max_new_tokens=6, batch_buckets=(2, 4), prompt_bucket=16)
    small = JaxEngine(MODEL, graphdef, cfg, eos_id=NO_EOS, pad_id=PAD)
    out = small.generate(params, PROMPTS, jax.random.key(0), greedy=True)  # 5 rows: chunks of 4 + 1
    assert small.compiled_shapes == {(4, 16), (2, 16)}
    whole = engine.generate(params, PROMPTS, jax.random.key(0), greedy=True)  # one (8, 16) block
    np.testing.assert_array_equal(out.tokens, whole.tokens)
    np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-5)


def _frequency_bound(p, n):
    return 5 * np.sqrt(p * (1 - p) / n) + 1e-3


@pytest.mark.parametrize(
    "temperature, top_p",
    [(1.0, 1.0), (0.5, 1.0), (1.0, 0.7)],
)
def test_sampling_frequencies_match_the_distribution(temperature, top_p):
    p = np.array([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, 4))
    sample = jax.jit(sample_token)
    tokens, lp = sample(logits, jax.random.key(0), jnp.float32(temperature), jnp.float32(top_p), jnp.bool_(False))
    scaled = p ** (1 / temperature) / np.sum(p ** (1 / temperature))
    # top_p = 0.7 keeps tokens 0 and 1 (mass before token 2 is 0.8 >= 0.7).
    target = scaled if top_p == 1.0 else np.array([0.5, 0.3, 0, 0]) / 0.8
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    assert np.all(np.abs(freq - target) <= _frequency_bound(target, n))
    # Behavior logprobs are from the scaled distribution before truncation.
    np.testing.assert_allclose(np.asarray(lp), np.log(scaled)[np.asarray(tokens)], atol=1e-5)


def test_inverse_cdf_categorical_matches_the_distribution_across_blocks():
    # A vocabulary of 700: two full 256-token blocks and a partial one, with mass spread over
    # all three and zero-probability tokens (-inf) at block edges that must never be drawn.
    v, n = 700, 40_000
    rng = np.random.default_rng(0)
    logits = rng.normal(size=v) * 2.0
    banned = np.array([0, 255, 256, 511, 512, 699])
    logits[banned] = -np.inf
    p = np.exp(logits - logits[np.isfinite(logits)].max())
    p /= p.sum()
    logp = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, v))
    tokens = np.asarray(jax.jit(categorical)(jax.random.key(0), logp))
    assert tokens.min() >= 0 and tokens.max() < v
    assert not np.isin(tokens, banned).any()
    freq = np.bincount(tokens, minlength=v) / n
    assert np.all(np.abs(freq - p) <= _frequency_bound(p, n))
    # Block masses as a whole (where a bias in the first stage would show).
    for lo in (0, 256, 512):
        mass, got = p[lo : lo + 256].sum(), freq[lo : lo + 256].sum()
        assert abs(got - mass) <= _frequency_bound(mass, n)


def test_inverse_cdf_categorical_takes_the_only_token_and_unnormalised_rows():
    # One allowed token per row, anywhere (first, last of a block, last of the vocabulary).
    v = 600
    where = np.array([0, 255, 256, 599])
    logp = np.full((4, v), -np.inf, np.float32)
    logp[np.arange(4), where] = 0.0
    np.testing.assert_array_equal(np.asarray(categorical(jax.random.key(1), jnp.asarray(logp))), where)
    # Rows need not be normalised (top-p passes the truncated, unrenormalised distribution).
    p = np.array([0.3, 0.0, 0.1, 0.0], np.float32)  # mass 0.4: tokens 0 and 2 at 3:1
    logp = jnp.broadcast_to(jnp.log(jnp.asarray(p)), (20_000, 4))
    freq = np.bincount(np.asarray(categorical(jax.random.key(2), logp)), minlength=4) / 20_000
    target = p / p.sum()
    assert np.all(np.abs(freq - target) <= _frequency_bound(target, 20_000))


def test_greedy_sample_token_takes_argmax_and_t1_logprob():
    logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tok, lp = sample_token(logits, jax.random.key(0), jnp.float32(0.3), jnp.float32(1.0), jnp.bool_(True))
    np.testing.assert_array_equal(np.asarray(tok), [1, 0])
    want = np.asarray(jax.nn.log_softmax(logits))[[0, 1], [1, 0]]
    np.testing.assert_allclose(np.asarray(lp), want, atol=1e-6)


def test_bad_inputs_are_rejected(model, engine):
    params = model[1]
    with pytest.raises(ValueError, match="^prompts:"):
        engine.generate(params, [[3], []], jax.random.key(0))
    with pytest.raises(ValueError, match="^prompts:.*max_seq_len"):
        engine.generate(params, [[3] * (MODEL.max_seq_len - 5)], jax.random.key(0))
    with pytest.raises(ValueError, match="^temperature:"):
        engine.generate(params, [[3]], jax.random.key(0), temperature=0.0)
    out = engine.generate(params, [], jax.random.key(0))
    assert out.tokens.shape == (0, 6) and out.num_tokens == 0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"batch_buckets": ()}, "batch_buckets"),
        ({"batch_buckets": (16, 8)}, "batch_buckets"),
        ({"prompt_bucket": 0}, "prompt_bucket"),
        ({"kv_dtype": "int8"}, "kv_dtype"),
    ],
)
def test_engine_config_validate_names_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        dataclasses.replace(EngineConfig(), **change).validate()
    EngineConfig().validate()


# ---- sampling support: full-vocabulary logprobs, and the nucleus mass reported beside them ----


@pytest.mark.parametrize("temperature, top_p", [(1.0, 0.7), (0.7, 0.9), (1.0, 1.0)])
def test_kept_logmass_gives_the_true_sampling_probability_and_the_truncation_kl(temperature, top_p):
    from cadence.actors.engine import nucleus_log_mass
    p = np.array([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, 4))
    tokens, lp = jax.jit(sample_token)(logits, jax.random.key(1), jnp.float32(temperature),
                                       jnp.float32(top_p), jnp.bool_(False))
    km = np.asarray(nucleus_log_mass(logits, jnp.float32(temperature), jnp.float32(top_p), jnp.bool_(False)))
    scaled = p ** (1 / temperature) / np.sum(p ** (1 / temperature))
    keep = np.cumsum(scaled) - scaled < top_p  # sorted already (p is descending)
    z = scaled[keep].sum()
    np.testing.assert_allclose(km, np.log(z), atol=1e-6)
    trunc = np.where(keep, scaled / z, 0.0)
    kl = np.sum(trunc[keep] * np.log(trunc[keep] / scaled[keep]))  # KL(truncated || full)
    np.testing.assert_allclose(-km[0], kl, atol=1e-6)
    # exp(logprob - kept_logmass) is the probability the token was actually drawn with.
    true_p = np.exp(np.asarray(lp) - km)
    tok = np.asarray(tokens)
    np.testing.assert_allclose(true_p, trunc[tok], rtol=1e-5)
    freq = np.bincount(tok, minlength=4) / n
    assert np.all(np.abs(freq - trunc) <= _frequency_bound(trunc, n))
    greedy_km = nucleus_log_mass(logits[:2], jnp.float32(temperature), jnp.float32(top_p), jnp.bool_(True))
    assert np.all(np.asarray(greedy_km) == 0)


def test_generate_reports_kept_logmass_on_the_same_rows_as_logprobs(model, engine):
    params = model[1]
    full = engine.generate(params, PROMPTS, jax.random.key(3))
    assert full.kept_logmass.shape == full.logprobs.shape and np.all(full.kept_logmass == 0)
    nucleus = engine.generate(params, PROMPTS, jax.random.key(3), top_p=0.8)
    km = nucleus.kept_logmass
    live = np.arange(km.shape[1])[None, :] < nucleus.lengths[:, None]
    assert np.all(km <= 0) and np.all(km[~live] == 0)
    assert np.all(km[live] >= np.log(0.8) - 1e-5)  # the nucleus keeps at least top_p of the mass
    # The behavior logprobs stay on the full support: no sampled token is more likely than p_full / Z.
    assert np.all(nucleus.logprobs[live] - km[live] <= 1e-6)


@pytest.mark.parametrize("top_p, greedy", [(0.8, False), (1.0, False), (0.8, True)])
def test_sample_step_is_sample_token_plus_nucleus_log_mass(top_p, greedy):
    # The engine's loop uses sample_step (one sort shared by the draw and the kept mass).
    logits = jax.random.normal(jax.random.key(0), (6, 300)) * 3.0
    args = (logits, jax.random.key(7), jnp.float32(0.8), jnp.float32(top_p), jnp.bool_(greedy))
    tok, lp, km = jax.jit(sample_step)(*args)
    want_tok, want_lp = jax.jit(sample_token)(*args)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-6)
    want_km = nucleus_log_mass(logits, jnp.float32(0.8), jnp.float32(top_p), jnp.bool_(greedy))
    np.testing.assert_allclose(np.asarray(km), np.asarray(want_km), atol=1e-6)
    assert np.all(np.asarray(km) < 0) == (top_p < 1 and not greedy)


# ---- the KV cache's dtype (engine.kv_dtype) ----


def test_a_bfloat16_cache_holds_half_the_bytes_and_stays_near_the_learner(model, engine):
    import ml_dtypes

    graphdef, params, logprobs, _ = model
    cache = llama.init_cache(MODEL, 2, 8, "bfloat16")
    assert all(k.dtype == jnp.bfloat16 for k in cache.k + cache.v)
    tokens = jnp.asarray([[3, 4, 5], [3, 6, 7]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    _, filled = llama.prefill(graphdef, params, cache, tokens, positions, jnp.ones((2, 3), bool))
    _, whole = llama.prefill(graphdef, params, llama.init_cache(MODEL, 2, 8), tokens, positions, jnp.ones((2, 3), bool))
    assert all(a.dtype == jnp.bfloat16 for a in filled.k + filled.v)
    # layer 0's keys and values come before any attention: exactly the float32 ones, rounded
    for a, b in ((filled.k[0], whole.k[0]), (filled.v[0], whole.v[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(ml_dtypes.bfloat16))
    for a, b in zip(filled.k[1:] + filled.v[1:], whole.k[1:] + whole.v[1:]):  # later layers: near them
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=3e-2, atol=3e-2)

    default = engine.generate(params, PROMPTS, jax.random.key(1), greedy=True)
    f32 = JaxEngine(MODEL, graphdef, EngineConfig(max_new_tokens=6, kv_dtype="float32"), eos_id=NO_EOS, pad_id=PAD)
    same = f32.generate(params, PROMPTS, jax.random.key(1), greedy=True)
    np.testing.assert_array_equal(same.tokens, default.tokens)  # float32 is the compute dtype: no change
    np.testing.assert_array_equal(same.logprobs, default.logprobs)
    bf16 = JaxEngine(MODEL, graphdef, EngineConfig(max_new_tokens=6, kv_dtype="bfloat16"), eos_id=NO_EOS, pad_id=PAD)
    result = bf16.generate(params, PROMPTS, jax.random.key(1))
    tokens, positions, mask, completion = _right_padded(PROMPTS, result)
    learner = np.asarray(logprobs(params, tokens, positions, mask))
    engine_lp = np.zeros_like(learner)
    for r, p in enumerate(PROMPTS):
        engine_lp[r, len(p) : len(p) + result.lengths[r]] = result.logprobs[r, : result.lengths[r]]
    diff = np.abs(np.where(completion, engine_lp - learner, 0.0)).max()
    assert 0 < diff <= 5e-2, diff  # rounding keys, values and attention weights moves them, a little


# ---- a bfloat16 model: float32 logits ----


@pytest.mark.parametrize("tied", [True, False])
def test_a_bfloat16_models_logits_are_float32_results(tied):
    """A bf16 model's output head returns float32: logits rounded to bf16 (8 bits of mantissa)
    would move log-probs of ~-10 by ~0.05."""
    cfg = dataclasses.replace(MODEL, param_dtype="bfloat16", compute_dtype="bfloat16", tie_embeddings=tied)
    graphdef, params = llama.init_params(cfg, 0)
    hidden = jax.random.normal(jax.random.key(0), (2, 3, cfg.d_model), jnp.bfloat16)
    logits = np.asarray(llama.head_logits(graphdef, params, hidden))
    assert logits.dtype == np.float32
    head = (params["embed_tokens"]["embedding"][...].T if tied else params["lm_head"]["kernel"][...])
    want = np.asarray(hidden, np.float32) @ np.asarray(head, np.float32)  # NumPy, from the same bf16 inputs
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(lambda p, h: llama.head_logits(graphdef, p, h))(params, hidden))
    assert "preferred_element_type=float32" in jaxpr
