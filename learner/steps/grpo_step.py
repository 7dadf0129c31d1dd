"""The jitted GRPO-family train step: gradient accumulation over fixed-shape microbatches, Adam updates.

Host loop per batch (GRPOTrainStep.update), with learner.minibatches = k (default 1):
  [decoupled, k > 1: proximal = logprobs of every microbatch under the params at the batch's start]
  for minibatch in split(microbatches, k):           # k optimizer updates per batch
    grads = zeros(params)
    for mb in minibatch:  grads, stats = accumulate(params, grads, pack(mb), num_tokens)  # donated
    params, opt_state, grad_norm = apply(params, opt_state, grads)                  # grads donated

The loss of each microbatch is normalized by the completion-token count of its whole minibatch, so
the accumulated gradient is exactly the minibatch gradient (the full-batch one when k = 1). A
minibatch of one microbatch (microbatch_size = batch_size, common on a mesh, where microbatch rows
split over the devices) runs accumulate and apply as one program: the separate apply was one more
launch and set of collectives per update (~4 of 37 ms on 4 CPU devices). With several
microbatches the two stay apart, since fusing would compile the model's gradient twice (+2-4 s of
startup on the default run). Shapes
are fixed by microbatch_size and seq_len and num_tokens is a traced scalar, so a new number of microbatches (a new batch size) or new
hyperparameters (arrays in opt_state) never recompile; `cache_sizes()` lets tests assert that.

With a `layout` (learner/sharding.py) every jitted function has explicit in/out shardings: params,
gradients and Adam moments split as the layout says, microbatch rows over data x fsdp, scalars
and metrics replicated; GSPMD inserts the collectives. Adam's moments are float32 whatever the
params' dtype.

LoRA (learner.lora.rank > 0, learner/models/lora.py): the state's params are the adapters alone,
so gradients, Adam's moments, clipping and the controller's rescales see nothing else; the frozen
base, taken by `init`, goes into every jitted function as one more argument (`frozen`) and is
joined with the adapters inside the loss. `policy_params(state.params)` is the policy actors get:
base + alpha / r * A B merged. Rank 0 traces exactly the programs it always did (frozen is None).
With learner.lora.dropout > 0 one more argument follows (`noise`: int32 [step, minibatch,
microbatch]) and the loss's forward drops adapter inputs with masks keyed by it and learner.seed
(lora.dropout_key). As PEFT (dropout only in train()) and TRL (the loss's forward in train mode)
do, only the gradient pass drops: the behaviour log-probs come from actors sampling the whole
policy, and the decoupled correction's proximal log-probs are recomputed without dropout, so the
trust region is centred on the policy actors run, not on one random mask of it (the importance
ratio then carries the mask's noise, which its clip bounds, as in TRL without disable_dropout).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cadence.learner import optimizer as optim
from cadence.learner import sharding
from cadence.learner.algorithms.grpo import finalize_metrics, grpo_token_loss
from cadence.learner.batching import Microbatch, pack_microbatch, unpack_microbatch
from cadence.learner.config import LearnerConfig
from cadence.learner.controller.config import NOISE_OBJECTIVES
from cadence.learner.models import lora
from cadence.learner.segments import sequence_ids
from cadence.learner.steps.scoring import score_tokens

# logits_fn(params, tokens [B, T], positions [B, T], mask [B, T]) -> logits [B, T, V]
LogitsFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


# Metrics that are the objective itself, not a description of the computed tokens: skipping
# microbatches without a signal leaves them unchanged (those tokens add 0 to each).
_OBJECTIVE_METRICS = ("loss", "pg_loss")


def _over_computed_tokens(sums: dict, computed: float, num_tokens: float) -> dict:
    """Token-mean metric sums (normalized by the batch's num_tokens) of the computed microbatches
    alone, renormalized to means over the computed tokens; the objective's own sums as they are."""
    scale = num_tokens / computed if computed > 0 else 0.0
    return {k: v if k in _OBJECTIVE_METRICS else v * scale for k, v in sums.items()}


class LearnerState(NamedTuple):
    """Everything the train step updates."""

    params: Any  # the trained parameters (any pytree, e.g. an nnx.State; LoRA: the adapters alone)
    opt_state: Any  # optax state of make_optimizer (hyperparameters inside)
    step: int  # host int: batches trained so far (the policy version; k optimizer updates each)


def count_sequences(microbatches: Sequence[Microbatch]) -> int:
    """Rows holding at least one completion token (the global normalizer of sequence-level
    aggregations; padding rows do not count); segments of packed rows (int mask) likewise."""
    total = 0
    for mb in microbatches:
        trained, segments = np.asarray(mb.loss_mask) > 0, np.asarray(mb.mask)
        if segments.dtype == np.bool_:  # one sequence per row
            total += int(np.count_nonzero(trained.any(axis=-1)))
        else:  # packed rows: distinct (row, sequence id) pairs with a trained token
            seq = sequence_ids(segments)
            total += len(np.unique(np.nonzero(trained)[0] * segments.shape[1] + seq[trained]))
    return total


class WholeBatch(NamedTuple):
    """What a train step needs from the whole batch when it is given only this process's rows
    (a learner over several processes, learner/leader.py): the host-side counts it normalizes by."""

    rows: int  # rows of each whole microbatch
    sequences: tuple  # count_sequences of each microbatch
    loss_tokens: tuple  # loss-mask sum of each microbatch
    signal: tuple = ()  # has_signal of each microbatch (() = all)

    def part(self, indices: Sequence[int]) -> "WholeBatch":
        return WholeBatch(self.rows, tuple(self.sequences[i] for i in indices),
                          tuple(self.loss_tokens[i] for i in indices),
                          tuple(self.signal[i] for i in indices) if self.signal else ())


def has_signal(mb: Microbatch) -> bool:
    """Whether a microbatch has a nonzero advantage: without one its gradient is exactly zero
    (under learner.skip_zero_advantage's conditions, LearnerConfig.validate)."""
    return bool(np.any(np.asarray(mb.advantages) != 0))


def whole_batch(microbatches: Sequence[Microbatch]) -> WholeBatch:
    """The WholeBatch of host microbatches (all rows)."""
    return WholeBatch(len(microbatches[0].tokens), tuple(count_sequences([mb]) for mb in microbatches),
                      tuple(float(np.asarray(mb.loss_mask).sum()) for mb in microbatches),
                      tuple(has_signal(mb) for mb in microbatches))


def _sum_squares(tree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)


# A noise-scale unit's own gradient (GRPOTrainStep._accumulate_all) is kept only for its norm, so
# it is summed in bfloat16 beside the exact float32 batch gradient: half a model copy instead of a
# whole one alive through the gradient pass (SmolLM2 in float32: 0.27 GB). Rounding to bf16 is
# unbiased, so |unit|^2 over the model's many entries moves by ~1e-5 relative; the noise
# estimate reads differences of order 1 (|unit|^2 against |batch|^2), far above that.
UNIT_DTYPE = jnp.bfloat16


def _unit_zeros(params):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, UNIT_DTYPE), params)


def _unit_norm(part):
    """(|part|^2, part zeroed in place for the next unit)."""
    return _sum_squares(part), jax.tree.map(jnp.zeros_like, part)


def check_temperature(temperature: float) -> float:
    """The sampler's temperature as the learner divides logits by it; ValueError unless > 0."""
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 (the sampler's, engine.temperature), got {temperature}")
    return float(temperature)


class GRPOTrainStep:
    """GRPO learner update over a list of microbatches (see the module docstring).

    Args:
      logits_fn: pure function (params, tokens, positions, mask) -> logits [B, T, V], e.g.
        functools.partial(learner.models.llama.forward, graphdef), or a
        learner.steps.scoring.SplitLogits (llama_logits(graphdef)), which cfg.logits_chunk needs for
        rows longer than a chunk.
      cfg: LearnerConfig (optimizer, grpo and logits_chunk are read).
      completion_budget: the most tokens a completion may have (engine.max_new_tokens), the
        divisor of the seq_sum_norm aggregation (Dr.GRPO) unless grpo.aggregation_constant is set.
      temperature: the sampler's temperature (engine.temperature, > 0): logits are divided by it,
        so the learner scores the distribution the completions were drawn from.
      donate_state: donate params instead of the gradients to `apply` (the Adam moments are
        always donated). Only safe if nothing else holds the previous params, e.g. an in-process
        actor still sampling with the published weights; off by default for that reason.
      layout: a learner.sharding.Layout to run on a device mesh (None: one device, no shardings).
    """

    def __init__(self, logits_fn: LogitsFn, cfg: LearnerConfig, *, completion_budget: int = 0,
                 temperature: float = 1.0, donate_state: bool = False, layout: sharding.Layout | None = None):
        self.cfg = cfg
        self.completion_budget = int(completion_budget)
        self.temperature = check_temperature(temperature)
        # learner.microbatch_tokens > 0: microbatches come packed (segment ids in mask, [M, 6T] on device)
        self.packed = cfg.microbatch_tokens > 0
        self.optimizer = optim.make_optimizer(cfg.optimizer)
        self._optimizer_parts = optim.optimizer_parts(cfg.optimizer)  # the chain's, applied apart by _apply
        self.layout = layout
        # LoRA: the frozen base params (set by init) and the jitted merge that publishes base + adapters
        self.lora = cfg.lora if cfg.lora.rank > 0 else None
        self._base = None
        self.dropout = self.lora.dropout if self.lora is not None else 0.0  # > 0: jitted calls take `noise`
        self._merge = jax.jit(functools.partial(lora.merge_weights, lora_cfg=self.lora)) if self.lora else None
        score = functools.partial(score_tokens, logits_fn, chunk=cfg.logits_chunk,
                                  temperature=self.temperature)
        self._score = score if layout is None else layout.activations(score)
        self._metric_keys: tuple[str, ...] | None = None
        # The new Adam moments reuse the old ones' buffers: nothing outside the step reads
        # opt_state between updates except a checkpoint being written, which the loop waits for
        # (LearnerLoop.before_update). Without it every update held two sets of moments (two
        # copies of the model: +1.1 GB at SmolLM2 in float32). The new params reuse either the old
        # params' buffers or the gradient's (same shapes); donating both would leave one set
        # unusable, and the published params may still be sampled from.
        donate_apply = (0, 1) if donate_state else (1, 2)
        self._donate_apply = donate_apply
        if layout is None:
            self._zeros = jax.jit(lambda params: jax.tree.map(jnp.zeros_like, params))
            self._init_opt = functools.partial(sharding.init_opt_state, self.optimizer)
            self._proximal = jax.jit(self._proximal_impl)
            self._accumulate = jax.jit(self._accumulate_impl, donate_argnums=(1,))
            self._apply = self._apply_jits()
            self._accumulate_proximal = self._accumulate
            self._accumulate_apply = jax.jit(self._accumulate_apply_impl, donate_argnums=donate_apply)
            self._accumulate_apply_proximal = self._accumulate_apply
            self._accumulate_unit = self._accumulate_unit_proximal = jax.jit(self._accumulate_unit_impl,
                                                                             donate_argnums=(1, 2))
            self._unit_jits()
            return
        p, b, r = layout.params, layout.batch, layout.replicated
        o = layout.opt_state(self.optimizer)
        self._zeros = jax.jit(lambda params: jax.tree.map(jnp.zeros_like, params),
                              in_shardings=(p,), out_shardings=p)
        self._init_opt = jax.jit(functools.partial(sharding.init_opt_state, self.optimizer),
                                 in_shardings=(p,), out_shardings=o)
        self._proximal = jax.jit(self._proximal_impl, in_shardings=(p, b), out_shardings=b)
        self._accumulate = jax.jit(self._accumulate_impl, donate_argnums=(1,),
                                   in_shardings=(p, p, b, r, r), out_shardings=(p, r))
        self._accumulate_proximal = jax.jit(self._accumulate_impl, donate_argnums=(1,),
                                            in_shardings=(p, p, b, r, r, b), out_shardings=(p, r))
        self._apply = self._apply_jits(p, o, r)
        self._accumulate_apply = jax.jit(self._accumulate_apply_impl, donate_argnums=donate_apply,
                                         in_shardings=(p, o, p, b, r, r), out_shardings=(p, o, r, r))
        self._accumulate_apply_proximal = jax.jit(
            self._accumulate_apply_impl, donate_argnums=donate_apply,
            in_shardings=(p, o, p, b, r, r, b), out_shardings=(p, o, r, r))
        self._accumulate_unit = jax.jit(self._accumulate_unit_impl, donate_argnums=(1, 2),
                                        in_shardings=(p, p, p, b, r, r), out_shardings=(p, p, r))
        self._accumulate_unit_proximal = jax.jit(self._accumulate_unit_impl, donate_argnums=(1, 2),
                                                 in_shardings=(p, p, p, b, r, r, b), out_shardings=(p, p, r))
        self._unit_jits(p, r, (p, p, p, b, r, r))

    def _apply_jits(self, p=None, o=None, r=None) -> "AdamInParts":
        """Adam's step as three programs (learner.optimizer.updates_from_moments says why): the
        gradient clipped in place, the moments in place, then the params into the gradient's
        buffer (or, with donate_state, the old params')."""
        into = 0 if self._donate_apply == (0, 1) else 2
        if p is None:
            return AdamInParts(jax.jit(self._clip_impl, donate_argnums=(0,)),
                               jax.jit(self._moments_impl, donate_argnums=(1,)),
                               jax.jit(self._params_impl, donate_argnums=(into,), keep_unused=True))
        return AdamInParts(
            jax.jit(self._clip_impl, donate_argnums=(0,), in_shardings=(p,), out_shardings=(p, r)),
            jax.jit(self._moments_impl, donate_argnums=(1,), in_shardings=(p, o, p), out_shardings=o),
            jax.jit(self._params_impl, donate_argnums=(into,), keep_unused=True, in_shardings=(p, o, p),
                    out_shardings=p))

    def _unit_jits(self, p=None, r=None, unit_in=None) -> None:
        """The noise units' programs (on the params' shardings with a layout): their bf16 buffer made,
        and read (norm) and zeroed in place; the unclipped objective's accumulate (unit_objective);
        a gradient's |g|^2. unit_in: in_shardings of the accumulate's leading arguments."""
        unclipped = functools.partial(self._accumulate_unit_impl, clip=False)
        if p is None:
            self._unit_zeros = jax.jit(_unit_zeros)
            self._unit_norm = jax.jit(_unit_norm, donate_argnums=(0,))
            self._accumulate_unclipped = jax.jit(unclipped, donate_argnums=(1, 2))
            self._grad_sq = jax.jit(_sum_squares)
            return
        self._unit_zeros = jax.jit(_unit_zeros, in_shardings=(p,), out_shardings=p)
        self._unit_norm = jax.jit(_unit_norm, donate_argnums=(0,), in_shardings=(p,), out_shardings=(r, p))
        self._accumulate_unclipped = jax.jit(unclipped, donate_argnums=(1, 2), in_shardings=unit_in,
                                             out_shardings=(p, p, r))
        self._grad_sq = jax.jit(_sum_squares, in_shardings=(p,), out_shardings=r)

    # ---- pure functions (traced) ----

    def loss_fn(self, params, mb: Microbatch, num_tokens, num_sequences=None,
                proximal_logprobs=None, frozen=None, noise=None, clip: bool = True) -> tuple[jax.Array, dict]:
        """GRPO loss of one microbatch normalized by the global token (and sequence) counts;
        (loss, metrics). num_sequences defaults to the microbatch's own rows with tokens;
        proximal_logprobs [M, T] to the current policy's (stop-gradient) log-probs; frozen: a
        LoRA run's base params (params are then its adapters); noise: int32 [step, minibatch,
        microbatch] keying adapter dropout (learner.lora.dropout > 0); clip: False drops the
        objective's clip (grpo_token_loss)."""
        if frozen is not None:
            params = lora.join(frozen, params)
        grpo = self.cfg.grpo
        key = None if noise is None else lora.dropout_key(self.cfg.seed, *noise)
        # The bonus needs the exact entropy and its gradient; without it no softmax over the
        # vocabulary is taken and the metric is the sampled estimate (entropy_sampled).
        with lora.adapter_dropout(key, self.dropout):
            scores = self._score(params, mb.tokens, mb.positions, mb.mask, entropy=grpo.entropy_coef > 0)
        logprobs, entropy = scores.logprobs, scores.entropy  # [M, T]
        return grpo_token_loss(
            logprobs, mb.behavior_logprobs, mb.advantages, mb.loss_mask, num_tokens, grpo,
            entropy=entropy, proximal_logprobs=proximal_logprobs, num_sequences=num_sequences,
            completion_budget=self.completion_budget,
            segments=sequence_ids(mb.mask) if self.packed else None, clip=clip,
        )

    def _proximal_impl(self, params, packed, frozen=None):
        mb = unpack_microbatch(packed, segments=self.packed)
        if frozen is not None:
            params = lora.join(frozen, params)
        return self._score(params, mb.tokens, mb.positions, mb.mask).logprobs  # [M, T]

    def _microbatch_grads(self, params, packed, num_tokens, num_sequences, proximal, frozen, noise, clip=True):
        """(this microbatch's gradient, its stats): the metrics (additive) and its grad-norm^2 in one
        small vector [K + 1], fetched with the others at the end of the update."""
        mb = unpack_microbatch(packed, segments=self.packed)  # [M, 5T + 1] (packed: 6T) -> Microbatch
        (_, metrics), mb_grads = jax.value_and_grad(self.loss_fn, has_aux=True)(
            params, mb, num_tokens, num_sequences, proximal, frozen, noise, clip
        )
        stats = jnp.stack([metrics[k].astype(jnp.float32) for k in self._metric_keys]
                          + [_sum_squares(mb_grads)])
        return mb_grads, stats

    def _accumulate_impl(self, params, grads, packed, num_tokens, num_sequences, proximal=None, frozen=None,
                         noise=None):
        mb_grads, stats = self._microbatch_grads(params, packed, num_tokens, num_sequences, proximal, frozen, noise)
        return jax.tree.map(jnp.add, grads, mb_grads), stats

    def _accumulate_unit_impl(self, params, grads, part, packed, num_tokens, num_sequences, proximal=None,
                              frozen=None, noise=None, clip=True):
        """_accumulate_impl that also sums the gradient into its noise unit's bf16 `part`."""
        mb_grads, stats = self._microbatch_grads(params, packed, num_tokens, num_sequences, proximal, frozen, noise,
                                                 clip)
        part = jax.tree.map(lambda u, g: (u.astype(g.dtype) + g).astype(UNIT_DTYPE), part, mb_grads)
        return jax.tree.map(jnp.add, grads, mb_grads), part, stats

    def _apply_impl(self, params, opt_state, grads):
        grads = sharding.fp32_grads(grads)  # the moments are float32 (a no-op for float32 params)
        grad_norm = optax.tree.norm(grads)  # before clipping
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grad_norm

    def _clip_impl(self, grads):
        """(the gradient clipped to optimizer.max_grad_norm, in float32; its norm before)."""
        grads = sharding.fp32_grads(grads)  # the moments are float32 (a no-op for float32 params)
        norm = optax.tree.norm(grads)
        if len(self._optimizer_parts) > 1:
            grads, _ = self._optimizer_parts[0].update(grads, optax.EmptyState())
        return grads, norm

    def _moments_impl(self, params, opt_state, clipped):
        """opt_state after Adam's update from the clipped gradient (_params_impl reads the step
        from it; the chain's clip state is stateless)."""
        _, adam_state = self._optimizer_parts[-1].update(clipped, opt_state[-1], params)  # updates: dead code
        return (*opt_state[:-1], adam_state)

    def _params_impl(self, params, opt_state, grads):
        del grads  # donated: the new params take its buffer
        return optax.apply_updates(params, optim.updates_from_moments(opt_state, params))

    def _accumulate_apply_impl(self, params, opt_state, grads, packed, num_tokens, num_sequences,
                               proximal=None, frozen=None, noise=None):
        grads, stats = self._accumulate_impl(params, grads, packed, num_tokens, num_sequences, proximal, frozen,
                                             noise)
        return (*self._apply_impl(params, opt_state, grads), stats)

    # ---- host API ----

    def init(self, params) -> LearnerState:
        """A fresh learner state (float32 Adam moments at zero, step 0) for `params`
        (float32 master copies of them with learner.master_weights).

        LoRA: params are the LoRA model's (base joined with adapters, learner/models/lora.py);
        the base is kept here, frozen, and the state holds the adapters alone."""
        if self.lora is not None:
            params, self._base = lora.split(params)
            if self.layout is not None:  # the adapters' own shardings: their jits are built now
                params = lora.on_mesh(self.layout, params, self._jit_lora_on_mesh(params))
        if self.cfg.master_weights:
            params = master_copy(params)
        return LearnerState(params=params, opt_state=self._init_opt(params), step=0)

    def _jit_lora_on_mesh(self, adapters):
        """The jitted functions of a LoRA run on a mesh, with the adapters' shardings (from the
        logical names they carry: A like its kernel's input axis, B like its output axis) and the
        frozen base's (the layout's). Returns the adapters' shardings."""
        layout = self.layout
        (p, o), pb = layout.trained_shardings(adapters, self.optimizer), layout.params
        b, r = layout.batch, layout.replicated
        donate_apply = self._donate_apply
        self._zeros = jax.jit(lambda params: jax.tree.map(jnp.zeros_like, params), in_shardings=(p,), out_shardings=p)
        self._init_opt = jax.jit(functools.partial(sharding.init_opt_state, self.optimizer),
                                 in_shardings=(p,), out_shardings=o)
        self._proximal = jax.jit(self._proximal_impl, in_shardings=(p, b, pb), out_shardings=b)
        # (proximal, frozen[, noise]) always come last, proximal None or [M, T] rows
        tail = (b, pb, r) if self.dropout else (b, pb)
        self._accumulate = self._accumulate_proximal = jax.jit(
            self._accumulate_impl, donate_argnums=(1,), in_shardings=(p, p, b, r, r, *tail), out_shardings=(p, r))
        self._apply = self._apply_jits(p, o, r)
        self._accumulate_apply = self._accumulate_apply_proximal = jax.jit(
            self._accumulate_apply_impl, donate_argnums=donate_apply,
            in_shardings=(p, o, p, b, r, r, *tail), out_shardings=(p, o, r, r))
        self._merge = jax.jit(functools.partial(lora.merge_weights, lora_cfg=self.lora),
                              in_shardings=(pb, p), out_shardings=pb)
        self._accumulate_unit = self._accumulate_unit_proximal = jax.jit(
            self._accumulate_unit_impl, donate_argnums=(1, 2), in_shardings=(p, p, p, b, r, r, *tail),
            out_shardings=(p, p, r))
        self._unit_jits(p, r, (p, p, p, b, r, r, *tail))
        return p

    def policy_params(self, params):
        """The policy `params` (a state's) stand for, as the plain model's params: LoRA merges
        base + alpha / r * A B (a new copy; the base is untouched); otherwise params themselves."""
        if self.lora is None:
            return params
        return self._merge(self._base, params)

    @property
    def frozen(self):
        """A LoRA run's base params (None otherwise, or before init)."""
        return self._base

    def _lora_args(self, proximal=None, noise=None) -> tuple:
        """The trailing (proximal, frozen[, noise]) arguments a LoRA run's jitted calls get; ()
        otherwise. noise: (step, minibatch, microbatch) of a dropout run's gradient pass, or None."""
        if self.lora is None:
            return ()
        if not self.dropout:
            return proximal, self._base
        return proximal, self._base, None if noise is None else int_vector(noise, self.layout)

    def accumulate_gradients(
        self, params, microbatches: Sequence[Microbatch], num_tokens: int, proximal=None, packed=None,
    ) -> tuple[Any, list[jax.Array]]:
        """The full-batch gradient, summed over microbatches (asynchronous device values).

        Args:
          params: the params to differentiate at.
          microbatches: host microbatches (one shape).
          num_tokens: completion tokens of all of them (the loss normalizer).
          proximal: optional per-microbatch [M, T] proximal log-probs (device arrays).
          packed: optional device copies of `microbatches` from `pack` (else packed here).

        Returns:
          (grads like params, per-microbatch stats: one [K + 1] float32 vector each, the
          additive metrics in `metric_keys` order followed by that microbatch's grad-norm^2).
        """
        if not microbatches:
            raise ValueError("accumulate_gradients: no microbatches")
        packed, n, s = self._prepare(params, microbatches, num_tokens, packed)
        return self._accumulate_all(params, packed, n, s, proximal)[:2]  # no dropout: no update's key

    def _prepare(self, params, microbatches, num_tokens, packed, whole: WholeBatch | None = None):
        if self._metric_keys is None:  # trace once abstractly (no compile) for the metric names
            frozen = () if self.lora is None else (None, None, self._base)
            _, shapes = jax.eval_shape(self.loss_fn, params, microbatches[0], jnp.float32(1.0), *frozen)
            self._metric_keys = tuple(sorted(shapes))
        if packed is None:
            packed = self.pack(microbatches, whole)
        n = self._scalar(max(int(num_tokens), 1))
        sequences = count_sequences(microbatches) if whole is None else sum(whole.sequences)
        s = self._scalar(max(sequences, 1))
        return packed, n, s

    def _accumulate_all(self, params, packed, n, s, proximal, noise=None, units=None, skip=(), clip=True):
        """(gradient summed over the microbatches, per-microbatch stats (None where skipped),
        per-unit |gradient|^2 or None). units: microbatches per unit (consecutive); each unit's
        gradient is also summed apart, in bf16 (UNIT_DTYPE: half a gradient-sized buffer), for its
        norm. Units of one microbatch each are the microbatches' own norms: no second buffer.
        skip: indices of microbatches without a signal (their gradient is zero: not computed).
        clip=False: the objective without its clip, for the units (one program: every unit apart)."""
        grads = self._zeros(params)
        per_mb, unit_sq = [], None
        separate = units is not None and len(units) > 1 and (max(units) > 1 or not clip)
        if separate:
            unit_sq, ends = [], set(np.cumsum(units).tolist())
            part = self._unit_zeros(params)
        for i, mb in enumerate(packed):
            acc = (grads, part) if separate else (grads,)
            if i in skip:
                stats = None
            else:
                if self.lora is not None:
                    extra = self._lora_args(None if proximal is None else proximal[i],
                                            None if noise is None else (*noise, i))
                else:
                    extra = () if proximal is None else (proximal[i],)
                if not clip:
                    fn = self._accumulate_unclipped
                elif separate:
                    fn = self._accumulate_unit if proximal is None else self._accumulate_unit_proximal
                else:
                    fn = self._accumulate if proximal is None else self._accumulate_proximal
                *acc, stats = fn(params, *acc, mb, n, s, *extra)
            per_mb.append(stats)
            grads = acc[0]
            if separate:
                part = acc[1]
                if i + 1 in ends:  # the unit is complete: its norm, and a zeroed buffer for the next
                    sq, part = self._unit_norm(part)
                    unit_sq.append(sq)
        return grads, per_mb, unit_sq

    def _scalar(self, value) -> jax.Array:
        if self.layout is None:
            return jnp.asarray(value, jnp.float32)  # strong f32: one jit signature
        return self.layout.scalar(value)

    def pack(self, microbatches: Sequence[Microbatch], whole: WholeBatch | None = None) -> list[jax.Array]:
        """Device copies of host microbatches, one buffer each, all copies started at once (rows
        split over data x fsdp with a layout: each process places its own rows). whole: given
        when the microbatches hold only this process's rows."""
        host = [pack_microbatch(mb) for mb in microbatches]
        if self.layout is None:
            return jax.device_put(host)
        return self.layout.put_batch(host) if whole is None else self.layout.put_process_rows(host, whole.rows)

    def proximal_logprobs(self, params, microbatches: Sequence[Microbatch], packed=None) -> list[jax.Array]:
        """[M, T] log-probs of each microbatch's tokens under params (device arrays)."""
        if packed is None:
            packed = self.pack(microbatches)
        frozen = () if self.lora is None else (self._base,)
        return [self._proximal(params, mb, *frozen) for mb in packed]

    @property
    def metric_keys(self) -> tuple[str, ...]:
        """Names of the additive loss metrics (known after the first accumulate_gradients)."""
        return self._metric_keys or ()

    def update(
        self, state: LearnerState, microbatches: Sequence[Microbatch], num_tokens: int,
        whole: WholeBatch | None = None, units: Sequence[int] | None = None, unit_objective: str = "trained",
    ) -> tuple[LearnerState, dict]:
        """Train on one batch: learner.minibatches optimizer steps (default 1) over its microbatches.

        Args:
          state: the current LearnerState.
          microbatches: host (NumPy) microbatches from build_microbatches (any count; one shape).
          num_tokens: total completion tokens of the batch (stats["num_tokens"]).
          whole: given when `microbatches` hold only this process's rows (Layout.process_rows)
            of a learner over several processes: the whole batch's counts.
          units: microbatches per unit of whole groups, in order (layout_microbatches's
            stats["unit_microbatches"]): the metrics then also hold unit_grad_norm_sq and
            unit_tokens, as the microbatch ones (one minibatch only; with several, no units).
          unit_objective: "trained": the units are parts of the trained gradient (free);
            "unclipped": of the objective without its clip (grpo_token_loss's clip=False), in a
            gradient pass of their own before the trained one, and unit_batch_grad_norm_sq is
            that objective's whole-batch |g|^2. Where the trained objective cannot clip (a
            correction other than "coupled": its ratio is 1 at one minibatch) the two are the
            same and no pass is added. Why: ControllerConfig.noise_objective.

        The state's Adam moments are donated to the update: use the returned state afterwards,
        not `state` (its params stay valid; they may still be sampled from).

        Returns:
          (new state, metrics as host floats): loss, pg_loss, grad_norm (before clipping),
          grad_norm_sq (of the accumulated gradient), microbatch_grad_norm_sq (list: squared norm
          of each microbatch's gradient contribution, which is normalized by the global num_tokens;
          multiply by (num_tokens / microbatch_tokens[i])^2 for the norm of that microbatch's own
          mean gradient), microbatch_tokens (list), clip_frac, ratio_mean, is_weight_mean,
          is_truncated_frac, entropy_sampled, entropy (only with entropy_coef > 0), logprob_diff_abs, mismatch_kl, ess, learning_rate, b1, b2,
          eps (as used by this step), tokens, num_microbatches, step (after the update). With
          several minibatches the loss metrics and grad norms are means over them (the first
          minibatch's are the on-policy ones) and optimizer_updates says how many ran.
        """
        chunks = [list(c) for c in np.array_split(np.arange(len(microbatches)), self.cfg.minibatches) if len(c)]
        if len(chunks) == 1:
            state, metrics = self._update_minibatch(state, microbatches, num_tokens, whole=whole, minibatch=0,
                                                    units=units, unit_objective=unit_objective)
            return state._replace(step=state.step + 1), {**metrics, "step": state.step + 1}
        packed = self.pack(microbatches, whole)  # once: the proximal pass and the updates share it
        proximal = None
        if self.cfg.grpo.correction == "decoupled":  # the trust region is around the batch's start
            proximal = self.proximal_logprobs(state.params, microbatches, packed)
        per_update = []
        for k, chunk in enumerate(chunks):
            mbs = [microbatches[i] for i in chunk]
            part = None if whole is None else whole.part(chunk)
            tokens = int(sum(np.asarray(mb.loss_mask).sum() for mb in mbs) if part is None else sum(part.loss_tokens))
            state, m = self._update_minibatch(state, mbs, tokens,
                                              None if proximal is None else [proximal[i] for i in chunk],
                                              [packed[i] for i in chunk], part, minibatch=k)
            per_update.append(m)
        metrics = {k: (float(np.mean([m[k] for m in per_update])) if isinstance(v, float) else v)
                   for k, v in per_update[-1].items()}
        metrics.update(
            microbatch_grad_norm_sq=[x for m in per_update for x in m["microbatch_grad_norm_sq"]],
            microbatch_tokens=[x for m in per_update for x in m["microbatch_tokens"]],
            tokens=int(num_tokens), num_microbatches=len(microbatches),
            optimizer_updates=len(per_update), step=state.step + 1,
        )
        return state._replace(step=state.step + 1), metrics

    def _update_minibatch(self, state: LearnerState, microbatches, num_tokens: int, proximal=None,
                          packed=None, whole: WholeBatch | None = None, minibatch: int = 0, units=None,
                          unit_objective: str = "trained"):
        """One optimizer step on the given microbatches; (state with step unchanged, metrics)."""
        params = state.params
        if not microbatches:
            raise ValueError("update: no microbatches")
        packed, n, s = self._prepare(params, microbatches, num_tokens, packed, whole)
        noise = (int(state.step), minibatch) if self.dropout else None  # the update's dropout masks
        unit_sq = None
        if units is not None and sum(units) != len(packed):
            raise ValueError(f"update: units {list(units)} do not add up to the {len(packed)} microbatches")
        skip = self._skipped(microbatches, whole)
        if unit_objective not in NOISE_OBJECTIVES:
            raise ValueError(f"update: unit_objective must be one of {NOISE_OBJECTIVES}, got {unit_objective!r}")
        trained_units, batch_sq = units, None
        if (unit_objective == "unclipped" and units is not None and len(units) > 1
                and proximal is None and self.cfg.grpo.correction == "coupled"):
            # First, so its two buffers are gone before the trained gradient's is made.
            total, _, unit_sq = self._accumulate_all(params, packed, n, s, None, noise, units, skip, clip=False)
            batch_sq, trained_units = self._grad_sq(total), None
            del total
        if len(packed) > 1:
            grads, per_mb, trained_sq = self._accumulate_all(params, packed, n, s, proximal, noise, trained_units,
                                                             skip)
            if batch_sq is None:  # the units are the trained gradient's
                unit_sq = trained_sq
            new_params, opt_state, grad_norm = self._apply(params, state.opt_state, grads)
        elif skip:  # one microbatch, no signal: Adam still steps (its moments decay), on a zero gradient
            new_params, opt_state, grad_norm = self._apply(params, state.opt_state, self._zeros(params))
            per_mb = [None]
        else:
            fused, extra = ((self._accumulate_apply, ()) if proximal is None
                            else (self._accumulate_apply_proximal, (proximal[0],)))
            if self.lora is not None:
                extra = self._lora_args(None if proximal is None else proximal[0],
                                        None if noise is None else (*noise, 0))
            new_params, opt_state, grad_norm, stats = fused(
                params, state.opt_state, self._zeros(params), packed[0], n, s, *extra)
            per_mb = [stats]
        hyper = optim.hyperparam_arrays(opt_state)

        per_mb, grad_norm, hyper, unit_sq, batch_sq = jax.device_get((per_mb, grad_norm, hyper, unit_sq, batch_sq))
        width = len(self._metric_keys) + 1
        per_mb = np.stack([np.zeros(width) if x is None else x for x in per_mb]).astype(np.float64)  # [num_mb, K + 1]
        mb_tokens = (list(whole.loss_tokens) if whole is not None
                     else [float(np.asarray(mb.loss_mask).sum()) for mb in microbatches])
        sums = dict(zip(self._metric_keys, per_mb[:, :-1].sum(axis=0).tolist()))
        if skip:
            sums = _over_computed_tokens(sums, sum(t for i, t in enumerate(mb_tokens) if i not in skip),
                                         float(num_tokens))
        metrics = finalize_metrics(sums)
        metrics.update(
            grad_norm=float(grad_norm),
            grad_norm_sq=float(grad_norm) ** 2,
            microbatch_grad_norm_sq=per_mb[:, -1].tolist(),
            microbatch_tokens=mb_tokens,
            tokens=int(num_tokens),
            num_microbatches=len(microbatches),
        )
        if self.cfg.skip_zero_advantage:
            metrics["skipped_microbatches"] = len(skip)
        if units is not None:
            ends = np.cumsum([0, *units])
            if unit_sq is not None:
                unit_sq = [float(x) for x in unit_sq]
            elif len(units) == 1:  # the whole batch is the one unit
                unit_sq = [float(grad_norm) ** 2]
            else:  # one microbatch per unit
                unit_sq = per_mb[:, -1].tolist()
            metrics.update(unit_grad_norm_sq=unit_sq,
                           unit_tokens=[float(sum(mb_tokens[a:b])) for a, b in zip(ends[:-1], ends[1:])])
            if batch_sq is not None:  # the units' objective is not the trained one: its batch |g|^2
                metrics["unit_batch_grad_norm_sq"] = float(batch_sq)
        metrics.update({k: float(v) for k, v in hyper.items()})
        return LearnerState(new_params, opt_state, state.step), metrics

    def _skipped(self, microbatches, whole: WholeBatch | None) -> frozenset:
        """Indices of the microbatches whose gradient pass is skipped (learner.skip_zero_advantage):
        those without a signal, judged on the whole microbatch (every process skips the same)."""
        if not self.cfg.skip_zero_advantage:
            return frozenset()
        signal = whole.signal if whole is not None and whole.signal else [has_signal(mb) for mb in microbatches]
        return frozenset(i for i, x in enumerate(signal) if not x)

    def set_hyperparams(self, state: LearnerState, **values: float) -> LearnerState:
        """State with new optimizer hyperparameters (lr/learning_rate, b1, b2, eps); no recompile."""
        return state._replace(opt_state=optim.set_hyperparams(state.opt_state, **values))

    def get_hyperparams(self, state: LearnerState) -> dict[str, float]:
        """The optimizer hyperparameters of `state` as host floats."""
        return optim.get_hyperparams(state.opt_state)

    def cache_sizes(self) -> dict[str, int]:
        """Compiled-executable counts of the jitted functions (for no-recompilation checks);
        accumulate_apply (one-microbatch minibatches) only once it has run."""
        def size(fn, twin):
            return fn._cache_size() + (twin._cache_size() if twin is not fn else 0)
        sizes = {
            "zeros": self._zeros._cache_size(),
            "accumulate": size(self._accumulate, self._accumulate_proximal),
            "apply": self._apply._cache_size(),
        }
        fused = size(self._accumulate_apply, self._accumulate_apply_proximal)
        return {**sizes, "accumulate_apply": fused} if fused else sizes


class AdamInParts:
    """(params, opt_state, grads) -> (new params, new opt_state, grad norm) as three jitted
    programs: the gradient clipped, the moments' update, the params' (GRPOTrainStep._apply_jits)."""

    def __init__(self, clip, moments, params):
        self.clip, self.moments, self.params = clip, moments, params

    def __call__(self, params, opt_state, grads):
        clipped, grad_norm = self.clip(grads)
        opt_state = self.moments(params, opt_state, clipped)
        return self.params(params, opt_state, clipped), opt_state, grad_norm

    def _cache_size(self) -> int:
        return max(self.clip._cache_size(), self.moments._cache_size(), self.params._cache_size())


def int_vector(values, layout: sharding.Layout | None) -> jax.Array:
    """A small int32 vector argument of a jitted step (a dropout key's step, minibatch,
    microbatch), replicated over the layout's mesh when there is one."""
    host = np.asarray(values, np.int32)
    return jnp.asarray(host) if layout is None else jax.device_put(host, layout.replicated)


def master_copy(params):
    """float32 copies of the params (learner.master_weights); float32 leaves are kept as they are."""
    return jax.tree.map(lambda x: x if x.dtype == jnp.float32 else x.astype(jnp.float32), params)
