"""Weights of an actor process: fetched from the learner's WeightServer when a grant needs newer.

The same interface as protocols.weights.InProcessWeights (`latest()`, `version`, `ensure(v)`), so
the actor loop does not know which one it has, plus `reset()`: after a learner restart the actor's
weights may come from a timeline the resumed run rolled back, so they must be fetched again.
"""
from __future__ import annotations

import time
from typing import Callable

from cadence.learner.models.named_arrays import ParamLayout
from cadence.protocols.weights_wire import WeightClient, fetch_all


class RemoteWeights:
    """Args:
      connect: endpoint -> WeightClient.
      template: a parameter tree of the same model (shapes, dtypes, paths).
      endpoint_fn: the weight server's endpoint now (it moves when the learner restarts), or
        several: process 0's first, then the other learner processes' (each serves its pieces).
      transform: what was fetched -> the params the engine runs, once per version (a LoRA run
        sends its adapters: this merges them into the frozen base); None = as fetched.
    """

    def __init__(self, connect: Callable[[str], WeightClient], template, endpoint_fn: Callable[[], str],
                 timeout: float = 120.0, transform: Callable | None = None):
        self._connect, self._endpoint_fn = connect, endpoint_fn
        self._clients: list[WeightClient] = []
        self.layout = ParamLayout(template)
        self.timeout = timeout
        self._transform = transform
        self._params, self._version = template, -1
        self.fetch_seconds = 0.0

    @property
    def version(self) -> int:
        return self._version

    def latest(self):
        return self._params, self._version

    def reset(self) -> None:
        self._version = -1

    def ensure(self, version: int) -> None:
        """Fetch the newest weights if we hold less than `version` (the newest may be newer still)."""
        endpoints = self._endpoint_fn()
        endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if [c.endpoint for c in self._clients] != endpoints:
            for c in self._clients:
                c.close()
            self._clients = [self._connect(e) for e in endpoints]
        deadline = time.monotonic() + self.timeout
        while self._version < version:
            t0 = time.perf_counter()
            got = fetch_all(self._clients, self._version, timeout=max(deadline - time.monotonic(), 0.1))
            self.fetch_seconds += time.perf_counter() - t0
            if got is not None:
                v, named = got
                params = self.layout.build(named)
                self._params = params if self._transform is None else self._transform(params)
                self._version = v
            elif time.monotonic() > deadline:  # the server says we are current, yet the grant wants newer
                raise TimeoutError(f"weights: version {version} was granted but the weight server "
                                   f"still serves {self._version}")
            else:
                time.sleep(0.01)
