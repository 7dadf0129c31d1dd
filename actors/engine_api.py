"""The generation engine: what an actor asks of whatever turns prompts into completions.

    engine: Engine = JaxEngine(model_cfg, graphdef, EngineConfig(), eos_id, pad_id)  # or SGLangEngine
    engine.sync_weights(params, version, min_version=grant.min_version)  # weights in (no-op: JaxEngine)
    result = engine.generate(params, prompts, key, greedy=False, stop=((7,),))
    result.tokens[r, :result.lengths[r]]  # row r's completion; result.logprobs: behavior logprobs
    result.policy_versions                # [N] version each row was generated under (None: params')
    client.engine_stats = {f"{engine.name}/{k}": v for k, v in engine.counters().items()}
    engine.forget_weights()               # the learner restarted: its run may be older than ours
    engine.abort(); engine.close()        # stopping: cut running calls short, then free servers

Two kinds of engine implement it. One reads the params it is given with every generate() call
(JaxEngine, actors/engine.py: ``holds_weights`` False, so weights-in is a no-op). The other serves
weights of its own (SGLangEngine, actors/sglang/engine.py: ``holds_weights`` True): sync_weights()
brings its servers to a version before a generation, and each row reports the version its server
held. The actor loop (actors/actor_loop.py) calls only what is declared here; a new engine (vLLM, a
remote service) subclasses Engine and is tested by tests/actors/engine_api_test.py's body.
"""
from __future__ import annotations

import abc
from typing import NamedTuple, Sequence

import numpy as np


class GenerationResult(NamedTuple):
    """Completions, one row per request, as NumPy arrays."""

    tokens: np.ndarray  # [N, max_new_tokens] int32 completion ids, pad_id after the end
    logprobs: np.ndarray  # [N, max_new_tokens] float32 behavior logprobs of the sampled tokens, 0 after the end
    lengths: np.ndarray  # [N] int32 completion length, including the EOS token if one was produced
    seconds: float  # wall time of the whole generate call (host prep, device loop, transfer back)
    num_tokens: int  # generated tokens (sum of lengths)
    # [N, max_new_tokens] float32 log of the nucleus mass kept at each step (<= 0; 0 without top-p,
    # when greedy, and after the end); -kept_logmass = KL(truncated || full) of that step. None: the
    # engine does not report it (SGLang under top-p)
    kept_logmass: np.ndarray | None = None
    # [N] int64 weights version each row was generated under: engines that hold weights of their own
    # (a server may lag); None: the version of the params passed to generate()
    policy_versions: np.ndarray | None = None


class GenerationAborted(RuntimeError):
    """Engine.abort() was called while a generate() call was running (a stop, not a failure)."""


class Engine(abc.ABC):
    """Turns prompts into completions under some policy weights (see the module docstring)."""

    name: str  # "jax", "sglang": EngineTimings.engine, and the prefix of counters() in the metrics
    holds_weights: bool  # True: weights in through sync_weights(); False: generate() reads its params

    @abc.abstractmethod
    def generate(self, params, prompts: Sequence[Sequence[int]], rng, *, greedy: bool = False,
                 temperature: float | None = None, top_p: float | None = None,
                 stop: Sequence[Sequence[int]] = ()) -> GenerationResult:
        """Completions of N non-empty token-id prompts (include BOS yourself).

        params: the policy's param pytree (an engine that holds its own weights ignores it); rng: a
        PRNG key (an engine with sampling seeds of its own may ignore it); greedy: argmax decoding,
        behavior logprobs then log_softmax(logits) (T = 1); temperature/top_p: this call's sampling
        (default: the engine's config); stop: token-id sequences that end a row like EOS (kept in the
        row; an engine may match only one-token ones, and the caller cuts the rest: episodes.py).

        Raises GenerationAborted when abort() was called meanwhile.
        """

    @abc.abstractmethod
    def sync_weights(self, params, version: int, min_version: int | None = None) -> bool:
        """Weights in: bring what generate() samples from to ``version`` when needed; returns
        whether anything changed. min_version: the oldest version the caller's samples may still be
        generated under (None: always take ``version``). Blocks until done."""

    @abc.abstractmethod
    def forget_weights(self) -> None:
        """The learner restarted, and its resumed run may be older than the weights held: the next
        sync_weights() takes the version it is given, whatever is held."""

    @abc.abstractmethod
    def counters(self) -> dict[str, float]:
        """Cumulative counters for the metrics (requests, restarts, syncs ...); {} when none."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Cut running generate() calls short (they raise GenerationAborted; an engine that cannot
        interrupt a call lets it finish); the engine stays usable."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free what the engine owns (servers it launched); call once, when done with it."""
