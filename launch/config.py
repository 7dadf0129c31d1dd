"""The one config tree of a Cadence run, its defaults, and the cross-section checks.

Each section is owned by its package (ModelConfig in learner/models, TaskConfig in actors/tasks,
...); this module only composes them and checks what spans sections. Load with
`load_config(files, overrides)`; any problem raises ConfigError naming the dotted key.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from cadence.actors.config import ActorsConfig
from cadence.actors.engine import EngineConfig
from cadence.actors.tasks.base import is_multi_turn
from cadence.actors.tasks.config import TEXT_TASKS, TaskConfig
from cadence.launch import config_loader
from cadence.launch.config_loader import ConfigError
from cadence.learner.checkpoint import CheckpointConfig
from cadence.learner.config import LearnerConfig
from cadence.learner.controller.config import ControllerConfig
from cadence.learner.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = ""  # run directory; "" = runs/<task>-<UTC time>
    steps: int = 500  # RL updates to run (after the supervised warm-up); sort-6 passes 0.5 exact match at ~250-550
    eval_every: int = 10  # held-out greedy evaluation every this many updates (0 = only at the end)
    eval_every_samples: int = 0  # if > 0: evaluate each time this many more samples were consumed instead (steady while B changes)
    stop_at_exact_match: float = 0.0  # stop early once held-out exact match reaches this (0 = never)
    # where held-out evaluation runs: "learner" (its built-in engine, the whole model on process 0),
    # "actors" (work for the actor processes, any engine: the learner never gathers the model),
    # "auto" (actors when there are actor processes and the learner is sharded, else learner)
    eval_on: Literal["auto", "learner", "actors"] = "auto"
    max_samples: int = 0  # stop once updates have consumed this many samples (0 = no limit)
    progress: bool = True  # print a progress line per evaluation / every few steps
    resume: Literal["no", "auto", "yes"] = "no"  # continue from run.dir's newest checkpoint (auto: if any)
    log_every: int = 5  # progress line every this many updates
    # Watching a run (launch/observe/sinks.py; metrics.jsonl is always written):
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)  # metric sinks: tensorboard = RUN_DIR/tensorboard, wandb = W&B (WANDB_MODE=offline works without network)
    wandb_project: str = "cadence"  # W&B project; the W&B run id is kept in RUN_DIR/wandb.json so --resume continues the same W&B run
    wandb_entity: str = ""  # W&B team or user ("" = the logged-in account's default)
    prometheus_port: int = 0  # serve Prometheus /metrics on this port (0 = off)
    prometheus_host: str = "127.0.0.1"  # address /metrics binds to: loopback unless set (0.0.0.0 exposes it to the network)
    heartbeat_seconds: float = 5.0  # RUN_DIR/heartbeat.json is rewritten this often; `cadence status` reads it
    stall_factor: float = 10.0  # `cadence status` says stalled (exit 7) when no update landed for this many times the slowest of the recent updates (evaluations and checkpoints included)
    # JAX persistent compilation cache: "auto" ($XDG_CACHE_HOME or ~/.cache, /cadence/jax), a directory, or "none"
    jax_cache: str = "auto"
    # After a resume, record a SHA-256 of the restored params in summary["resumed_from"] (checks a
    # reshard onto another process count; gathers the params on process 0 once).
    resume_digest: bool = False

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: must be >= 0, got {self.eval_every}")
        if self.eval_every_samples < 0:
            raise ValueError(f"eval_every_samples: must be >= 0 (0 = use eval_every), got {self.eval_every_samples}")
        if not 0.0 <= self.stop_at_exact_match <= 1.0:
            raise ValueError(f"stop_at_exact_match: must be in [0, 1], got {self.stop_at_exact_match}")
        if self.max_samples < 0:
            raise ValueError(f"max_samples: must be >= 0, got {self.max_samples}")
        if self.log_every < 1:
            raise ValueError(f"log_every: must be >= 1, got {self.log_every}")
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"loggers: each sink once, got {list(self.loggers)}")
        if not 0 <= self.prometheus_port <= 65535:
            raise ValueError(f"prometheus_port: must be a TCP port in 1..65535 (0 = off), got {self.prometheus_port}")
        if self.prometheus_port and not self.prometheus_host:
            raise ValueError("prometheus_host: must name an address to bind (127.0.0.1 = this machine only)")
        if "wandb" in self.loggers and not self.wandb_project:
            raise ValueError("wandb_project: must be set when loggers has wandb")
        if self.heartbeat_seconds <= 0:
            raise ValueError(f"heartbeat_seconds: must be > 0, got {self.heartbeat_seconds}")
        if not self.stall_factor > 1:
            raise ValueError(f"stall_factor: must be > 1 (a multiple of the recent update time), got {self.stall_factor}")


_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """`cadence launch KIND`: what the launcher reserves for the learner and actor processes, and
    what it restarts.

    Per process `*_cpus` CPUs and `*_gpus` GPUs (Ray: a placement-group bundle, with the custom
    resources `*_resources`, "name=amount", e.g. "learner_host=1"; SLURM: each srun step's
    share); `learner.processes` learner processes (one jax.distributed group) and
    `actors.processes` actor processes. A launcher refuses the keys it cannot honour (exit 2).
    """

    learner_cpus: float = 1.0  # CPUs reserved per learner process
    learner_gpus: float = 0.0  # GPUs per learner process (Ray sets CUDA_VISIBLE_DEVICES)
    learner_resources: tuple[str, ...] = ()  # custom resources per learner process, "name=amount"
    learner_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"  # placement of the learner's bundles
    actor_cpus: float = 1.0  # CPUs reserved per actor process
    actor_gpus: float = 0.0  # GPUs per actor process
    actor_resources: tuple[str, ...] = ()  # custom resources per actor process, "name=amount"
    max_restarts: int = 3  # learner group restarts (from the newest checkpoint) before the job fails
    actor_max_restarts: int = -1  # Ray restarts of each actor process (-1 = unlimited)
    # A crash loop: an actor process restarted more than actor_restart_budget times within
    # actor_restart_window_s fails the run (exit 1) with that actor's last error from its log,
    # instead of restarting forever while the learner starves (Ray; 0 = no budget).
    actor_restart_budget: int = 5
    actor_restart_window_s: float = 300.0
    elastic_timeout_s: float = 60.0  # after a learner loss, wait this long for its capacity, then continue on fewer
    min_learner_processes: int = 1  # never continue on fewer learner processes than this
    grow_check_s: float = 10.0  # a shrunk learner checks this often whether capacity returned (0 = never grow)
    place_timeout_s: float = 600.0  # the first placement of every process must succeed within this
    env: tuple[str, ...] = ()  # KEY=VALUE pairs added to every launched process's environment
    actor_env: tuple[str, ...] = ()  # KEY=VALUE pairs for the actor processes only, after env (Ray)
    curve: bool = True  # generate CurveZMQ keys and hand them out through Ray (off only on loopback)

    def validate(self) -> None:
        for name in ("learner_cpus", "learner_gpus", "actor_cpus", "actor_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("learner_resources", "actor_resources", "env", "actor_env"):
            for i, entry in enumerate(getattr(self, name)):
                key, sep, value = entry.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{name}[{i}]: expected NAME=VALUE, got {entry!r}")
                if name not in ("env", "actor_env"):
                    try:
                        float(value)
                    except ValueError:
                        raise ValueError(f"{name}[{i}]: amount {value!r} is not a number") from None
        if self.learner_strategy not in _STRATEGIES:
            raise ValueError(f"learner_strategy: must be one of {_STRATEGIES}, got {self.learner_strategy!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.actor_max_restarts < -1:
            raise ValueError(f"actor_max_restarts: must be >= -1 (-1 = unlimited), got {self.actor_max_restarts}")
        if self.actor_restart_budget < 0:
            raise ValueError(f"actor_restart_budget: must be >= 0 (0 = no budget), got {self.actor_restart_budget}")
        if not self.actor_restart_window_s > 0:
            raise ValueError(f"actor_restart_window_s: must be > 0, got {self.actor_restart_window_s}")
        if self.min_learner_processes < 1:
            raise ValueError(f"min_learner_processes: must be >= 1, got {self.min_learner_processes}")
        for name in ("elastic_timeout_s", "grow_check_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.place_timeout_s > 0:
            raise ValueError(f"place_timeout_s: must be > 0, got {self.place_timeout_s}")


@dataclasses.dataclass(frozen=True)
class Config:
    # Keys that moved: a config using the old one is read as the new one, with a FutureWarning
    # (launch/config_loader.py); setting both to different values is a ConfigError.
    MOVED_KEYS: ClassVar[dict[str, tuple[str, str]]] = {
        "learner.grpo.temperature": ("engine.temperature", "one temperature: the learner scores at the sampler's"),
    }

    run: RunConfig = dataclasses.field(default_factory=RunConfig)  # the run itself
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)  # prompts and rewards
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # the policy network
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)  # built-in JAX sampler
    actors: ActorsConfig = dataclasses.field(default_factory=ActorsConfig)  # generation side
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)  # training side
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)  # batch-size control
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)  # save and resume
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)  # `cadence launch KIND` placement and restarts

    def validate(self) -> None:
        """Checks spanning sections (each section validated itself already). Pure: what needs the
        tokenizer or the task built is checked by `preflight`, where a run starts."""
        if self.task.name in TEXT_TASKS and not self.model.path:
            raise ConfigError(f"task.name: the {self.task.name} task needs a checkpoint tokenizer; set model.path=DIR")
        if (self.learner.grpo.behavior_logprobs == "nucleus" and self.actors.engine == "sglang"
                and self.engine.top_p < 1.0):
            raise ConfigError("learner.grpo.behavior_logprobs: 'nucleus' needs the kept top-p mass, which "
                              "the SGLang engine does not report; use 'full' or actors.engine=jax")
        if self.learner.batch_size % self.learner.group_size:
            raise ConfigError("learner.batch_size: must be a multiple of learner.group_size")
        if self.run.eval_on == "actors" and not actor_processes(self.actors):
            raise ConfigError(f"run.eval_on: 'actors' needs actor processes (actors.processes > 0, or "
                              f"actors.num_actors=0 with actors joining at actors.listen); this run has "
                              f"{self.actors.num_actors} actor threads and no actor processes")
        if self.learner.minibatches > 1 and self.controller.enabled:
            # The noise-scale estimate reads one accumulated gradient per batch.
            raise ConfigError("learner.minibatches: the batch-size controller needs 1 update per batch")


def actor_processes(actors) -> bool:
    """Whether the run's actors are processes (its own, or ones that join at actors.listen, as under
    `cadence launch ray`) rather than threads in the learner's process."""
    return bool(actors.processes) or actors.num_actors == 0


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What `preflight` built to check a config: the model config (a checkpoint's architecture
    when model.path is set), its tokenizer and the task."""

    model: ModelConfig
    tokenizer: object
    task: object


def preflight(cfg: Config) -> Resolved:
    """The checks that need the tokenizer loaded and the task built (files read; a plug-in task's
    factory runs): called where a run starts (`train`), not at load, so loading and printing a
    config has no side effects. Raises ConfigError naming the key (the CLI exits 2)."""
    from cadence.actors.tasks.registry import make_task
    from cadence.learner.models.policy import load_tokenizer, resolve_model_config

    # With model.path the checkpoint decides the architecture and the tokenizer.
    try:
        model = resolve_model_config(cfg.model)
        tokenizer = load_tokenizer(model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {e}") from None
    try:
        task = make_task(cfg.task, tokenizer)
    except OSError as e:
        raise ConfigError(f"task.{'path' if cfg.task.name == 'jsonl' else 'args'}: {e}") from None
    except ValueError as e:  # "<field>: <problem>" of the task section
        raise ConfigError(f"task.{e}") from None
    except Exception as e:  # noqa: BLE001 - a plug-in task's own factory failed
        raise ConfigError(f"task.name: building the task {cfg.task.name!r} failed: "
                          f"{type(e).__name__}: {e}") from None
    multi_turn = is_multi_turn(task)
    if not multi_turn and cfg.engine.max_new_tokens < task.max_completion_len:
        detail = {"jsonl": "the longest answer", "word_problems": "the longest worked solution",
                  "sort": f"task.num_digits={cfg.task.num_digits}",
                  "add_reversed": f"task.num_digits={cfg.task.num_digits}"}.get(cfg.task.name, "this task")
        raise ConfigError(
            f"engine.max_new_tokens: {cfg.engine.max_new_tokens} is shorter than the task's "
            f"answers ({task.max_completion_len} tokens with {detail})")
    # A multi-turn context grows to prompt + episode budget, and each turn may add max_new_tokens.
    need = task.max_prompt_len + cfg.engine.max_new_tokens + (task.max_completion_len if multi_turn else 0)
    if model.max_seq_len < need:
        where = f"the checkpoint's max_position_embeddings ({model.max_seq_len})" if model.path else \
            f"{model.max_seq_len}"
        raise ConfigError(f"model.max_seq_len: {where} < prompt + completion = {need}")
    vocab = tokenizer.vocab_size
    if model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size: {model.vocab_size} < the tokenizer's {vocab} ids")
    return Resolved(model, tokenizer, task)


# The defaults suit the built-in tiny model (30 warm-up steps at lr 3e-3, RL at 1e-3) and would wreck
# a pretrained checkpoint. With model.path set, the keys the user did not set take these values
# (actor 1e-6 and critic 1e-5 are verl's and OpenRLHF's defaults for 0.5-7B models).
PRETRAINED_DEFAULTS = {
    "learner.optimizer.lr": 1e-6,
    "learner.ppo.critic_lr": 1e-5,
    "learner.sft.steps": 0,  # no supervised warm-up unless asked for
    "learner.sft.lr": 1e-5,  # if it is asked for
}


def pretrained_defaults(cfg: Config, given: set[str]) -> tuple[Config, list[str]]:
    """cfg with PRETRAINED_DEFAULTS for the keys not in `given` when model.path is set, and a
    note saying what was chosen (empty when nothing changed)."""
    if not cfg.model.path:
        return cfg, []
    chosen = {k: v for k, v in PRETRAINED_DEFAULTS.items() if k not in given}
    for key, value in chosen.items():
        cfg = config_loader.merge(cfg, config_loader.nest(key, value))
    if not chosen:
        return cfg, []
    what = ", ".join(f"{k}={v:g}" for k, v in chosen.items())
    return cfg, [f"model.path is a pretrained checkpoint, so the tiny model's defaults do not apply: "
                 f"{what} (set any of these keys to choose; learner.sft.steps=N asks for a warm-up)"]


def load_config(files=(), overrides=(), notes: list[str] | None = None) -> Config:
    """Defaults <- YAML files <- key=value overrides, validated; with model.path, the keys not
    given take PRETRAINED_DEFAULTS (what was chosen is appended to `notes`)."""
    cfg = config_loader.build(Config(), list(files), list(overrides))
    cfg, said = pretrained_defaults(cfg, config_loader.given_keys(list(files), list(overrides)))
    if notes is not None:
        notes.extend(said)
    return cfg


def completion_budget(cfg: Config, task=None) -> int:
    """Tokens after the prompt in a training row: engine.max_new_tokens, or for a multi-turn task
    the whole episode (task.max_completion_len: every turn and observation)."""
    if task is not None and is_multi_turn(task):
        return int(task.max_completion_len)
    return cfg.engine.max_new_tokens


def seq_len(cfg: Config, max_prompt_len: int, task=None) -> int:
    """Fixed training sequence length: prompt + completion budget, rounded up to a multiple of 8."""
    n = max_prompt_len + completion_budget(cfg, task)
    return -(-n // 8) * 8
