"""Learner sub-configs: optimizer, GRPO-family objective, PPO critic, warm-up, and the learner.

Each is a frozen dataclass whose `validate()` raises ValueError("<field>: <problem>"); the config
loader prefixes the dotted key of the sub-config. `LearnerConfig.validate()` also validates its
nested sub-configs and prefixes their field names with the sub-config's key (e.g. "grpo.clip_low").
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adam(W) with global-norm clipping; lr/b1/b2/eps can be changed between steps."""

    lr: float = 1e-3  # Adam learning rate (1e-3 reaches the sort-6 target fastest; 3e-3 diverges).
    b1: float = 0.9  # Adam first-moment decay.
    b2: float = 0.99  # Adam second-moment decay.
    eps: float = 1e-8  # Adam denominator epsilon.
    weight_decay: float = 0.0  # Decoupled weight decay (AdamW); 0 uses plain Adam.
    max_grad_norm: float = 1.0  # Global-norm gradient clipping threshold; 0 disables clipping.

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}: must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"eps: must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be >= 0 (0 disables), got {self.max_grad_norm}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The GRPO objective: group advantages, clipped surrogate, off-policy correction."""

    scale_by_std: bool = True  # Divide group-centered rewards by the group std (False: Dr.GRPO).
    std_eps: float = 1e-6  # Added to the group std before dividing.
    clip_low: float = 0.2  # Lower clip: ratio is clipped at 1 - clip_low.
    clip_high: float = 0.2  # Upper clip: ratio is clipped at 1 + clip_high (clip-higher if larger).
    # Dual-clip PPO: with a negative advantage a ratio above this contributes dual_clip * A and no
    # gradient (stale tokens with r up to e^20 would otherwise dominate); 0 disables it.
    dual_clip: float = 3.0
    # How the sampler/learner mismatch is corrected: "coupled" (PPO ratio vs the sampler, clipped),
    # "decoupled" (AReaL: ratio vs the proximal policy, times a truncated behavior importance
    # weight), "none" (plain on-policy gradient; behavior logprobs only measured). Default coupled:
    # with one update per batch the proximal ratio is 1, so decoupled keeps only the capped weight
    # and no trust region; at max_staleness=1 on sort-6 coupled needed 24-31k samples to the
    # target where decoupled needed 49-70k and none did not get there in 800 steps (2 seeds).
    # With max_staleness=0 all three are the same objective.
    correction: Literal["decoupled", "coupled", "none"] = "coupled"
    is_cap: float = 2.0  # Truncation cap of the behavior importance weight; <= 0 disables the cap.
    # Which behavior logprobs the correction uses under top-p: "full" (log-softmax over the whole
    # vocabulary, what the learner recomputes: sampler == learner gives ratio 1) or "nucleus"
    # (logprob - kept_logmass: the probability the token was actually drawn with).
    behavior_logprobs: Literal["full", "nucleus"] = "full"
    # Weight of the token-mean entropy bonus (subtracted from the loss). On by default: from a
    # pretrained checkpoint Cadence did not make (the sort6-sft-llama fixture) the policy's EOS
    # decision collapsed without it (held-out EM 0.0 from update 50 on; seed 0 never reached 0.5
    # in 1,500 updates, with or without the dual clip, sync or async), and with 0.01 seeds 0, 1, 2
    # reached it in 55k / 60k / 96k samples; the built-in default run needs the same samples
    # (docs/results/fixture_defaults.md). It costs the exact entropy, computed chunk by chunk.
    entropy_coef: float = 0.01
    # Which tokens the bonus acts on: "signal" (those of samples with a nonzero advantage, i.e.
    # whose group's rewards differ; divided by all tokens, so the bonus shrinks with the share of
    # groups that carry a signal) or "all" (every completion token). "signal" because from SmolLM2
    # under a sparse reward most groups are all-wrong, the bonus was then their only gradient, and
    # it raised entropy and cost held-out accuracy (examples/smollm2-word-problems/README.md);
    # under the fixture's partial credit nearly every group has a signal and nothing changes.
    entropy_scope: Literal["signal", "all"] = "signal"
    # Which std divides the group-centered rewards when scale_by_std: each group's own ("group",
    # GRPO) or the std of all centered rewards of the batch ("batch", robust to easy prompts).
    std_scope: Literal["group", "batch"] = "group"
    # Loss aggregation over tokens: "token_mean" (every token weighs the same, DAPO),
    # "seq_mean_token_mean" (mean over each sequence, then over sequences: original GRPO),
    # "seq_sum_norm" (each sequence's sum / aggregation_constant, mean over sequences: Dr.GRPO).
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_sum_norm"] = "token_mean"
    aggregation_constant: int = 0  # Divisor of seq_sum_norm; 0 uses the completion budget (engine.max_new_tokens).
    # Importance ratio per token (PPO/GRPO) or per sequence as the geometric mean of its token
    # ratios (GSPO; use with a small clip range, e.g. clip_low=3e-4, clip_high=4e-4).
    importance_level: Literal["token", "sequence"] = "token"
    dynamic_sampling: bool = False  # Drop groups with zero advantage variance, draw until full (DAPO).
    # Dynamic sampling guard: after this many groups dropped in a row the next one is kept anyway
    # (a converged policy would otherwise wait forever); counted as "dynamic_sampling_guard".
    max_consecutive_drops: int = 1024

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        if not self.std_eps >= 0:
            raise ValueError(f"std_eps: must be >= 0, got {self.std_eps}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low: must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"clip_high: must be >= 0, got {self.clip_high}")
        if self.dual_clip != 0 and not self.dual_clip > 1.0 + self.clip_high:
            raise ValueError(f"dual_clip: must be 0 (off) or > 1 + clip_high = {1.0 + self.clip_high}, "
                             f"got {self.dual_clip}")
        if self.correction not in ("decoupled", "coupled", "none"):
            raise ValueError(
                f"correction: must be one of 'decoupled', 'coupled', 'none', got {self.correction!r}"
            )
        _check_choice("behavior_logprobs", self.behavior_logprobs, ("full", "nucleus"))
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef: must be >= 0, got {self.entropy_coef}")
        _check_choice("entropy_scope", self.entropy_scope, ("signal", "all"))
        _check_choice("std_scope", self.std_scope, ("group", "batch"))
        _check_choice("aggregation", self.aggregation,
                      ("token_mean", "seq_mean_token_mean", "seq_sum_norm"))
        if self.aggregation_constant < 0:
            raise ValueError(f"aggregation_constant: must be >= 0, got {self.aggregation_constant}")
        _check_choice("importance_level", self.importance_level, ("token", "sequence"))
        if self.max_consecutive_drops < 1:
            raise ValueError(f"max_consecutive_drops: must be >= 1, got {self.max_consecutive_drops}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO with a learned value function: GAE, clipped value loss, optional KL to a reference.

    The policy side reuses GRPOConfig (clip range, off-policy correction, importance level,
    aggregation, entropy bonus); only the advantages come from the critic.
    """

    gamma: float = 1.0  # Discount of the per-token rewards (1: the verifiable reward is undiscounted).
    gae_lambda: float = 0.95  # GAE lambda: 1 is Monte Carlo returns minus V, 0 is one-step TD.
    # "value_head": a linear head on the policy's final hidden states (shared trunk; the value loss
    # also trains the trunk); "separate": a critic model of the same architecture, its own trunk.
    critic: Literal["value_head", "separate"] = "value_head"
    value_coef: float = 0.5  # Weight of the value loss in the total loss.
    value_clip: float = 0.2  # Value-loss clipping around the values at the start of the step; 0 off.
    critic_lr: float = 3e-3  # Adam learning rate of the critic parameters (head, or critic model).
    whiten_advantages: bool = True  # Normalize GAE advantages to zero mean, unit std over the batch.
    kl_coef: float = 0.0  # Weight of the KL penalty to the frozen reference policy; 0 disables it.
    kl_estimator: Literal["k1", "k3"] = "k1"  # k1: log(pi/ref); k3: ref/pi - 1 - log(ref/pi).
    # Where the KL penalty enters: as a per-token reward before GAE ("reward", InstructGPT) or as a
    # differentiable loss term ("loss", GRPO-style).
    kl_placement: Literal["reward", "loss"] = "reward"

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        for name in ("gamma", "gae_lambda"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {value}")
        _check_choice("critic", self.critic, ("value_head", "separate"))
        if self.value_coef < 0:
            raise ValueError(f"value_coef: must be >= 0, got {self.value_coef}")
        if self.value_clip < 0:
            raise ValueError(f"value_clip: must be >= 0 (0 disables), got {self.value_clip}")
        if not self.critic_lr > 0:
            raise ValueError(f"critic_lr: must be > 0, got {self.critic_lr}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        _check_choice("kl_estimator", self.kl_estimator, ("k1", "k3"))
        _check_choice("kl_placement", self.kl_placement, ("reward", "loss"))


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-up on answers before RL."""

    steps: int = 30  # Number of supervised updates.
    lr: float = 3e-3  # Fixed Adam learning rate of the warm-up (its own optimizer).
    batch_size: int = 64  # Examples per supervised update.

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # attention and MLP projections


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on a frozen base (learner/models/lora.py): W x + alpha / rank * B A x.

    With rank > 0 only the adapters train: gradients, Adam's moments (float32 whatever
    model.param_dtype) and the controller's rescales touch nothing else; checkpoints hold the
    adapters and a digest of the base, never the base itself.
    """

    rank: int = 0  # adapter rank r; 0 = off (every weight trains, as without this section)
    alpha: float = 16.0  # scale numerator: the update is alpha / rank * x A B (PEFT's lora_alpha)
    # Which projections get adapters: any of q, k, v, o (attention), gate, up, down (MLP).
    targets: tuple[str, ...] = LORA_TARGETS
    # Dropout on the adapters' input in the train step's gradient pass (PEFT's lora_dropout), masks
    # keyed by learner.seed and the update's step (exact resume); off wherever the policy is sampled,
    # evaluated or its proximal log-probs recomputed. 0 = off.
    dropout: float = 0.0

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>")."""
        if self.rank < 0:
            raise ValueError(f"rank: must be >= 0 (0 = off), got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"alpha: must be > 0, got {self.alpha}")
        if not self.targets:
            raise ValueError(f"targets: must name at least one of {', '.join(LORA_TARGETS)}")
        for name in self.targets:
            if name not in LORA_TARGETS:
                raise ValueError(f"targets: unknown projection {name!r}; choose from {', '.join(LORA_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets: lists a projection twice: {list(self.targets)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The learner's device mesh: named axes data x fsdp x tensor over all devices of all processes.

    Parameters and Adam moments are split by the logical axis names the model declares, mapped to
    mesh axes by learner/sharding.py's rules (override entries with `rules`); the batch is split
    over data x fsdp. One device (the default on a laptop) runs the plain single-device program.
    """

    data: int = 1  # replicas holding whole parameter copies (pure data parallelism); -1 = the rest
    fsdp: int = -1  # devices that split parameters and optimizer state (ZeRO-3) and the batch; -1 = the rest
    tensor: int = 1  # devices that split heads, MLP width and vocabulary (Megatron); -1 = the rest
    # Logical-axis rule overrides, "logical=axis[+axis]" (e.g. "embed=fsdp", "mlp=tensor",
    # "norm=" for replicated); the defaults are learner.sharding.DEFAULT_RULES.
    rules: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>")."""
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"{name}: must be >= 1 or -1 (the rest of the devices), got {size}")
        if sum(size == -1 for size in sizes.values()) > 1:
            raise ValueError("fsdp: at most one mesh axis may be -1 (the rest of the devices)")
        for i, rule in enumerate(self.rules):
            name, sep, axes = rule.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"rules[{i}]: expected 'logical=axis[+axis]', got {rule!r}")
            for axis in filter(None, (a.strip() for a in axes.split("+"))):
                if axis not in sizes:
                    raise ValueError(f"rules[{i}]: unknown mesh axis {axis!r} (have data, fsdp, tensor)")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """jax.distributed for a learner spread over several processes (hosts).

    Unset (the default), a process joins a group only when the environment says so:
    CADENCE_COORDINATOR / CADENCE_NUM_PROCESSES / CADENCE_PROCESS_ID, which `cadence train
    learner.processes=N` sets for the processes it starts.
    """

    coordinator: str = ""  # host:port of process 0's coordination service ("" = environment / auto_detect)
    num_processes: int = 0  # processes in the job (0 = environment / auto_detect)
    process_id: int = -1  # this process's index (-1 = environment / auto_detect)
    # Let JAX detect the cluster (SLURM, Open MPI, TPU pods, GKE) with jax.distributed.initialize().
    auto_detect: bool = False
    # Interface the coordination service listens on ("" = the coordinator's host, so loopback for a
    # local group; a pod sets e.g. "0.0.0.0:PORT" on a private network: the service does not authenticate).
    bind_address: str = ""
    timeout_s: int = 300  # every process must join within this

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>")."""
        if self.num_processes < 0:
            raise ValueError(f"num_processes: must be >= 0, got {self.num_processes}")
        if self.process_id < -1:
            raise ValueError(f"process_id: must be >= -1, got {self.process_id}")
        if self.num_processes and self.process_id >= self.num_processes:
            raise ValueError(f"process_id: must be < num_processes ({self.num_processes}), got {self.process_id}")
        if self.coordinator and ":" not in self.coordinator:
            raise ValueError(f"coordinator: expected host:port, got {self.coordinator!r}")
        if self.timeout_s < 1:
            raise ValueError(f"timeout_s: must be >= 1, got {self.timeout_s}")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """The learner: batch geometry, objective, optimizer, warm-up."""

    algorithm: Literal["grpo", "ppo"] = "grpo"  # Objective: group advantages, or PPO with a critic.
    batch_size: int = 128  # Samples per update (prompts x group_size).
    microbatch_size: int = 32  # Samples per jitted gradient accumulation step.
    # Token budget of a microbatch; > 0 packs samples several to a row (segment ids, positions
    # restarting per sequence, attention within each sequence): rows of seq_len, budget // seq_len
    # rows per microbatch, as many microbatches as the batch's real tokens fill (microbatch_size then
    # only constrains batch sizes). 0 = off: one sample per row. GRPO only.
    microbatch_tokens: int = 0
    group_size: int = 8  # Completions per prompt (G).
    # With packing (microbatch_tokens > 0): a group's completions in a row follow one copy of its
    # prompt, not one each (attention lets each completion see that prefix; positions as if it
    # followed the prompt alone), so a prompt of P tokens costs P - 1 + G tokens, not G x P. The
    # same loss and gradient (tests/learner/shared_prompts_test.py).
    share_prompts: bool = False
    # Length of a packed row; 0 = seq_len (longest prompt + engine.max_new_tokens, the padded row).
    # Longer rows let a shared prompt serve more of its group's completions; attention's cost per
    # row grows with its square. microbatch_tokens must hold whole rows.
    row_tokens: int = 0
    # GRPO: skip the gradient pass of microbatches whose advantages are all zero (groups whose
    # rewards are all equal). Their tokens add exactly nothing to the gradient (the entropy bonus
    # acts only on samples with a signal under entropy_scope=signal), so the update is the same;
    # such groups are laid out in microbatches of their own, and the token-mean metrics (entropy,
    # ratios, clip fractions, mismatch) then cover the computed tokens. Under a sparse reward most
    # groups are flat: SmolLM2 at 5% reward has ~2/3 of them (docs/results/skip_and_share.md).
    skip_zero_advantage: bool = False
    # Optimizer updates per batch (PPO-style minibatches over its microbatches; >1 makes the
    # decoupled correction's clip bind: its proximal policy is the learner at the batch's start).
    minibatches: int = 1
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)  # Adam(W).
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)  # The policy objective.
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)  # Critic side (algorithm=ppo).
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)  # Supervised warm-up.
    seed: int = 0  # Seed of the learner's parameter init.
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)  # Device mesh and sharding rules.
    # Activation rematerialisation per decoder block: "none"; "block" (recompute the block in the
    # backward pass, keeping its weight-matmul outputs); "full" (keep only the block's input).
    remat: Literal["none", "block", "full"] = "none"
    # Token log-probs (and entropy) from the hidden states this many sequence positions at a time,
    # recomputed in the backward pass, so [rows, seq_len, vocab] logits never exist; 0 = whole
    # logits at once, as is any row no longer than a chunk (so the built-in model's rows run as
    # before). 128: one SmolLM2-shaped 8 x 1024 gradient peaks ~4 GB lower (benchmarks/logprobs_bench.py).
    logits_chunk: int = 128
    # Train float32 master copies of bfloat16 params (model.param_dtype=bfloat16): the matmuls
    # still run in model.compute_dtype, actors and exports get the params rounded to bf16. Adam's
    # moments are float32 either way.
    master_weights: bool = False
    processes: int = 1  # Learner processes `cadence train` starts on this machine (>1: the multi-host path, CPU collectives).
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)  # jax.distributed.
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # Low-rank adapters (rank 0 = off).

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>"); nested fields read "<sub>.<field>: ..."."""
        _check_choice("algorithm", self.algorithm, ("grpo", "ppo"))
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.microbatch_size < 1:
            raise ValueError(f"microbatch_size: must be >= 1, got {self.microbatch_size}")
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size}")
        if self.microbatch_tokens < 0:
            raise ValueError(f"microbatch_tokens: must be >= 0 (0 = no packing), got {self.microbatch_tokens}")
        if self.microbatch_tokens > 0 and self.algorithm == "ppo":
            # PPO's values and GAE run along a row: one sequence per row.
            raise ValueError("microbatch_tokens: packing is built for grpo only; ppo needs 0 (one sample per row)")
        if self.row_tokens < 0 or (self.row_tokens and self.microbatch_tokens <= 0):
            raise ValueError(f"row_tokens: a packed row's length (>= 0, with microbatch_tokens > 0), got {self.row_tokens}")
        if self.share_prompts and self.microbatch_tokens <= 0:
            raise ValueError("share_prompts: needs packed rows; set learner.microbatch_tokens > 0")
        if self.skip_zero_advantage and self.algorithm == "ppo":
            raise ValueError("skip_zero_advantage: built for grpo's group advantages; ppo's come from a critic")
        if (self.skip_zero_advantage and self.grpo.entropy_coef > 0 and self.grpo.entropy_scope == "all"):
            raise ValueError("skip_zero_advantage: with grpo.entropy_scope=all the entropy bonus acts on "
                             "groups without a signal too, so skipping them would change the update; "
                             "use grpo.entropy_scope=signal or grpo.entropy_coef=0")
        if self.batch_size % self.microbatch_size:
            raise ValueError(
                f"batch_size: must be a multiple of microbatch_size ({self.microbatch_size}), "
                f"got {self.batch_size}"
            )
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size: must be a multiple of group_size ({self.group_size}), "
                f"got {self.batch_size}"
            )
        if not 1 <= self.minibatches <= self.batch_size // self.microbatch_size:
            raise ValueError(f"minibatches: must be in [1, batch_size / microbatch_size = "
                             f"{self.batch_size // self.microbatch_size}], got {self.minibatches}")
        if self.minibatches > 1 and self.algorithm == "ppo":
            raise ValueError("minibatches: several updates per batch are built for grpo only, not ppo yet")
        _check_choice("remat", self.remat, ("none", "block", "full"))
        if self.logits_chunk < 0:
            raise ValueError(f"logits_chunk: must be >= 0 (0 = unchunked), got {self.logits_chunk}")
        if self.processes < 1:
            raise ValueError(f"processes: must be >= 1, got {self.processes}")
        if self.processes > 1 and (self.distributed.coordinator or self.distributed.auto_detect):
            raise ValueError("processes: starts a local group; leave it at 1 when learner.distributed "
                             "describes the group (one process per host)")
        for key in ("optimizer", "grpo", "ppo", "sft", "mesh", "distributed", "lora"):
            try:
                getattr(self, key).validate()
            except ValueError as err:
                raise ValueError(f"{key}.{err}") from None
