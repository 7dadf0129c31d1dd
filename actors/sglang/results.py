"""What the SGLang engine returns, counts and raises (shared by its modules)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class SGLangResult(NamedTuple):
    """GenerationResult's fields (same order and meaning) plus the version of each row."""

    tokens: np.ndarray  # [N, M] int32, pad_id after the end
    logprobs: np.ndarray  # [N, M] float32 behavior logprobs (the server's), 0 after the end
    lengths: np.ndarray  # [N] int32, including the stop token
    seconds: float
    num_tokens: int
    kept_logmass: np.ndarray | None  # [N, M] zeros when top_p == 1 (no truncation); None otherwise (not reported)
    policy_versions: np.ndarray  # [N] int64: the weights version the row's server held


class GenerationAborted(RuntimeError):
    """abort() was called while this generate() call was running."""


class SGLangError(RuntimeError):
    """A request failed more than ``retries`` times, or no server became ready in time."""


@dataclasses.dataclass
class EngineStats:
    """Counters (metrics): written on the engine's event loop, read anywhere."""

    requests: int = 0  # /generate requests sent
    completions: int = 0  # rows returned
    tokens: int = 0
    reissued: int = 0  # requests sent again after a failure of any kind
    misaligned: int = 0  # responses rejected by the alignment check
    malformed: int = 0  # responses that were not the promised JSON
    unavailable: int = 0  # requests that found their server gone (refused, reset, timed out)
    http_errors: int = 0
    restarts: int = 0  # owned servers restarted after a failure
    syncs: int = 0  # weight syncs completed
    sync_seconds: float = 0.0  # total time inside sync_weights (export + restart/load/broadcast)
    sync_bytes: int = 0  # sent by distributed syncs (per server: one broadcast reaches all)
    sync_failures: int = 0  # distributed sync attempts that failed and were retried or raised
