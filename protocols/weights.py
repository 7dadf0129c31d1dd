"""Where actors find the newest policy weights.

In one process the learner publishes a reference to its (immutable) parameter arrays; an actor
reads the newest (params, version) pair before each generation call. Across processes this is
replaced by a transport broadcast or an exported checkpoint that servers load; both announce
themselves with a `WeightsPublished` message carrying the same version number.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable


class InProcessWeights:
    """Latest-value store: publish(params, version) / latest() -> (params, version)."""

    def __init__(self, params: Any, version: int = 0, on_publish: Callable[[int], None] | None = None):
        self._lock = threading.Lock()
        self._params = params
        self._version = version
        self._published_at = time.time()
        self._on_publish = on_publish

    def publish(self, params: Any, version: int) -> None:
        with self._lock:
            if version < self._version:
                raise ValueError(f"policy version went backwards: {version} < {self._version}")
            self._params, self._version = params, version
            self._published_at = time.time()
        if self._on_publish is not None:
            self._on_publish(version)

    def ensure(self, version: int) -> None:
        """The actor needs at least `version`: in one process the newest is always at hand."""

    def reset(self) -> None:
        """A new learner session: nothing to forget, this store is the learner's own."""

    def latest(self) -> tuple[Any, int]:
        with self._lock:
            return self._params, self._version

    @property
    def version(self) -> int:
        with self._lock:
            return self._version
