"""Supervised warm-up: cross-entropy on answer tokens, with its own fixed-lr Adam.

Uses the same Microbatch layout as RL (loss_mask on the answer; behavior_logprobs and advantages
unused) so the same model function and padding rules apply.

LoRA (lora: a LoraConfig with rank > 0): params are the LoRA model's (base joined with adapters,
learner/models/lora.py) and only the adapters train, with Adam moments for them alone; the base
goes into the jitted update as an argument, bit for bit unchanged, and `update` returns the joined
params, so the RL step's init takes them as it takes fresh ones. The warm-up runs without adapter
dropout (its masks would need a key a resume never revisits: the warm-up runs once, before RL).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cadence.learner import sharding
from cadence.learner.batching import Microbatch, empty_microbatch
from cadence.learner.config import SFTConfig
from cadence.learner.models import lora as lora_lib
from cadence.learner.steps.grpo_step import LogitsFn
from cadence.learner.steps.scoring import score_tokens


def build_sft_batch(
    prompts_tokens: Sequence[Sequence[int]],
    answers_tokens: Sequence[Sequence[int]],
    seq_len: int,
    pad_id: int,
    batch_size: int | None = None,
    answer_masks: Sequence[Sequence[bool]] | None = None,
) -> Microbatch:
    """Lays out prompt + answer rows (loss_mask on the answer) as one [B, seq_len] Microbatch.

    Args:
      prompts_tokens: per example, the prompt tokens (BOS included, at least one token).
      answers_tokens: per example, the target answer tokens (cut at seq_len if too long).
      seq_len: T, the row length.
      pad_id: padding token id.
      batch_size: if given, pad with empty rows to this many (a fixed jit shape); default
        len(prompts_tokens).
      answer_masks: per example, which answer tokens are trained on (an empty one: all); False
        keeps a token in the context but out of the loss (a tool's output in a multi-turn
        transcript: the model never has to produce it).

    Raises:
      ValueError: mismatched lengths, too many examples, or a prompt that leaves no room.
    """
    if len(prompts_tokens) != len(answers_tokens):
        raise ValueError(f"{len(prompts_tokens)} prompts but {len(answers_tokens)} answers")
    rows = len(prompts_tokens) if batch_size is None else batch_size
    if len(prompts_tokens) > rows:
        raise ValueError(f"{len(prompts_tokens)} examples exceed batch_size {rows}")
    if answer_masks is not None and len(answer_masks) != len(answers_tokens):
        raise ValueError(f"{len(answer_masks)} answer masks for {len(answers_tokens)} answers")
    mb = empty_microbatch(rows, seq_len, pad_id)
    for i, (prompt, answer) in enumerate(zip(prompts_tokens, answers_tokens)):
        p = len(prompt)
        if not 0 < p < seq_len:
            raise ValueError(f"example {i}: prompt of {p} tokens needs 1 <= length < {seq_len}")
        a = min(len(answer), seq_len - p)
        mb.tokens[i, :p] = np.asarray(prompt, np.int32)
        mb.tokens[i, p : p + a] = np.asarray(answer[:a], np.int32)
        mb.mask[i, : p + a] = True
        keep = answer_masks[i] if answer_masks is not None and len(answer_masks[i]) else None
        if keep is not None and len(keep) != len(answer):
            raise ValueError(f"example {i}: answer mask of {len(keep)} for {len(answer)} answer tokens")
        mb.loss_mask[i, p : p + a] = 1.0 if keep is None else np.asarray(keep[:a], np.float32)
    return mb


class SFTStep:
    """One jitted supervised update: token-mean cross-entropy on the answer tokens.

    Args:
      logits_fn: pure (params, tokens, positions, mask) -> logits [B, T, V] (a
        learner.steps.scoring.SplitLogits to chunk rows longer than logits_chunk).
      cfg: SFTConfig (lr is read; steps and batch_size are for the caller's loop).
      layout: a learner.sharding.Layout for a device mesh (None: one device): params and Adam
        split as the layout says, the batch's rows over data x fsdp.
      logits_chunk: learner.logits_chunk (0: whole logits).
    """

    def __init__(self, logits_fn: LogitsFn, cfg: SFTConfig, layout: sharding.Layout | None = None,
                 *, logits_chunk: int = 0, lora=None):
        self.cfg = cfg
        self.optimizer = optax.adam(cfg.lr)
        self.layout = layout
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self._base, self._adapter_shardings = None, None  # LoRA: set by init
        score = functools.partial(score_tokens, logits_fn, chunk=logits_chunk, greedy=True)
        if layout is None:
            self._score = score
            self._update = jax.jit(self._update_impl)
            self._init = functools.partial(sharding.init_opt_state, self.optimizer)
            return
        self._score = layout.activations(score)
        p, o, r = layout.params, layout.opt_state(self.optimizer), layout.replicated
        rows = Microbatch(*([layout.batch] * len(Microbatch._fields)))
        self._update = jax.jit(self._update_impl, in_shardings=(p, o, rows), out_shardings=(p, o, r))
        self._init = jax.jit(functools.partial(sharding.init_opt_state, self.optimizer),
                             in_shardings=(p,), out_shardings=o)

    def loss_fn(self, params, batch: Microbatch) -> tuple[jax.Array, dict]:
        """Mean negative log-likelihood of the answer tokens; (loss, metrics)."""
        # Greedy accuracy: logits[t - 1] must put its argmax on token t.
        scores = self._score(params, batch.tokens, batch.positions, batch.mask)  # [B, T] each
        mask = batch.loss_mask.astype(jnp.float32)  # [B, T]
        tokens = jnp.maximum(jnp.sum(mask), 1.0)
        loss = -jnp.sum(scores.logprobs * mask) / tokens
        accuracy = jnp.sum(scores.greedy * mask) / tokens
        return loss, {"loss": loss, "token_accuracy": accuracy, "tokens": jnp.sum(mask)}

    def _update_impl(self, params, opt_state, batch: Microbatch, frozen=None):
        loss_fn = self.loss_fn if frozen is None else (lambda p, b: self.loss_fn(lora_lib.join(frozen, p), b))
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        grads = sharding.fp32_grads(grads)  # float32 moments
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def init(self, params) -> Any:
        """Fresh Adam state (float32 moments) for `params` (LoRA: for its adapters alone; the
        base is kept here, frozen)."""
        if self.lora is None:
            return self._init(params)
        adapters, self._base = lora_lib.split(params)
        if self.layout is not None:  # the adapters' own shardings (A like its kernel's input axis, B its output)
            lay = self.layout
            (p, o), r = lay.trained_shardings(adapters, self.optimizer), lay.replicated
            rows = Microbatch(*([lay.batch] * len(Microbatch._fields)))
            self._update = jax.jit(self._update_impl, in_shardings=(p, o, rows, lay.params),
                                   out_shardings=(p, o, r))
            self._init = jax.jit(functools.partial(sharding.init_opt_state, self.optimizer),
                                 in_shardings=(p,), out_shardings=o)
            self._adapter_shardings = p
            adapters = lora_lib.on_mesh(lay, adapters, p)
        return self._init(adapters)

    def update(self, params, opt_state, batch: Microbatch, rows: int | None = None) -> tuple[Any, Any, dict]:
        """One Adam step; returns (params, opt_state, metrics as host floats: loss (before the
        step), token_accuracy, tokens). rows: the whole batch's, when `batch` holds only this
        process's rows (Layout.process_rows) of a learner over several processes."""
        if self.layout is not None:  # each process places its own rows
            host = [np.asarray(x) for x in batch]
            batch = Microbatch(*(self.layout.put_batch(host) if rows is None else self.layout.put_process_rows(host, rows)))
        if self.lora is None:
            params, opt_state, metrics = self._update(params, opt_state, batch)
        else:  # the adapters train; the joined params come back with the same base
            adapters, _ = lora_lib.split(params)
            if self.layout is not None:
                adapters = lora_lib.on_mesh(self.layout, adapters, self._adapter_shardings)
            adapters, opt_state, metrics = self._update(adapters, opt_state, batch, self._base)
            params = lora_lib.join(self._base, adapters)
        return params, opt_state, {k: float(v) for k, v in jax.device_get(metrics).items()}
