"""Tests of the Llama decoder: causality, padding layouts, KV cache, GQA, and NumPy references."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig

SMALL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)


@functools.lru_cache(maxsize=None)
def _model(cfg: ModelConfig, seed: int = 0):
    graphdef, params = llama.init_params(cfg, seed)
    return graphdef, params, jax.jit(functools.partial(llama.forward, graphdef))


def _arange_positions(b, t):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _random_tokens(seed, shape, vocab):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


# ---------------------------------------------------------------- NumPy reference of the model


def _np_rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _np_rope(x, pos, theta):
    """x [T, H, Dh], pos [T]: rotate-half RoPE written out in NumPy."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
    ang = pos[:, None] * inv[None]  # [T, Dh/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_forward(cfg: ModelConfig, params, tokens):
    """One unpadded sequence [T] -> logits [T, V], straight from the HF Llama equations."""
    p = jax.tree.map(np.asarray, params)
    t = len(tokens)
    h, kv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = np.arange(t, dtype=np.float64)
    x = p["embed_tokens"]["embedding"][tokens].astype(np.float64)
    for i in range(cfg.n_layers):
        lp = p["layers"][i]
        a = lp["self_attn"]
        y = _np_rms_norm(x, lp["input_layernorm"]["weight"], cfg.norm_eps)
        q = _np_rope((y @ a["q_proj"]["kernel"]).reshape(t, h, dh), pos, cfg.rope_theta)
        k = _np_rope((y @ a["k_proj"]["kernel"]).reshape(t, kv, dh), pos, cfg.rope_theta)
        v = (y @ a["v_proj"]["kernel"]).reshape(t, kv, dh)
        k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # HF repeat_kv
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(dh)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", w, v).reshape(t, h * dh) @ a["o_proj"]["kernel"]
        m = lp["mlp"]
        y = _np_rms_norm(x, lp["post_attention_layernorm"]["weight"], cfg.norm_eps)
        g = y @ m["gate_proj"]["kernel"]
        x = x + ((g / (1 + np.exp(-g))) * (y @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
    x = _np_rms_norm(x, p["norm"]["weight"], cfg.norm_eps)
    head = p["embed_tokens"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return x @ head


@pytest.mark.parametrize("n_kv_heads, tie", [(1, True), (2, False), (4, True)])
def test_forward_matches_numpy_reference_for_gqa_and_untied(n_kv_heads, tie):
    cfg = dataclasses.replace(SMALL, n_kv_heads=n_kv_heads, tie_embeddings=tie)
    _, params, fwd = _model(cfg)
    tokens = _random_tokens(1, (1, 9), cfg.vocab_size)
    got = np.asarray(fwd(params, tokens, _arange_positions(1, 9), jnp.ones((1, 9), bool)))[0]
    np.testing.assert_allclose(got, _np_forward(cfg, params, tokens[0]), atol=2e-5, rtol=1e-4)


def test_untied_has_its_own_head():
    cfg = dataclasses.replace(SMALL, tie_embeddings=False)
    _, params, _ = _model(cfg)
    _, tied_params, _ = _model(SMALL)
    assert params["lm_head"]["kernel"].shape == (cfg.d_model, cfg.vocab_size)
    assert "lm_head" not in tied_params
    assert llama.count_params(params) == llama.count_params(tied_params) + cfg.d_model * cfg.vocab_size


def test_kv_head_shapes_follow_gqa():
    for kv in (1, 2, 4):
        _, params, _ = _model(dataclasses.replace(SMALL, n_kv_heads=kv))
        attn = params["layers"][0]["self_attn"]
        assert attn["k_proj"]["kernel"].shape == (SMALL.d_model, kv * SMALL.head_dim)
        assert attn["q_proj"]["kernel"].shape == (SMALL.d_model, SMALL.d_model)


def test_default_parameter_count():
    cfg = ModelConfig()
    abstract = nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0)))  # shapes only: no init cost
    n = llama.count_params(nnx.state(abstract))
    d, kv_d = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_layer = 2 * d * d + 2 * d * kv_d + 3 * d * cfg.d_ff + 2 * d
    assert n == cfg.vocab_size * d + cfg.n_layers * per_layer + d
    assert 120_000 <= n <= 150_000


# ---------------------------------------------------------------- hand-made building blocks


def test_rms_norm_hand_made_case():
    x = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, -2.0, 0.0, 2.0]], np.float32)
    w = np.array([1.0, 0.5, 2.0, 1.0], np.float32)
    # rms of row 0 = sqrt(30/4), of row 1 = sqrt(2).
    expected = w * x / np.sqrt(np.array([[7.5], [2.0]]) + 1e-5)
    got = llama.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)


def test_rope_hand_made_case():
    # head_dim 4, theta 100: frequencies [1, 1/10]; position 2 rotates pair (x0, x2) by 2 rad
    # and pair (x1, x3) by 0.2 rad (rotate-half pairs dimension i with i + Dh/2).
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    a, b = 2.0, 0.2
    expected = np.array(
        [
            1 * np.cos(a) - 3 * np.sin(a),
            2 * np.cos(b) - 4 * np.sin(b),
            3 * np.cos(a) + 1 * np.sin(a),
            4 * np.cos(b) + 2 * np.sin(b),
        ]
    )
    cos, sin = llama.rope_cos_sin(jnp.array([[2]]), 4, 100.0)
    got = llama.apply_rope(jnp.asarray(x).reshape(1, 1, 1, 4), cos, sin)
    np.testing.assert_allclose(np.asarray(got).ravel(), expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got).ravel(), _np_rope(x.reshape(1, 1, 4), np.array([2.0]), 100.0).ravel(), atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))

    def score(m, n):
        cq, sq = llama.rope_cos_sin(jnp.array([[m]]), 8, 10000.0)
        ck, sk = llama.rope_cos_sin(jnp.array([[n]]), 8, 10000.0)
        return float(jnp.sum(llama.apply_rope(q, cq, sq) * llama.apply_rope(k, ck, sk)))

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)


# ---------------------------------------------------------------- causality and padding


def test_causality():
    _, params, fwd = _model(SMALL)
    tokens = _random_tokens(2, (2, 12), SMALL.vocab_size)
    changed = tokens.copy()
    changed[:, 6] = (changed[:, 6] + 1) % SMALL.vocab_size
    pos, mask = _arange_positions(2, 12), jnp.ones((2, 12), bool)
    a, b = np.asarray(fwd(params, tokens, pos, mask)), np.asarray(fwd(params, changed, pos, mask))
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert np.abs(a[:, 6:] - b[:, 6:]).min(axis=-1).max() > 0  # the change is seen downstream


def test_right_padding_keeps_real_logits():
    _, params, fwd = _model(SMALL)
    real = _random_tokens(3, (1, 7), SMALL.vocab_size)
    padded = np.concatenate([real, _random_tokens(4, (1, 5), SMALL.vocab_size)], axis=1)  # junk pads
    mask = np.arange(12)[None] < 7
    want = fwd(params, real, _arange_positions(1, 7), jnp.ones((1, 7), bool))
    got = fwd(params, padded, _arange_positions(1, 12), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[:, :7], np.asarray(want), atol=1e-5)


def test_left_padding_with_cumsum_positions_keeps_last_logits():
    _, params, fwd = _model(SMALL)
    real = _random_tokens(5, (1, 7), SMALL.vocab_size)
    padded = np.concatenate([_random_tokens(6, (1, 5), SMALL.vocab_size), real], axis=1)
    mask = np.arange(12)[None] >= 5
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    want = fwd(params, real, _arange_positions(1, 7), jnp.ones((1, 7), bool))
    got = fwd(params, padded, positions, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[:, 5:], np.asarray(want), atol=1e-5)
    assert np.all(np.isfinite(np.asarray(got)))  # pad columns see no real key but stay finite


# ---------------------------------------------------------------- KV cache


def test_token_by_token_decode_matches_forward():
    graphdef, params, fwd = _model(SMALL)
    t = 10
    tokens = _random_tokens(7, (3, t), SMALL.vocab_size)
    pos = _arange_positions(3, t)
    want = np.asarray(fwd(params, tokens, pos, jnp.ones((3, t), bool)))
    step = jax.jit(functools.partial(llama.decode_step, graphdef))
    cache = llama.init_cache(SMALL, 3, t)
    got = []
    for i in range(t):
        logits, cache = step(params, cache, tokens[:, i], pos[:, i])
        got.append(np.asarray(logits))
    assert int(cache.length) == t
    assert np.abs(np.stack(got, axis=1) - want).max() <= 1e-5


def test_left_padded_prefill_then_decode_matches_unpadded_forward():
    graphdef, params, fwd = _model(SMALL)
    lens, p, extra = [2, 5, 8], 8, 3
    rows = [_random_tokens(10 + i, (n + extra,), SMALL.vocab_size) for i, n in enumerate(lens)]
    block = np.zeros((3, p), np.int32)
    mask = np.zeros((3, p), bool)
    for r, n in enumerate(lens):
        block[r, p - n :], mask[r, p - n :] = rows[r][:n], True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    cache = llama.init_cache(SMALL, 3, p + extra)
    logits, cache = jax.jit(functools.partial(llama.prefill, graphdef))(params, cache, block, positions, mask)
    got = [np.asarray(logits)]
    step = jax.jit(functools.partial(llama.decode_step, graphdef))
    for i in range(extra):
        feed = np.array([row[n + i] for row, n in zip(rows, lens)], np.int32)
        logits, cache = step(params, cache, feed, np.array(lens, np.int32) + i)
        got.append(np.asarray(logits))
    got = np.stack(got, axis=1)  # [3, extra + 1, V]
    # Reference: the learner's right-padded layout (its padding invariance is tested above).
    t = max(lens) + extra
    right = np.zeros((3, t), np.int32)
    for r, row in enumerate(rows):
        right[r, : len(row)] = row
    full = np.asarray(fwd(params, right, _arange_positions(3, t), np.arange(t)[None] < np.array(lens)[:, None] + extra))
    for r, n in enumerate(lens):
        np.testing.assert_allclose(got[r], full[r, n - 1 : n + extra], atol=1e-5)


# ---------------------------------------------------------------- logprobs, dtypes, config


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_numpy_log_softmax(temperature):
    graphdef, params, fwd = _model(SMALL)
    tokens = _random_tokens(8, (2, 9), SMALL.vocab_size)
    mask = np.arange(9)[None] < np.array([[9], [6]])
    pos = _arange_positions(2, 9)
    logprobs = jax.jit(functools.partial(llama.token_logprobs, graphdef))
    got = np.asarray(logprobs(params, tokens, pos, mask, temperature=temperature))
    z = np.asarray(fwd(params, tokens, pos, mask), np.float64) / temperature
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.zeros((2, 9))
    for b in range(2):
        for t in range(1, 9):
            want[b, t] = logp[b, t - 1, tokens[b, t]] if mask[b, t] else 0.0
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_bfloat16_compute_is_close_to_float32():
    cfg16 = dataclasses.replace(SMALL, compute_dtype="bfloat16", param_dtype="bfloat16")
    _, p32, fwd32 = _model(SMALL)
    abstract16 = nnx.state(nnx.eval_shape(lambda: llama.Llama(cfg16, nnx.Rngs(0))))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract16))
    graphdef16 = nnx.graphdef(nnx.eval_shape(lambda: llama.Llama(cfg16, nnx.Rngs(0))))
    fwd16 = jax.jit(functools.partial(llama.forward, graphdef16))
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    tokens = _random_tokens(9, (1, 8), SMALL.vocab_size)
    pos, mask = _arange_positions(1, 8), jnp.ones((1, 8), bool)
    out16 = fwd16(p16, tokens, pos, mask)
    assert out16.dtype == jnp.float32
    # The fp32 weights rounded to bf16: outputs agree up to bf16 noise.
    np.testing.assert_allclose(np.asarray(out16), np.asarray(fwd32(p32, tokens, pos, mask)), atol=0.05)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"n_heads": 3}, "n_heads"),
        ({"d_model": 0}, "d_model"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"compute_dtype": "float16"}, "compute_dtype"),
    ],
)
def test_config_validate_names_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        dataclasses.replace(ModelConfig(), **change).validate()
    ModelConfig().validate()
