"""The jitted PPO train step: a learned value function, GAE, and the GRPO family's policy loss.

Host loop per update (PPOTrainStep.update):
  for mb:  adv, ret, old_v, ref_lp, sums = prepare(policy, critic, ref, pack(mb))  # start of step
  mean, std = batch statistics of the GAE advantages (whitening)
  grads = zeros((policy, critic))
  for mb:  grads, stats = accumulate(policy, critic, grads, pack(mb), prepared, normalizers)
  policy, critic, opt states = apply(...)          # two Adams: actor lr and critic lr

The critic is either a linear value head on the policy's final hidden states (shared trunk: the
value loss also shapes the trunk, at the actor's learning rate) or a separate model of the same
architecture with its own head. Values, returns and advantages are computed once, at the start of
the step, with the policy and critic as they are then (the proximal policy of the decoupled
objective); the reference policy for the KL penalty is a frozen copy of the params given to init.
The state's `params` stay the plain policy params, so publishing them to the engine is unchanged.
With a layout (learner/sharding.py) the jitted functions get explicit shardings: the policy, a
separate critic trunk and the reference split like the params, the value head replicated, rows of
microbatches and of the prepared arrays over data x fsdp.

LoRA (learner.lora.rank > 0): the policy is adapters on a frozen base (learner/models/lora.py), and
so is everything PPO would otherwise copy whole. What trains:
  - the policy's adapters (state.params);
  - the value head (D + 1 floats), fully; with critic=value_head (a shared trunk) the value loss also reaches the trunk,
    whose only trainable part is the policy's adapters;
  - critic=separate: its own adapters on the same frozen base (starting as a copy of the policy's,
    as a full critic trunk starts as a copy of the params), never a full trunk: that copy and its
    Adam moments are the memory LoRA exists to save.
The reference policy for the KL penalty is the frozen base with a copy of the adapters init was
given (the base itself unless a warm-up trained them: what PEFT users get with disable_adapter()).
The base enters every jitted call as one more argument (`frozen`), as in the GRPO step; with
learner.lora.dropout > 0 the loss's forward drops adapter inputs (masks keyed by learner.seed, the
step and the microbatch) and the start-of-step pass (values, advantages, reference) does not.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cadence.learner import optimizer as optim
from cadence.learner import sharding
from cadence.learner.algorithms import ppo as ppo_ops
from cadence.learner.algorithms.grpo import finalize_metrics, grpo_token_loss, token_sum
from cadence.learner.algorithms.logprobs import chunked_token_logprobs
from cadence.learner.batching import Microbatch, pack_microbatch, unpack_microbatch
from cadence.learner.config import LearnerConfig
from cadence.learner.models import lora
from cadence.learner.steps.grpo_step import (WholeBatch, _sum_squares, check_temperature, count_sequences, int_vector,
                                              master_copy)


class PPOState(NamedTuple):
    """Everything the PPO step updates; `params` is the policy (what actors sample with)."""

    params: Any  # policy parameters (nnx.State of the Llama)
    opt_state: Any  # the actor's Adam state (hyperparameters inside)
    step: int  # host int: optimizer updates applied so far
    critic_params: Any  # {"head": {"w": [D], "b": []}} (+ "trunk": Llama params if separate)
    critic_opt_state: Any  # the critic's Adam state
    ref_params: Any  # frozen reference policy for the KL penalty, or None (kl_coef == 0)


def _hidden(graphdef, params, tokens, positions, mask, remat: str = "none") -> tuple[jax.Array, Any]:
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, positions, mask, remat=remat)  # [B, T, D]
    return hidden, model


def _values(head, hidden) -> jax.Array:
    """[B, T, D] -> [B, T] values aligned with tokens: V for token t reads hidden[t - 1]."""
    v = hidden.astype(jnp.float32) @ head["w"] + head["b"]  # [B, T]
    return jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], axis=1)


class PPOTrainStep:
    """PPO learner update with the GRPOTrainStep interface (init, update, set_hyperparams, cache_sizes).

    Args:
      graphdef: the policy's nnx GraphDef (the critic trunk, if separate, shares it).
      cfg: LearnerConfig (optimizer, grpo for the policy loss, ppo for the critic side).
      layout: a learner.sharding.Layout to run on a device mesh (None: one device).
      completion_budget: engine.max_new_tokens, the divisor of the seq_sum_norm aggregation
        unless grpo.aggregation_constant is set.
      temperature: the sampler's temperature (engine.temperature); the policy's and the
        reference's logits are divided by it.
    """

    def __init__(self, graphdef, cfg: LearnerConfig, layout: sharding.Layout | None = None, *,
                 completion_budget: int = 0, temperature: float = 1.0):
        self.cfg = cfg
        self.completion_budget = int(completion_budget)
        self.temperature = check_temperature(temperature)
        self.graphdef = graphdef
        self.layout = layout
        self.optimizer = optim.make_optimizer(cfg.optimizer)
        self.critic_optimizer = optim.make_optimizer(
            dataclasses.replace(cfg.optimizer, lr=cfg.ppo.critic_lr))
        self._metric_keys: tuple[str, ...] | None = None
        self._copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
        self.lora = cfg.lora if cfg.lora.rank > 0 else None
        self.dropout = self.lora.dropout if self.lora is not None else 0.0
        self._base = None  # LoRA: the frozen base (set by init)
        self._adapter_shardings = None  # LoRA on a mesh: the adapters' (set by init)
        self._merge = jax.jit(functools.partial(lora.merge_weights, lora_cfg=self.lora)) if self.lora else None
        if layout is None:
            self._zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))
            self._prepare = jax.jit(self._prepare_impl)
            self._accumulate = jax.jit(self._accumulate_impl, donate_argnums=(2,))
            self._apply = jax.jit(self._apply_impl, donate_argnums=(4,))
            self._init_opt = functools.partial(sharding.init_opt_state, self.optimizer)
            self._init_critic_opt = functools.partial(sharding.init_opt_state, self.critic_optimizer)

    def _shard(self, critic_abstract, adapters=None) -> None:
        """The jitted functions with explicit shardings, once the critic's shape is known
        (LoRA: and the adapters', which then stand for the params: policy, critic trunk, reference)."""
        lay = self.layout
        p, b, r = lay.params, lay.batch, lay.replicated
        o = lay.opt_state(self.optimizer)
        frozen = ()
        if adapters is not None:
            p, o = lay.trained_shardings(adapters, self.optimizer)
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), adapters)
            frozen = (lay.params, r) if self.dropout else (lay.params,)  # (base[, noise])
            if "trunk" in critic_abstract:
                critic_abstract = {**critic_abstract, "trunk": abstract}
        c = {"head": {"w": r, "b": r}}
        if "trunk" in critic_abstract:
            c["trunk"] = p
        ref = p if self.cfg.ppo.kl_coef > 0 else None
        oc = lay.opt_state(self.critic_optimizer, c, critic_abstract)
        prepared = (b, b, b, b)
        self._copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), in_shardings=(p,), out_shardings=p)
        self._zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree),
                              in_shardings=((p, c),), out_shardings=(p, c))
        self._prepare = jax.jit(lay.activations(self._prepare_impl), in_shardings=(p, c, ref, b, *frozen[:1]),
                                out_shardings=(prepared, r))
        self._accumulate = jax.jit(lay.activations(self._accumulate_impl), donate_argnums=(2,),
                                   in_shardings=(p, c, (p, c), b, prepared, r, *frozen),
                                   out_shardings=((p, c), r))
        self._apply = jax.jit(self._apply_impl, donate_argnums=(4,), in_shardings=(p, o, c, oc, (p, c)),
                              out_shardings=(p, o, c, oc, r, r))
        if adapters is not None:
            self._merge = jax.jit(functools.partial(lora.merge_weights, lora_cfg=self.lora),
                                  in_shardings=(lay.params, p), out_shardings=lay.params)
            self._adapter_shardings = p
        self._init_opt = jax.jit(functools.partial(sharding.init_opt_state, self.optimizer),
                                 in_shardings=(p,), out_shardings=o)
        self._init_critic_opt = jax.jit(functools.partial(sharding.init_opt_state, self.critic_optimizer),
                                        in_shardings=(c,), out_shardings=oc)

    # ---- pure functions (traced) ----

    def _forward(self, params, critic_params, mb: Microbatch, frozen=None, noise=None):
        """(logprobs [M, T], entropy [M, T] or None, values [M, T]) of the policy and critic; the
        entropy (a softmax over the vocabulary) only when the loss has an entropy bonus. Both
        learner.logits_chunk positions at a time when set. frozen: a LoRA run's base (params and
        a separate critic's trunk are then adapters); noise: int32 [step, 0, microbatch] keying
        adapter dropout (the loss's forward of a learner.lora.dropout > 0 run)."""
        trunk = critic_params.get("trunk")
        if frozen is not None:
            params = lora.join(frozen, params)
            trunk = None if trunk is None else lora.join(frozen, trunk)
        key = None if noise is None else lora.dropout_key(self.cfg.seed, *noise)
        with lora.adapter_dropout(key, self.dropout):
            hidden, model = _hidden(self.graphdef, params, mb.tokens, mb.positions, mb.mask, self.cfg.remat)
            grpo = self.cfg.grpo
            logprobs, entropy, _ = chunked_token_logprobs(hidden, model.logits, mb.tokens, self.temperature,
                                                          self.cfg.logits_chunk, entropy=grpo.entropy_coef > 0)
            if trunk is not None:
                hidden, _ = _hidden(self.graphdef, trunk, mb.tokens, mb.positions, mb.mask, self.cfg.remat)
        return logprobs, entropy, _values(critic_params["head"], hidden)

    def _ref_logprobs(self, ref_params, mb: Microbatch, frozen=None):
        if ref_params is None:
            return jnp.zeros(mb.tokens.shape, jnp.float32)
        if frozen is not None:
            ref_params = lora.join(frozen, ref_params)
        hidden, model = _hidden(self.graphdef, ref_params, mb.tokens, mb.positions, mb.mask)
        return chunked_token_logprobs(hidden, model.logits, mb.tokens, self.temperature,
                                      self.cfg.logits_chunk).logprobs

    def _prepare_impl(self, params, critic_params, ref_params, packed, frozen=None):
        ppo = self.cfg.ppo
        mb = unpack_microbatch(packed, has_rewards=True)
        mask = mb.loss_mask
        logprobs, _, values = self._forward(params, critic_params, mb, frozen)
        ref_lp = self._ref_logprobs(ref_params, mb, frozen)
        kl = ppo_ops.kl_estimate(logprobs, ref_lp, ppo.kl_estimator) * mask  # [M, T]
        shaped = ref_params is not None and ppo.kl_placement == "reward"
        rewards = ppo_ops.token_rewards(mb.rewards, mask, kl if shaped else None, ppo.kl_coef)
        adv, returns = ppo_ops.gae(rewards, values, mask, ppo.gamma, ppo.gae_lambda)  # [M, T]
        sums = jnp.stack([jnp.sum(adv * mask), jnp.sum(adv * adv * mask), jnp.sum(kl)])  # [3]
        return (adv, returns, values * mask, ref_lp), sums

    def loss_fn(self, params, critic_params, mb: Microbatch, prepared, normalizers, frozen=None, noise=None):
        """Total loss of one microbatch (policy + value_coef * value [+ KL]); (loss, metrics).

        normalizers: [4] float32: global tokens, global sequences, advantage mean and std.
        frozen, noise: a LoRA run's base and dropout key (see _forward).
        """
        ppo, grpo = self.cfg.ppo, self.cfg.grpo
        num_tokens, num_sequences, adv_mean, adv_std = (normalizers[i] for i in range(4))
        adv, returns, old_values, ref_lp = prepared
        mask = mb.loss_mask
        logprobs, entropy, values = self._forward(params, critic_params, mb, frozen, noise)
        if ppo.whiten_advantages:
            adv = ppo_ops.whiten(adv, mask, adv_mean, adv_std)
        pg_loss, metrics = grpo_token_loss(
            logprobs, mb.behavior_logprobs, adv, mask, num_tokens, grpo, entropy=entropy,
            num_sequences=num_sequences, completion_budget=self.completion_budget)
        v_loss = token_sum(ppo_ops.value_loss(values, old_values, returns, ppo.value_clip),
                           mask, num_tokens)
        loss = pg_loss + ppo.value_coef * v_loss
        sg = jax.lax.stop_gradient
        if self.cfg.ppo.kl_coef > 0:
            kl = token_sum(ppo_ops.kl_estimate(jnp.where(mask > 0, logprobs, 0.0), ref_lp,
                                               ppo.kl_estimator), mask, num_tokens)
            if ppo.kl_placement == "loss":
                loss = loss + ppo.kl_coef * kl
            metrics["kl_ref"] = sg(kl)
        residual = sg(returns - values)
        metrics.update(
            loss=sg(loss),
            value_loss=sg(v_loss),
            value_mean=token_sum(sg(values), mask, num_tokens),
            return_mean=token_sum(returns, mask, num_tokens),
            return_sq_mean=token_sum(returns * returns, mask, num_tokens),
            value_residual_mean=token_sum(residual, mask, num_tokens),
            value_residual_sq_mean=token_sum(residual * residual, mask, num_tokens),
            value_clip_frac=token_sum((jnp.abs(sg(values) - old_values) > ppo.value_clip)
                                      .astype(jnp.float32), mask, num_tokens),
        )
        return loss, metrics

    def _accumulate_impl(self, params, critic_params, grads, packed, prepared, normalizers, frozen=None,
                         noise=None):
        mb = unpack_microbatch(packed, has_rewards=True)
        (_, metrics), mb_grads = jax.value_and_grad(self.loss_fn, argnums=(0, 1), has_aux=True)(
            params, critic_params, mb, prepared, normalizers, frozen, noise)
        grads = jax.tree.map(jnp.add, grads, mb_grads)
        stats = jnp.stack([metrics[k].astype(jnp.float32) for k in self._metric_keys]
                          + [_sum_squares(mb_grads[0])])  # [K + 1]
        return grads, stats

    def _apply_impl(self, params, opt_state, critic_params, critic_opt_state, grads):
        actor_grads, critic_grads = sharding.fp32_grads(grads)  # float32 moments
        grad_norm = optax.tree.norm(actor_grads)
        critic_grad_norm = optax.tree.norm(critic_grads)
        updates, opt_state = self.optimizer.update(actor_grads, opt_state, params)
        c_updates, critic_opt_state = self.critic_optimizer.update(
            critic_grads, critic_opt_state, critic_params)
        return (optax.apply_updates(params, updates), opt_state,
                optax.apply_updates(critic_params, c_updates), critic_opt_state,
                grad_norm, critic_grad_norm)

    # ---- host API ----

    def init(self, params) -> PPOState:
        """A fresh PPO state: zero value head (plus a copy of params as critic trunk if
        "separate"), frozen reference = a copy of params when kl_coef > 0, Adam moments at 0."""
        ppo = self.cfg.ppo
        tokens = jnp.zeros((1, 2), jnp.int32)
        shape = jax.eval_shape(
            lambda p: _hidden(self.graphdef, p, tokens, tokens, tokens > -1)[0], params).shape
        adapters = None
        if self.lora is not None:  # LoRA: the state trains adapters; the base stays here, frozen
            params, self._base = lora.split(params)
            adapters = params
        if self.cfg.master_weights:
            params = master_copy(params)
        head = {"w": np.zeros((shape[-1],), np.float32), "b": np.zeros((), np.float32)}
        if self.layout is not None:
            abstract = {"head": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), head)}
            if ppo.critic == "separate":
                abstract["trunk"] = self.layout.abstract
            self._shard(abstract, adapters)
            head = self.layout.place(head, {"w": self.layout.replicated, "b": self.layout.replicated})
            if adapters is not None:
                params = lora.on_mesh(self.layout, params, self._adapter_shardings)
        critic = {"head": jax.tree.map(jnp.asarray, head)}
        if ppo.critic == "separate":
            critic["trunk"] = self._copy(params)
        ref = self._copy(params) if ppo.kl_coef > 0 else None
        return PPOState(params, self._init_opt(params), 0, critic, self._init_critic_opt(critic), ref)

    def accumulate_gradients(self, state: PPOState, microbatches: Sequence[Microbatch],
                             num_tokens: int, whole: WholeBatch | None = None) -> tuple[Any, list, dict]:
        """Start-of-step values/advantages, then the full-batch gradient summed over microbatches
        (whole: as for GRPOTrainStep.update, when they hold only this process's rows).

        Returns:
          ((policy grads, critic grads), per-microbatch [K + 1] stat vectors (metric_keys order,
          then that microbatch's policy grad-norm^2), host stats of the preparation:
          advantage_mean, advantage_std (GAE, before whitening), kl_ref_start).
        """
        if not microbatches:
            raise ValueError("accumulate_gradients: no microbatches")
        host = [pack_microbatch(mb, include_rewards=True) for mb in microbatches]
        if self.layout is None:
            packed = jax.device_put(host)
        else:
            packed = self.layout.put_batch(host) if whole is None else self.layout.put_process_rows(host, whole.rows)
        frozen = () if self.lora is None else (self._base,)
        prepared, sums = [], []
        for p in packed:
            out, s = self._prepare(state.params, state.critic_params, state.ref_params, p, *frozen)
            prepared.append(out)
            sums.append(s)
        n_tok = float(max(int(num_tokens), 1))
        adv_sum, adv_sq_sum, kl_sum = np.asarray(jax.device_get(sums), np.float64).sum(axis=0)
        adv_mean = float(adv_sum / n_tok)
        adv_std = float(np.sqrt(max(adv_sq_sum / n_tok - adv_mean**2, 0.0)))
        sequences = count_sequences(microbatches) if whole is None else sum(whole.sequences)
        normalizers = np.asarray([n_tok, max(sequences, 1), adv_mean, adv_std],
                                 np.float32)
        normalizers = jnp.asarray(normalizers) if self.layout is None else self.layout.scalar(normalizers)
        if self._metric_keys is None:  # abstract trace (no compile) for the metric names
            mb0 = unpack_microbatch(packed[0], has_rewards=True)
            _, shapes = jax.eval_shape(self.loss_fn, state.params, state.critic_params, mb0,
                                       prepared[0], normalizers, *frozen)
            self._metric_keys = tuple(sorted(shapes))
        grads = self._zeros((state.params, state.critic_params))
        per_mb = []
        for i, (p, prep) in enumerate(zip(packed, prepared)):
            noise = (int_vector((state.step, 0, i), self.layout),) if self.dropout else ()
            grads, stats = self._accumulate(state.params, state.critic_params, grads, p, prep,
                                            normalizers, *frozen, *noise)
            per_mb.append(stats)
        info = {"advantage_mean": adv_mean, "advantage_std": adv_std,
                "kl_ref_start": float(kl_sum / n_tok)}
        return grads, per_mb, info

    def update(self, state: PPOState, microbatches: Sequence[Microbatch], num_tokens: int,
               whole: WholeBatch | None = None, units=None, unit_objective: str = "trained"
               ) -> tuple[PPOState, dict]:
        """One PPO update on the whole batch (microbatches from build_microbatches, with rewards).

        units and unit_objective (GRPOTrainStep.update's) are accepted and unused: a critic's
        advantages do not tie a group's samples together, so the microbatches are the noise
        scale's small batches, parts of the trained (clipped) gradient: on stale batches the clip's
        bias stays in PPO's estimate (ControllerConfig.noise_objective).

        Returns:
          (new state, host metrics): those of GRPOTrainStep.update (loss, pg_loss, clip_frac, ess,
          mismatch_kl, entropy_sampled, entropy, grad_norm, microbatch_grad_norm_sq, ...) plus value_loss,
          value_mean, return_mean, explained_variance, value_clip_frac, advantage_mean / _std
          (GAE, before whitening), kl_ref and kl_ref_start (if kl_coef > 0), critic_grad_norm.
        """
        grads, per_mb, info = self.accumulate_gradients(state, microbatches, num_tokens, whole)
        params, opt_state, critic, critic_opt, grad_norm, critic_norm = self._apply(
            state.params, state.opt_state, state.critic_params, state.critic_opt_state, grads)
        hyper = optim.hyperparam_arrays(opt_state)
        per_mb, grad_norm, critic_norm, hyper = jax.device_get((per_mb, grad_norm, critic_norm, hyper))
        per_mb = np.stack(per_mb).astype(np.float64)  # [num_mb, K + 1]
        metrics = finalize_metrics(dict(zip(self._metric_keys, per_mb[:, :-1].sum(axis=0).tolist())))
        ret_var = metrics["return_sq_mean"] - metrics["return_mean"] ** 2
        res_var = metrics["value_residual_sq_mean"] - metrics["value_residual_mean"] ** 2
        metrics.update(
            explained_variance=1.0 - res_var / ret_var if ret_var > 1e-12 else 0.0,
            advantage_mean=info["advantage_mean"], advantage_std=info["advantage_std"],
            grad_norm=float(grad_norm), grad_norm_sq=float(grad_norm) ** 2,
            critic_grad_norm=float(critic_norm),
            microbatch_grad_norm_sq=per_mb[:, -1].tolist(),
            microbatch_tokens=(list(whole.loss_tokens) if whole is not None
                               else [float(np.asarray(mb.loss_mask).sum()) for mb in microbatches]),
            tokens=int(num_tokens), num_microbatches=len(microbatches), step=state.step + 1,
        )
        if state.ref_params is not None:
            metrics["kl_ref_start"] = info["kl_ref_start"]  # at the start of the step
        metrics.update({k: float(v) for k, v in hyper.items()})
        return PPOState(params, opt_state, state.step + 1, critic, critic_opt,
                        state.ref_params), metrics

    @property
    def metric_keys(self) -> tuple[str, ...]:
        """Names of the additive loss metrics (known after the first update)."""
        return self._metric_keys or ()

    def policy_params(self, params):
        """The policy `params` (a state's) stand for, as the plain model's params: LoRA merges
        base + alpha / r * A B; otherwise params themselves."""
        return params if self.lora is None else self._merge(self._base, params)

    @property
    def frozen(self):
        """A LoRA run's base params (None otherwise, or before init)."""
        return self._base

    def set_hyperparams(self, state: PPOState, **values: float) -> PPOState:
        """New actor Adam hyperparameters (lr/learning_rate, b1, b2, eps); the critic follows.

        The critic trains on the same batch, so a batch-size rule applies to it too: it takes the
        same betas and eps, and its lr keeps its configured ratio to the actor's
        (critic_lr / optimizer.lr), whatever rule produced the actor's values.
        """
        ratio = self.cfg.ppo.critic_lr / self.cfg.optimizer.lr
        critic = {k: v * ratio if k in ("lr", "learning_rate") else v for k, v in values.items()}
        return state._replace(opt_state=optim.set_hyperparams(state.opt_state, **values),
                              critic_opt_state=optim.set_hyperparams(state.critic_opt_state, **critic))

    def get_critic_hyperparams(self, state: PPOState) -> dict[str, float]:
        """The critic's optimizer hyperparameters as host floats."""
        return optim.get_hyperparams(state.critic_opt_state)

    def get_hyperparams(self, state: PPOState) -> dict[str, float]:
        """The actor's optimizer hyperparameters as host floats."""
        return optim.get_hyperparams(state.opt_state)

    def cache_sizes(self) -> dict[str, int]:
        """Compiled-executable counts of the jitted functions (for no-recompilation checks)."""
        return {"zeros": self._zeros._cache_size(), "prepare": self._prepare._cache_size(),
                "accumulate": self._accumulate._cache_size(), "apply": self._apply._cache_size()}
