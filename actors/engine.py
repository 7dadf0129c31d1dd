"""The built-in JAX generation engine: batched sampling with a KV cache, one jitted loop per call.

Prompts are LEFT-padded so every row decodes in lock-step (row r's n-th completion token sits in
the same cache slot for all rows), with positions ``clip(cumsum(mask) - 1, 0)`` so that a real token
has the same position as in the learner's right-padded layout. Shapes are bucketed (batch up to the
next ``batch_buckets`` entry, prompt length up to a multiple of ``prompt_bucket``, ``max_new_tokens``
fixed) so a run compiles only a handful of programs; temperature, top-p and greedy are traced
arguments, so changing them never recompiles.

Rows that finish early (EOS, or a stop sequence) stay in the lock-step batch: the loop stops only when every row has
finished or ``max_new_tokens`` is reached, and until then a finished row is still computed every
step (its outputs are discarded: pad ids, logprob 0, not counted in ``lengths``). A call therefore
costs what its longest row costs; ``num_tokens / (rows x longest length)`` is the useful fraction.

Behavior logprobs (what the learner's off-policy correction needs) are, for each sampled token,
``log_softmax(logits / temperature)[token]``: the temperature-scaled distribution BEFORE top-p
truncation. The learner recomputes exactly that with ``token_logprobs(..., temperature=T)``. In
greedy mode they are ``log_softmax(logits)[token]`` (temperature 1).

Sampling support (top-p): the learner cannot rebuild the sampler's nucleus (its own logits pick a
different set), so Cadence compares sampler and learner on the SAME, full-vocabulary support: both
logprobs are untruncated. The truncation itself is reported, not hidden: ``kept_logmass`` is the
log of the probability mass the nucleus kept at each step (0 without top-p), so the true sampling
probability of a token is ``exp(logprob - kept_logmass)`` and ``-kept_logmass`` is exactly
KL(truncated || full) of that step, the part of the sampler/learner mismatch that truncation adds.

The KV cache is held in the model's compute dtype, or in ``EngineConfig.kv_dtype`` (e.g.
bfloat16 for a float32 model: half the cache's bytes; attention then multiplies in bf16 with
float32 accumulation, reading the cache as stored).

Tensor parallelism (``EngineConfig.tensor_parallel`` > 1, actors/engine_mesh.py): the same program
runs on a mesh of this process's devices with the learner's logical-axis rules; params and the KV
cache are split by head, MLP width and vocabulary, the logits are gathered whole for the sampler,
and generate() places the params it is given onto the mesh (once per params object).
"""

import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cadence.actors.engine_api import Engine, GenerationResult
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig
from cadence.learner.sharding import constrain


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Settings of the built-in JAX engine."""

    max_new_tokens: int = 8  # completion tokens per request (fixed: part of the compiled shape)
    temperature: float = 1.0  # default sampling temperature (> 0); traced, may be overridden per call
    top_p: float = 1.0  # default nucleus mass in (0, 1]; 1 disables truncation
    batch_buckets: tuple[int, ...] = (8, 16, 32, 64, 128)  # batch sizes compiled; larger calls are chunked (held-out eval reuses the actors' 128-row program)
    prompt_bucket: int = 8  # prompt lengths are padded up to a multiple of this
    # devices of this process that split the model for decoding (heads, KV cache, MLP width and
    # vocabulary over a 'tensor' mesh axis, by the learner's logical-axis rules: actors/engine_mesh.py),
    # so a process with several devices runs a model one of them cannot hold; 1 = one device
    tensor_parallel: int = 1
    # the KV cache's dtype ("": the model's compute dtype). "bfloat16" halves a float32 model's
    # cache (SmolLM2, 32 rows x 360 tokens: 0.53 -> 0.27 GB) for keys, values and attention
    # probabilities rounded to bf16; the behavior log-probs move with them, which the learner's
    # off-policy correction sees as any sampler/learner mismatch
    kv_dtype: str = ""

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>")."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not self.batch_buckets:
            raise ValueError("batch_buckets: must not be empty")
        if any(b < 1 for b in self.batch_buckets) or list(self.batch_buckets) != sorted(set(self.batch_buckets)):
            raise ValueError(f"batch_buckets: must be positive and strictly increasing, got {self.batch_buckets}")
        if self.prompt_bucket < 1:
            raise ValueError(f"prompt_bucket: must be >= 1, got {self.prompt_bucket}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel: must be >= 1, got {self.tensor_parallel}")
        if self.kv_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_dtype: must be '', 'float32', 'bfloat16' or 'float16', got {self.kv_dtype!r}")


def _nucleus(logp, top_p):
    """(truncated [B, V], kept [B]): logp with the tokens outside the top-p nucleus set to -inf
    (not renormalised), and the log of the mass the nucleus keeps. One sort of the vocabulary."""
    sorted_lp = -jnp.sort(-logp, axis=-1)  # [B, V] descending
    probs = jnp.exp(sorted_lp)
    # Keep a token while the mass strictly before it is below top_p (the first always stays).
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p  # [B, V] sorted order
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_lp, n_keep - 1, axis=-1)  # [B, 1]
    kept = jax.nn.logsumexp(jnp.where(keep, sorted_lp, -jnp.inf), axis=-1)  # [B]
    return jnp.where(logp >= cutoff, logp, -jnp.inf), jnp.minimum(kept, 0.0)


def nucleus_log_mass(logits, temperature, top_p, greedy):
    """[B] log of the probability mass top-p keeps (the support the sampler actually draws from).

    Uses the same nucleus rule as sample_token; 0 when top_p >= 1 or greedy.
    """
    # The sort costs ~40% of a decode step for a small model: skip it when nothing is truncated.
    return jax.lax.cond((top_p < 1.0) & ~greedy,
                        lambda lg: _nucleus(jax.nn.log_softmax(lg / temperature, axis=-1), top_p)[1],
                        lambda lg: jnp.zeros(lg.shape[:1], jnp.float32), logits)


_CDF_BLOCK = 256  # vocabulary block of the two-level inverse-CDF sampler


def categorical(key, logp):
    """One draw per row from exp(logp) ([B, V], normalised; -inf = never), by inverse CDF.

    ``jax.random.categorical`` draws B x V Gumbel variates; at a 49k vocabulary that random
    number generation cost ~25% of a SmolLM2 decode step on a CPU. One uniform per row is enough:
    it picks a block of the vocabulary by the cumulative block masses, then a token inside that
    block by the cumulative probabilities there (two short cumsums instead of one of length V).
    The drawn token always has probability > 0: u is kept below each cumulative total, and the
    first entry whose cumulative mass exceeds u therefore adds mass of its own.
    """
    b, v = logp.shape
    block = min(_CDF_BLOCK, v)
    n_blocks = -(-v // block)
    probs = jnp.exp(logp.astype(jnp.float32))
    probs = jnp.pad(probs, ((0, 0), (0, n_blocks * block - v))).reshape(b, n_blocks, block)
    block_mass = jnp.sum(probs, axis=-1)  # [B, n_blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    u = jax.random.uniform(key, (b,), jnp.float32) * block_cdf[:, -1]
    u = jnp.minimum(u, jnp.nextafter(block_cdf[:, -1], 0.0))
    j = jnp.sum(block_cdf <= u[:, None], axis=-1)  # [B] first block whose cdf exceeds u
    inside = jnp.take_along_axis(probs, j[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.take_along_axis(block_cdf - block_mass, j[:, None], axis=1)[:, 0]
    cdf = jnp.cumsum(inside, axis=-1)
    u = jnp.clip(u - before, 0.0, jnp.nextafter(cdf[:, -1], 0.0))
    i = jnp.sum(cdf <= u[:, None], axis=-1)
    return (j * block + i).astype(jnp.int32)


def sample_token(logits, key, temperature, top_p, greedy):
    """Picks one token per row.

    Args:
      logits: [B, V] float32.
      key: PRNG key.
      temperature: [] float, > 0.
      top_p: [] float in (0, 1]: sample from the smallest set of most likely tokens whose
        (temperature-scaled) probability reaches top_p.
      greedy: [] bool: take the argmax instead of sampling.

    Returns:
      (token [B] int32, logprob [B] float32) with logprob = log_softmax(logits / temperature)[token]
      (before top-p truncation), or log_softmax(logits)[token] when greedy.
    """
    return sample_step(logits, key, temperature, top_p, greedy)[:2]


def sample_step(logits, key, temperature, top_p, greedy):
    """sample_token and nucleus_log_mass together, sharing the one sort top-p needs.

    Returns (token [B] int32, logprob [B] float32, kept_logmass [B] float32).
    """

    def pick_greedy(_):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tok, jax.nn.log_softmax(logits, axis=-1), jnp.zeros(logits.shape[:1], jnp.float32)

    def pick_sampled(_):
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)  # [B, V]
        # The sort is skipped when nothing is truncated (top_p == 1).
        truncated, kept = jax.lax.cond(top_p < 1.0, _nucleus,
                                       lambda lp, _: (lp, jnp.zeros(lp.shape[:1], jnp.float32)), logp, top_p)
        # truncated is not renormalised; categorical scales u by the total mass it keeps.
        return categorical(key, truncated), logp, kept

    token, logp, kept = jax.lax.cond(greedy, pick_greedy, pick_sampled, None)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0], kept


def stop_block(stop: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Stop sequences as the loop matches them: ids [S, L] int32 and mask [S, L] bool, each
    sequence right-aligned (its last id in column L - 1); (1, 1) all-masked-out when there are none."""
    stop = [tuple(int(t) for t in s) for s in stop if len(s)]
    width = max((len(s) for s in stop), default=1)
    ids = np.zeros((max(len(stop), 1), width), np.int32)
    mask = np.zeros(ids.shape, bool)
    for i, seq in enumerate(stop):
        ids[i, width - len(seq):] = seq
        mask[i, width - len(seq):] = True
    return ids, mask


def _stopped(recent, stop_ids, stop_mask):
    """[B] whether the newest tokens (recent [B, L], newest last) end with a stop sequence."""
    hit = jnp.all(~stop_mask[None] | (recent[:, None, :] == stop_ids[None]), axis=-1)  # [B, S]
    return jnp.any(hit & jnp.any(stop_mask, axis=-1)[None], axis=-1)


# Layouts under tensor parallelism (actors/engine_mesh.py; no-ops on one device): the cache split
# by KV head like the k/v projections that fill it, and the logits whole for the sampler (its sort
# and cumulative sums over a split vocabulary would gather them anyway, once per use).
_WHOLE_LOGITS = ("batch", None)
_CACHE_KV = ("batch", "kv", None, None)  # k [B, KV, L, Dh] and v [B, KV, Dh, L]


def _pin(cache: llama.KVCache) -> llama.KVCache:
    return cache._replace(k=tuple(constrain(k, _CACHE_KV) for k in cache.k),
                          v=tuple(constrain(v, _CACHE_KV) for v in cache.v))


def _generate(graphdef, model_cfg, max_new, eos_id, pad_id, kv_dtype, params, tokens, mask, active, rng, temperature,
              top_p, greedy, stop_ids, stop_mask):
    """The whole generation for one bucket: prefill, then a while-loop of decode steps.

    tokens/mask [B, P] left-padded prompt block; active [B] bool (False for bucket-filler rows);
    stop_ids/stop_mask [S, L] (stop_block): a row also ends once its tokens end with one of them.
    Returns (tokens [B, M] int32, logprobs [B, M] float32, lengths [B] int32,
    kept_logmass [B, M] float32).
    """
    b, p = tokens.shape
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)  # [B, P]
    prompt_len = jnp.sum(mask, axis=1).astype(jnp.int32)  # [B] = position of the first new token
    # The last sampled token is never fed back, hence M - 1 decode slots.
    cache = _pin(llama.init_cache(model_cfg, b, p + max_new - 1, kv_dtype))
    logits, cache = llama.prefill(graphdef, params, cache, tokens, positions, mask)
    logits, cache = constrain(logits, _WHOLE_LOGITS), _pin(cache)

    def record(i, tok, lp, km, out_tok, out_lp, out_km, lengths, recent, done):
        out_tok = out_tok.at[:, i].set(jnp.where(done, pad_id, tok))
        out_lp = out_lp.at[:, i].set(jnp.where(done, 0.0, lp))
        out_km = out_km.at[:, i].set(jnp.where(done, 0.0, km))
        lengths = lengths + (~done).astype(jnp.int32)
        recent = jnp.concatenate([recent[:, 1:], tok[:, None]], axis=1)  # the newest L ids
        return out_tok, out_lp, out_km, lengths, recent, done | (tok == eos_id) | _stopped(recent, stop_ids, stop_mask)

    tok, lp, km = sample_step(logits, jax.random.fold_in(rng, 0), temperature, top_p, greedy)
    init = record(
        0,
        tok,
        lp,
        km,
        jnp.full((b, max_new), pad_id, jnp.int32),
        jnp.zeros((b, max_new), jnp.float32),
        jnp.zeros((b, max_new), jnp.float32),
        jnp.zeros((b,), jnp.int32),
        jnp.full((b, stop_ids.shape[1]), -1, jnp.int32),  # no id yet: -1 matches no token
        ~active,
    )

    def cond(carry):
        i, *_, done = carry
        return (i < max_new) & ~jnp.all(done)

    def body(carry):
        i, cache, tok, out_tok, out_lp, out_km, lengths, recent, done = carry
        logits, cache = llama.decode_step(graphdef, params, cache, tok, prompt_len + i - 1)
        logits, cache = constrain(logits, _WHOLE_LOGITS), _pin(cache)
        tok, lp, km = sample_step(logits, jax.random.fold_in(rng, i), temperature, top_p, greedy)
        out_tok, out_lp, out_km, lengths, recent, done = record(i, tok, lp, km, out_tok, out_lp, out_km,
                                                                lengths, recent, done)
        return i + 1, cache, tok, out_tok, out_lp, out_km, lengths, recent, done

    out_tok, out_lp, out_km, lengths, recent, done = init
    carry = (jnp.int32(1), cache, tok, out_tok, out_lp, out_km, lengths, recent, done)
    _, _, _, out_tok, out_lp, out_km, lengths, _, _ = jax.lax.while_loop(cond, body, carry)
    return out_tok, out_lp, lengths, out_km


class JaxEngine(Engine):
    """Batched sampler for the learner's Llama model; see the module docstring for the contract.

    An Engine (actors/engine_api.py) that holds no weights: every generate() call samples from the
    params it is given, so weights-in is a no-op and the rows carry no versions of their own."""

    name = "jax"
    holds_weights = False

    def __init__(self, model_cfg: ModelConfig, graphdef, cfg: EngineConfig, eos_id: int, pad_id: int):
        """Args: model_cfg/graphdef of the model to run; cfg; eos_id (an id outside the vocabulary
        disables stopping); pad_id written after a completion's end."""
        model_cfg.validate()
        cfg.validate()
        self.model_cfg, self.cfg = model_cfg, cfg
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        run = functools.partial(_generate, graphdef, model_cfg, cfg.max_new_tokens, self.eos_id, self.pad_id,
                                cfg.kv_dtype)
        self.mesh = None  # one device: the plain program
        if cfg.tensor_parallel > 1:
            from cadence.actors.engine_mesh import EngineMesh

            self.mesh = EngineMesh(cfg.tensor_parallel)
            run = self.mesh.activations(run)
        self._generate = jax.jit(run)
        self._shapes: set[tuple[int, int]] = set()

    @property
    def compiled_shapes(self) -> frozenset[tuple[int, int]]:
        """(batch bucket, prompt bucket) pairs generated so far."""
        return frozenset(self._shapes)

    @property
    def num_compilations(self) -> int:
        """Programs compiled so far (from jit's own cache, so accidental recompiles show too)."""
        size = getattr(self._generate, "_cache_size", None)
        return size() if size is not None else len(self._shapes)

    def batch_bucket(self, n: int) -> int:
        """Smallest batch bucket holding n rows (the largest one if n exceeds it: calls are chunked)."""
        for b in self.cfg.batch_buckets:
            if n <= b:
                return b
        return self.cfg.batch_buckets[-1]

    def generate(
        self,
        params,
        prompts: Sequence[Sequence[int]],
        rng: jax.Array,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: Sequence[Sequence[int]] = (),
    ) -> GenerationResult:
        """Generates ``max_new_tokens`` (or up to EOS, or a stop sequence) for each prompt.

        Args:
          params: model params pytree (from ``init_params`` or the learner).
          prompts: N non-empty token-id sequences (include BOS yourself), of any lengths.
          rng: PRNG key; the same key, prompts and bucket give the same samples.
          greedy: argmax decoding; behavior logprobs are then log_softmax(logits) (T = 1).
          temperature, top_p: override the config's defaults for this call (no recompile).
          stop: token-id sequences that end a row like EOS does (kept in the row; e.g. a task's
            encoded stop strings). The matching runs inside the loop, so a batch whose rows all
            stopped ends early; a new number or length of sequences compiles once more.

        Returns:
          GenerationResult; logprobs are log_softmax(logits / temperature)[token], the scaled
          distribution before top-p truncation.
        """
        start = time.perf_counter()
        temperature = self.cfg.temperature if temperature is None else float(temperature)
        top_p = self.cfg.top_p if top_p is None else float(top_p)
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        n = len(prompts)
        m = self.cfg.max_new_tokens
        if n == 0:
            empty = np.zeros((0, m), np.int32)
            return GenerationResult(empty, empty.astype(np.float32), np.zeros((0,), np.int32), 0.0, 0,
                                    empty.astype(np.float32))
        lens = [len(p) for p in prompts]
        if min(lens) < 1:
            raise ValueError("prompts: every prompt needs at least one token (e.g. BOS)")
        if max(lens) + m > self.model_cfg.max_seq_len:
            raise ValueError(
                f"prompts: longest prompt ({max(lens)}) + max_new_tokens ({m}) exceeds "
                f"max_seq_len ({self.model_cfg.max_seq_len})"
            )
        scalars = (np.float32(temperature), np.float32(top_p), np.bool_(greedy), *stop_block(stop))
        if self.mesh is not None:
            params, scalars = self.mesh.place(params), self.mesh.replicate(scalars)
        chunk = self.cfg.batch_buckets[-1]
        starts = list(range(0, n, chunk))
        keys = [rng] if len(starts) == 1 else list(jax.random.split(rng, len(starts)))
        outs = []
        for key, lo in zip(keys, starts):
            rows = prompts[lo : lo + chunk]
            tokens, mask, active = self._pack(rows, lens[lo : lo + chunk])
            self._shapes.add(tokens.shape)
            if self.mesh is not None:
                tokens, mask, active, key = self.mesh.replicate((tokens, mask, active, key))
            outs.append(self._generate(params, tokens, mask, active, key, *scalars))
        # One transfer for everything, then drop the bucket-filler rows.
        outs = jax.device_get(outs)
        out_tok = np.concatenate([o[0][: min(chunk, n - lo)] for o, lo in zip(outs, starts)])
        out_lp = np.concatenate([o[1][: min(chunk, n - lo)] for o, lo in zip(outs, starts)])
        lengths = np.concatenate([o[2][: min(chunk, n - lo)] for o, lo in zip(outs, starts)])
        kept = np.concatenate([o[3][: min(chunk, n - lo)] for o, lo in zip(outs, starts)])
        return GenerationResult(out_tok, out_lp, lengths, time.perf_counter() - start,
                                int(lengths.sum()), kept)

    def place(self, params):
        """params where generate() runs them: on the default device, or split over the engine's
        mesh (engine.tensor_parallel > 1: each device receives only its shards)."""
        return jax.device_put(params) if self.mesh is None else self.mesh.place(params)

    def abstract_params(self, params):
        """params' shapes and dtypes carrying the shardings generate() wants (None on one device):
        a template weights can be built into directly (actor processes: named_arrays.ParamLayout)."""
        return None if self.mesh is None else self.mesh.abstract(params)

    def sync_weights(self, params, version: int, min_version: int | None = None) -> bool:
        return False  # generate() reads the params it is given

    def forget_weights(self) -> None:
        pass  # nothing held

    def counters(self) -> dict[str, float]:
        return {}  # its timings travel in each group's EngineTimings

    def abort(self) -> None:
        pass  # a call is one jitted program: it cannot be cut short, and it ends on its own

    def close(self) -> None:
        pass  # owns nothing beyond memory

    def _pack(self, prompts, lens):
        """Left-pads prompts into the bucketed block: tokens/mask [B, P], active [B]."""
        b = self.batch_bucket(len(prompts))
        p = self.cfg.prompt_bucket * math.ceil(max(lens) / self.cfg.prompt_bucket)
        tokens = np.full((b, p), self.pad_id, np.int32)
        mask = np.zeros((b, p), bool)
        for r, (prompt, n) in enumerate(zip(prompts, lens)):
            tokens[r, p - n :] = prompt
            mask[r, p - n :] = True
        active = np.zeros((b,), bool)
        active[: len(prompts)] = True
        return tokens, mask, active
