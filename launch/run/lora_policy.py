"""A LoRA run's policy outside the train step: what actors, evaluation and exports see.

The learner trains adapters on a frozen base (learner/models/lora.py); everything outside the
train step wants the plain model's params whole on process 0: base + alpha / r * A B. The base
never changes, so it is brought whole to process 0 once; each new version brings only the
adapters (megabytes, one gather from the shards of a mesh or of several learner processes) and
merges them there. On one device nothing moves: the merge runs where the params are.

    policy = LoraPolicy(procs, lora_cfg, train_step.frozen)   # after train_step.init; the base, once
    adapters = policy.whole_adapters(state.params)            # whole on process 0 (every process joins)
    params = policy.merged(adapters)                          # what actor threads and evaluation run
    params = policy(state.params)                             # both

Actor processes are sent the whole adapters alone and merge them into their own base
(launch/cluster/actor_process.py). The final params a run saves are merged on the learner's mesh
by every process (`save_merged`), as a full-weight run's are written, shard by shard.
"""
from __future__ import annotations

import functools

import jax

from cadence.learner import sharding
from cadence.learner.models import lora


class LoraPolicy:
    """Base (whole, once) + adapters (whole, per version) merged on process 0."""

    def __init__(self, procs, lora_cfg, base):
        self._procs = procs
        leaves, treedef = jax.tree.flatten(base)
        # procs.fetch: the leaves of the params the learner group started from (a collective on a
        # group; already whole on one device). Its dtype is the model's: the base never has masters.
        self.base = jax.tree.unflatten(treedef, procs.fetch(leaves))
        self._merge = jax.jit(functools.partial(lora.merge_weights, lora_cfg=lora_cfg))

    def whole_adapters(self, adapters):
        """The adapters whole on process 0, float32 as trained (every process joins a group's gather)."""
        procs = self._procs
        if procs.leader is not None:
            return procs.leader.gather(adapters)
        return sharding.gather(adapters, procs.layout)

    def merged(self, whole_adapters):
        """The plain model's params: the base with alpha / r * A B added to every targeted kernel."""
        return self._merge(self.base, whole_adapters)

    def __call__(self, adapters):
        return self.merged(self.whole_adapters(adapters))


def save_merged(train_step, save):
    """save(run_dir, params) for a LoRA state's adapters: every learner process merges its shards of
    base + adapters on the mesh (train_step.policy_params) and writes them, as a full-weight run
    writes its params."""
    return lambda run_dir, adapters: save(run_dir, train_step.policy_params(adapters))


class LoraWeights:
    """Where a LoRA run's loop publishes: actor threads get the adapters merged into the base,
    actor processes the whole adapters alone, which they merge into the base they read themselves."""

    def __init__(self, pipe, policy: LoraPolicy):
        self.pipe, self.policy = pipe, policy

    def publish(self, adapters, version: int) -> None:
        whole = self.policy.whole_adapters(adapters)
        self.pipe.publish(self.policy.merged(whole), version, remote=whole)
