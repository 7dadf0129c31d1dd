"""Llama-style decoder (Flax NNX) and its pure, jittable functional API.

Submodule names follow Hugging Face's LlamaForCausalLM (minus its leading ``model.``) so a checkpoint
loader maps weights one to one: ``embed_tokens``, ``layers[i].self_attn.{q,k,v,o}_proj``,
``layers[i].mlp.{gate,up,down}_proj``, ``layers[i].{input,post_attention}_layernorm``, ``norm`` and
``lm_head`` (only when embeddings are untied), plus Qwen3's ``self_attn.{q,k}_norm``. Linear kernels
are stored ``[in, out]`` (HF stores ``[out, in]``: transpose on load). The config switches cover the
Llama (incl. Llama 3 RoPE scaling), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) families.

Jitted code works on the params pytree, never on a live module:

    graphdef, params = init_params(cfg, seed=0)
    fwd = jax.jit(functools.partial(forward, graphdef))
    logits = fwd(params, tokens, positions, mask)            # [B, T, V] float32

Two layouts meet here. The learner feeds RIGHT-padded rows with ``positions = arange(T)``; the
engine LEFT-pads prompts with ``positions = clip(cumsum(mask) - 1, 0)``. Either way a real token
gets the same position, and attention is causal over columns and ignores keys whose mask is False,
so both layouts give the same logits for real tokens.
"""

import contextvars
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cadence.learner import segments
from cadence.learner.models.config import ModelConfig
from cadence.learner.sharding import constrain

# Finite rather than -inf: a query that sees no real key (a padding column) then gets a finite,
# unused output instead of NaNs that would leak into gradients.
_MASKED_SCORE = -1e30


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, for lock-step decoding of a batch.

    Slots are columns: every row writes its n-th token into slot n, so left-padded rows stay aligned.
    Heads come first and values are stored transposed, so that both products of a decode step's
    attention (q.K^T over [L, head_dim] keys, V^T.p over [head_dim, L] values) are plain batched
    matmuls contracting each operand's minor axis. With [B, L, heads, head_dim] XLA:CPU fell
    back to a slow dot: 175 vs 138 CPU-ms per SmolLM2 step at batch 16, L = 320.
    """

    k: tuple[jax.Array, ...]  # per layer [B, n_kv_heads, L, head_dim]
    v: tuple[jax.Array, ...]  # per layer [B, n_kv_heads, head_dim, L] (transposed, see above)
    mask: jax.Array  # [B, L] bool: slot holds a real token
    length: jax.Array  # [] int32: number of slots written (the next write goes here)


def _dtype(name: str) -> jnp.dtype:
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


# ----------------------------------------------------------------------------------------------
# Building blocks (pure functions first: they are what the NumPy reference tests check).


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as in HF Llama: normalise in float32, cast back, then scale by ``weight``."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Per-pair RoPE inverse frequencies [head_dim / 2] float32, with Llama 3 scaling if configured.

    Llama 3 scaling (HF ``_compute_llama3_parameters``): wavelengths longer than
    original_len / low_freq_factor are slowed down by ``factor``, those shorter than
    original_len / high_freq_factor are kept, and the band between interpolates smoothly.
    """
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))  # [Dh/2]
    if cfg.rope_scaling_type == "none":
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                 inv_freq: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Rotary tables for the rotate-half convention (HF Llama).

    Args:
      positions: [B, T] int positions.
      head_dim: even head width.
      theta: base frequency.
      inv_freq: [head_dim / 2] precomputed (e.g. scaled) inverse frequencies; overrides theta.

    Returns:
      (cos, sin), each [B, T, head_dim] float32; frequencies repeat across the two halves.
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [Dh/2]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, Dh]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates heads ``x`` [B, T, H, Dh] by the tables [B, T, Dh]: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def _grouped_attention(q, k, v, allowed, kv: int, k_spec: str, v_spec: str, wide: bool = False) -> jax.Array:
    """Grouped-query attention of q [B, T, H, Dh] over keys and values laid out as the einsum
    specs say (k_spec, v_spec: their subscripts with b, s, k (KV head), d); [B, T, H * Dh].
    wide: the two products return float32 (scores and outputs not rounded to k's dtype)."""
    b, t, h, dh = q.shape
    out_dtype = q.dtype
    wide = {"preferred_element_type": jnp.float32} if wide else {}
    q = q.reshape(b, t, kv, h // kv, dh).astype(k.dtype)  # [B, T, KV, G, Dh]
    scores = jnp.einsum(f"btkgd,{k_spec}->bkgts", q, k, **wide).astype(jnp.float32) / jnp.sqrt(jnp.float32(dh))
    scores = jnp.where(allowed[:, None, None], scores, _MASKED_SCORE)  # [B, KV, G, T, S]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"bkgts,{v_spec}->btkgd", probs, v, **wide).astype(out_dtype)  # [B, T, KV, G, Dh]
    return out.reshape(b, t, h * dh)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: [B, T, H, Dh] queries.
      k, v: [B, S, KV, Dh] keys/values; each KV head serves H / KV query heads.
      allowed: [B, T, S] bool, which keys each query may see.

    Returns:
      [B, T, H * Dh].
    """
    return _grouped_attention(q, k, v, allowed, k.shape[2], "bskd", "bskd", wide=k.dtype != q.dtype)


def _attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """_attend over a KV cache: k [B, KV, S, Dh] and v [B, KV, Dh, S] (see KVCache).

    A cache narrower than float32 (engine.kv_dtype, or a bf16 compute dtype) is multiplied as
    stored, never converted whole each step, with float32 accumulation and results: scores rounded
    to bf16 would move the sampler's probabilities by up to ~0.1 nats."""
    return _grouped_attention(q, k, v, allowed, k.shape[1], "bksd", "bkds", wide=k.dtype != jnp.float32)


# ----------------------------------------------------------------------------------------------
# Modules.


class RMSNorm(nnx.Module):
    """RMSNorm with an HF-named ``weight`` parameter."""

    def __init__(self, dim: int, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(_ONES_INIT(None, (dim,), param_dtype), out_sharding=("norm",),
                                eager_sharding=False)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...].astype(x.dtype), self.eps)


# When set, initializers return shapes only: `abstract_params` builds a model without tracing
# (nnx.eval_shape costs ~0.5 s for a 100M model, a checkpoint load's largest fixed cost).
_SHAPES_ONLY = contextvars.ContextVar("shapes_only", default=False)


def _init(initializer):
    def init(key, shape, dtype=jnp.float32):
        if _SHAPES_ONLY.get():
            return jax.ShapeDtypeStruct(tuple(shape), dtype)
        return initializer(key, shape, dtype)

    return init


_KERNEL_INIT = _init(nnx.initializers.lecun_normal())  # nnx.Linear's defaults
_BIAS_INIT = _init(nnx.initializers.zeros_init())
_EMBED_INIT = _init(nnx.initializers.normal(stddev=0.02))  # HF initializer_range
_ONES_INIT = _init(nnx.initializers.ones_init())


def _named(initializer, *names: str):
    """The initializer, with the logical names of the parameter's axes as sharding metadata
    (learner/sharding.py maps them to mesh axes; nothing is placed here)."""
    return nnx.with_partitioning(initializer, names, eager_sharding=False)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, rngs: nnx.Rngs, names: tuple[str, str],
            use_bias: bool = False, lora=None, target: str = "", wide: bool = False) -> nnx.Linear:
    """A linear layer whose [in, out] kernel axes have the logical names `names`; with low-rank
    adapters (lora: a learner.config.LoraConfig whose targets name `target`) a LoRA one; wide:
    float32 results whatever the compute dtype (the output head)."""
    kwargs = dict(
        **({"preferred_element_type": jnp.float32} if wide else {}),
        use_bias=use_bias,
        kernel_init=_named(_KERNEL_INIT, *names),
        bias_init=_named(_BIAS_INIT, names[1]),
        dtype=_dtype(cfg.compute_dtype),
        param_dtype=_dtype(cfg.param_dtype),
        rngs=rngs,
    )
    if lora is not None and lora.rank > 0 and target in lora.targets:
        from cadence.learner.models.lora import ScaledLoRALinear

        return ScaledLoRALinear(d_in, d_out, lora, names, _init, **kwargs)
    return nnx.Linear(d_in, d_out, **kwargs)


def attention_allowed(mask: jax.Array) -> jax.Array:
    """[B, T] -> [B, T, T] bool: which keys (last axis) each query may attend to, without a cache.

    A bool mask marks the real tokens of a row holding one sequence: causal, keys where mask is
    True. An integer mask holds segment ids of a packed row (learner/segments.py: 1..k per
    sequence, 0 = padding, plus the shared prompt prefix a sequence may also see): causal AND the
    key is not padding AND the key is in the query's own sequence or its prefix, so no sequence
    sees another's tokens (positions restarting per segment alone would not stop that). The bool
    form is the one-segment case.
    """
    t = mask.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None]  # [1, T, T]
    if mask.dtype == jnp.bool_:
        return causal & mask[:, None, :]
    seq, prefix = segments.sequence_ids(mask), segments.prefix_ids(mask)
    key = seq[:, None, :]
    visible = (seq[:, :, None] == key) | (prefix[:, :, None] == key)  # [B, T, T]
    return causal & visible & (key > 0)


class Attention(nnx.Module):
    """Causal GQA self-attention with RoPE and an optional KV cache."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora=None):
        dh = cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, dh
        self.q_proj = _linear(cfg, cfg.d_model, cfg.n_heads * dh, rngs, ("embed", "heads"), cfg.qkv_bias, lora, "q")
        self.k_proj = _linear(cfg, cfg.d_model, cfg.n_kv_heads * dh, rngs, ("embed", "kv"), cfg.qkv_bias, lora, "k")
        self.v_proj = _linear(cfg, cfg.d_model, cfg.n_kv_heads * dh, rngs, ("embed", "kv"), cfg.qkv_bias, lora, "v")
        self.o_proj = _linear(cfg, cfg.n_heads * dh, cfg.d_model, rngs, ("heads", "embed"), cfg.o_bias, lora, "o")
        if cfg.qk_norm:  # Qwen3: one RMSNorm over head_dim, shared by all heads
            pdt = _dtype(cfg.param_dtype)
            self.q_norm = RMSNorm(dh, cfg.norm_eps, pdt)
            self.k_norm = RMSNorm(dh, cfg.norm_eps, pdt)
        self.qk_norm = cfg.qk_norm

    def __call__(self, x, cos, sin, allowed, kv=None, start=None):
        """x [B, T, D]; cos/sin [B, T, Dh]; allowed [B, T, S]; kv: (k, v) cache slabs or None.

        With a cache, this call's keys/values are written at slot ``start`` and attention runs over
        all S cache slots; without one, S == T.
        """
        b, t, _ = x.shape
        q = constrain(self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim),
                      ("batch", None, "act_heads", None))
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            return self.o_proj(_attend(q, k, v, allowed)), kv
        k_cache, v_cache = kv  # [B, KV, L, Dh]
        k = jax.lax.dynamic_update_slice(k_cache, k.swapaxes(1, 2).astype(k_cache.dtype), (0, 0, start, 0))
        v = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 3, 1).astype(v_cache.dtype), (0, 0, 0, start))
        return self.o_proj(_attend_cached(q, k, v, allowed)), (k, v)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora=None):
        self.gate_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, ("embed", "mlp"), lora=lora, target="gate")
        self.up_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, ("embed", "mlp"), lora=lora, target="up")
        self.down_proj = _linear(cfg, cfg.d_ff, cfg.d_model, rngs, ("mlp", "embed"), lora=lora, target="down")

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), ("batch", None, "act_mlp"))
        return self.down_proj(h)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora=None):
        pdt = _dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.self_attn = Attention(cfg, rngs, lora)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.mlp = MLP(cfg, rngs, lora)

    def __call__(self, x, cos, sin, allowed, kv=None, start=None):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, allowed, kv, start)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Llama(nnx.Module):
    """Decoder-only transformer; ``__call__`` returns final-normed hidden states, ``logits`` maps them.

    lora: a learner.config.LoraConfig with rank > 0 gives the targeted projections low-rank
    adapters (learner/models/lora.py); None (or rank 0) builds the plain model."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora=None):
        self.cfg = cfg
        cdt, pdt = _dtype(cfg.compute_dtype), _dtype(cfg.param_dtype)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cdt,
            param_dtype=pdt,
            embedding_init=_named(_EMBED_INIT, "vocab", "embed"),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs, lora) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        if not cfg.tie_embeddings:
            self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, rngs, ("embed", "vocab"), wide=True)

    def __call__(self, tokens, positions, mask, cache: KVCache | None = None, remat: str = "none"):
        """tokens/positions [B, T] int32, mask [B, T] bool (or, without a cache, int segment ids:
        see attention_allowed) -> (hidden [B, T, D], updated cache or None).

        remat ("none", "block", "full"; ignored with a cache) rematerialises each decoder block in
        the backward pass (see _run_block)."""
        t = tokens.shape[1]
        x = constrain(jnp.take(self._embedding_table(), tokens, axis=0), _RESIDUAL)  # [B, T, D]
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta,
                                rope_inv_freq(self.cfg))  # a constant XLA folds
        if cache is None:
            start = None
            allowed = attention_allowed(mask)  # [B, T, T]
        else:
            start = cache.length
            key_mask = jax.lax.dynamic_update_slice(cache.mask, mask, (0, start))  # [B, L]
            slots = jnp.arange(key_mask.shape[1])
            causal = slots[None, :] <= (start + jnp.arange(t))[:, None]  # [T, L]
            allowed = causal[None] & key_mask[:, None, :]  # [B, T, L]
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            if cache is None and remat != "none":
                x = _run_block(layer, x, cos, sin, allowed, remat)
                continue
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, kv = layer(x, cos, sin, allowed, kv, start)
            x = constrain(x, _RESIDUAL)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        if cache is not None:
            cache = KVCache(tuple(new_k), tuple(new_v), key_mask, start + t)
        return self.norm(x), cache

    def _embedding_table(self) -> jax.Array:
        """The token embeddings in the compute dtype, whole along embed on every device that uses
        them (FSDP gathers a weight before use; left split, the lookup's gradient would reshard the
        activations instead). What nnx.Embed's __call__ and attend compute, with that layout."""
        table = self.embed_tokens.embedding[...].astype(_dtype(self.cfg.compute_dtype))
        return constrain(table, ("vocab", None))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> float32 logits [..., V] (tied: hidden @ embed_tokens.T)."""
        if self.cfg.tie_embeddings:
            table = self._embedding_table()
            # float32 results: logits rounded to a bf16 compute dtype would move every log-prob
            out = jnp.dot(hidden.astype(table.dtype), table.T, preferred_element_type=jnp.float32)
        else:
            out = self.lm_head(hidden)
        if out.ndim == 3:
            out = constrain(out, ("batch", None, "act_vocab"))
        return out.astype(jnp.float32)


_RESIDUAL = ("batch", None, "act_embed")  # the residual stream's layout: rows split, width whole

# What a rematerialised block keeps for the backward pass: "block" its weight matmuls' outputs
# (recomputing norms, attention scores and activations), "full" nothing but its input.
_REMAT_POLICIES = {"block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                   "full": jax.checkpoint_policies.nothing_saveable}


def _run_block(layer: DecoderLayer, x, cos, sin, allowed, remat: str) -> jax.Array:
    """layer(x) under jax.checkpoint with the remat policy (a pure function of its params), its
    backward pass ordered after the gradient that flows into it (_ordered_backward)."""
    graphdef, state = nnx.split(layer)

    def block(state, x, cos, sin, allowed):
        return constrain(nnx.merge(graphdef, state)(x, cos, sin, allowed)[0], _RESIDUAL)

    return _ordered_backward(jax.checkpoint(block, policy=_REMAT_POLICIES[remat]))(
        state, x, cos, sin, allowed)


def _ordered_backward(fn):
    """fn (a block of [B, T, D] -> [B, T, D]) whose backward pass recomputes what it must only
    once the cotangent of its output exists.

    jax.checkpoint keeps the recomputation apart from the forward pass with an optimization
    barrier, but XLA:CPU's pipeline expands those barriers before its common-subexpression pass,
    which then merges each recomputed block with its forward twin: remat "full" kept ~81 KB a
    token a layer on SmolLM2 where "none" kept ~87 (the block's input alone is 2.3 KB).
    Here the saved per-token residuals get 0 * (one element of the cotangent) added before the
    backward pass reads them: exactly the same values (an inf or NaN cotangent makes the whole
    gradient non-finite anyway), but no longer the forward's, and not computable before the
    backward pass reaches this block, so one block's activations are alive at a time."""
    @jax.custom_vjp
    def ordered(*args):
        return fn(*args)

    def fwd(*args):
        return jax.vjp(fn, *args)

    def bwd(vjp_fn, ct):
        zero = jnp.ravel(ct)[0] * 0

        def after_ct(r):
            per_token = jnp.issubdtype(r.dtype, jnp.floating) and r.shape[:2] == ct.shape[:2]
            return r + zero.astype(r.dtype) if per_token else r

        return jax.tree.map(after_ct, vjp_fn)(ct)

    ordered.defvjp(fwd, bwd)
    return ordered


# ----------------------------------------------------------------------------------------------
# Pure functional API (graphdef is bound with functools.partial, params are traced).


def init_params(cfg: ModelConfig, seed: int, shardings=None) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds the model and splits it into (graphdef, params) with ``nnx.split``.

    shardings: optional NamedSharding per param (learner.sharding.Layout.params): each device
    then initializes only its shards (a model larger than one device never exists whole).
    """
    cfg.validate()
    # Built under jit: eager init dispatches (and compiles) every small op, ~3 s on a CPU.
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(seed))))
    placed = {} if shardings is None else {"out_shardings": shardings}
    params = jax.jit(lambda: nnx.split(Llama(cfg, nnx.Rngs(seed)))[1], **placed)()
    return graphdef, params


class _NoRngs:
    """Stands in for nnx.Rngs when initializers ignore their key."""

    def params(self):
        return None


def abstract_params(cfg: ModelConfig, lora=None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) whose leaves are all jax.ShapeDtypeStruct: the skeleton a checkpoint
    loader fills, built without tracing or running a single JAX op (lora: with adapters)."""
    cfg.validate()
    token = _SHAPES_ONLY.set(True)
    try:
        return nnx.split(Llama(cfg, _NoRngs(), lora))  # no keys: eager key splits cost ~4 ms each
    finally:
        _SHAPES_ONLY.reset(token)


def count_params(params) -> int:
    """Number of scalars in a params pytree."""
    return int(sum(x.size for x in jax.tree.leaves(params)))


def forward(graphdef, params, tokens, positions, mask, remat: str = "none") -> jax.Array:
    """Full-sequence forward pass: ``head_logits(hidden(...))``.

    Args:
      graphdef, params: from ``init_params``.
      tokens, positions: [B, T] int32.
      mask: [B, T] bool, True for real tokens. Attention is causal over columns and ignores keys
        where mask is False. Or [B, T] int segment ids of packed rows (0 = padding): attention
        also stays within each segment (attention_allowed); positions then restart per segment.
      remat: "none", "block" or "full" (learner.remat): what the backward pass recomputes.

    Returns:
      [B, T, V] float32 logits.
    """
    return head_logits(graphdef, params, hidden(graphdef, params, tokens, positions, mask, remat))


def hidden(graphdef, params, tokens, positions, mask, remat: str = "none") -> jax.Array:
    """The final-normed hidden states [B, T, D] (compute dtype) of a full-sequence pass; arguments
    as for ``forward``. With ``head_logits`` it lets a caller map them to logits a slice at a time
    (learner.logits_chunk) instead of materialising [B, T, V]."""
    out, _ = nnx.merge(graphdef, params)(tokens, positions, mask, remat=remat)
    return out


def head_logits(graphdef, params, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] through the output head (the embedding table when
    tied); the matmul runs in the compute dtype."""
    return nnx.merge(graphdef, params).logits(hidden)


def token_logprobs(graphdef, params, tokens, positions, mask, *, temperature=1.0) -> jax.Array:
    """Log-probabilities of each token given its prefix.

    Args:
      graphdef, params, tokens, positions, mask: as for ``forward``.
      temperature: logits are divided by it first (match the engine's sampling temperature).

    Returns:
      [B, T] float32: log softmax(logits[:, t-1] / temperature)[tokens[:, t]]; column 0 and
      columns where mask is False are 0.
    """
    logits = forward(graphdef, params, tokens, positions, mask)[:, :-1] / temperature  # [B, T-1, V]
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.where(mask[:, 1:], logp, 0.0)
    return jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], axis=1)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str = "") -> KVCache:
    """An empty cache with ``max_len`` slots per row, in ``dtype`` ("": the compute dtype). Keys and
    values are rounded to it when written; attention reads them back as they are stored."""
    dt = _dtype(dtype or cfg.compute_dtype)
    k = tuple(jnp.zeros((batch, cfg.n_kv_heads, max_len, cfg.head_dim), dt) for _ in range(cfg.n_layers))
    v = tuple(jnp.zeros((batch, cfg.n_kv_heads, cfg.head_dim, max_len), dt) for _ in range(cfg.n_layers))
    return KVCache(k, v, jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32))


def prefill(graphdef, params, cache: KVCache, tokens, positions, mask) -> tuple[jax.Array, KVCache]:
    """Writes a (left-padded) prompt block into the cache.

    Args:
      cache: from ``init_cache`` (or partly filled; the block goes at slot ``cache.length``).
      tokens, positions, mask: [B, P] as for ``forward``.

    Returns:
      (logits [B, V] float32 of the block's last column, updated cache).
    """
    model = nnx.merge(graphdef, params)
    hidden, cache = model(tokens, positions, mask, cache)
    return model.logits(hidden[:, -1]), cache


def decode_step(graphdef, params, cache: KVCache, tokens, positions) -> tuple[jax.Array, KVCache]:
    """Feeds one real token per row at slot ``cache.length``.

    Args:
      tokens, positions: [B] int32.

    Returns:
      (logits [B, V] float32 for the next token, updated cache).
    """
    model = nnx.merge(graphdef, params)
    mask = jnp.ones((tokens.shape[0], 1), bool)
    hidden, cache = model(tokens[:, None], positions[:, None], mask, cache)
    return model.logits(hidden[:, 0]), cache
