"""Process 0 leads, the other learner processes follow: the two sides of the command channel.

The leader wraps the objects whose methods launch sharded computations (the train step, the
supervised warm-up step, the checkpointer) so that each call first sends itself to the
followers, and offers `gather` / `fetch` (whole weights for the built-in engine, exports and the
SGLang sync). `Follower.run` receives the same calls and makes them on its shards.

Params generations: every call that produces new params (an update, a warm-up step, a restore)
numbers them, the same on every process. A gather names the generation it wants, so a weight sync
that runs in an actor thread can still gather the version it was given after the learner moved
on: followers keep a generation while process 0 holds any reference to its params (a weakref
finalizer tells them, with the next command, when it is gone).

Batches: each process receives only the microbatch rows its devices hold (Layout.process_rows),
with the whole batch's counts (WholeBatch) in the command; process 0 cuts them and keeps its own.
"""
from __future__ import annotations

import collections
import signal
import threading
import weakref
from typing import Any, Callable

import numpy as np

from cadence.learner import sharding
from cadence.learner.batching import Microbatch
from cadence.learner.multihost import Channel, Group, as_host, microbatch_arrays, microbatches_from
from cadence.learner.steps.grpo_step import WholeBatch, whole_batch


class Leader:
    """Process 0's side. All its collective calls go through one lock, in one order."""

    def __init__(self, group: Group, layout: sharding.Layout, params):
        self.channel = Channel(group)
        self.layout = layout
        self.lock = threading.RLock()
        self._next_gen = 0
        self._gen_of: dict[int, int] = {}  # id(params) -> generation
        self._leaf_of: dict[int, tuple[int, int]] = {}  # id(leaf array) -> (generation, index)
        self._released: collections.deque[int] = collections.deque()
        self.register(params)

    # ---- generations ----
    def register(self, params) -> int:
        gen, self._next_gen = self._next_gen, self._next_gen + 1
        self._gen_of[id(params)] = gen
        for i, leaf in enumerate(_leaves(params)):
            self._leaf_of[id(leaf)] = (gen, i)
        weakref.finalize(params, self._forget, id(params), [id(x) for x in _leaves(params)], gen)
        return gen

    def _forget(self, params_id: int, leaf_ids: list[int], gen: int) -> None:
        if self._gen_of.get(params_id) == gen:
            del self._gen_of[params_id]
        for leaf_id in leaf_ids:
            if self._leaf_of.get(leaf_id, (None,))[0] == gen:
                del self._leaf_of[leaf_id]
        self._released.append(gen)  # deque.append: safe from a finalizer in any thread

    def generation(self, params) -> int:
        try:
            return self._gen_of[id(params)]
        except KeyError:
            raise ValueError("params not produced by this learner group (no generation)") from None

    def send(self, command: str, meta: dict | None = None, arrays: dict | None = None,
             parts: list | None = None) -> None:
        """Send one command (call with self.lock held, then run the same thing locally); parts:
        arrays for each process (Channel.send)."""
        released = []
        while self._released:
            released.append(self._released.popleft())
        self.channel.send(command, {**(meta or {}), "released": released}, arrays, parts)

    def split_rows(self, microbatches) -> list[list]:
        """The microbatches cut into each process's rows (index = process id)."""
        rows = len(microbatches[0].tokens)  # every microbatch has the same shape
        held = [self.layout.process_rows(rows, p) for p in range(self.channel.group.num_processes)]
        return [[_take_rows(mb, index) for mb in microbatches] for index in held]

    # ---- wrappers ----
    def wrap_step(self, step) -> "_LeaderStep":
        return _LeaderStep(self, step)

    def wrap_sft(self, sft) -> "_LeaderSFT":
        return _LeaderSFT(self, sft)

    def wrap_checkpointer(self, checkpointer) -> "_LeaderCheckpointer":
        return _LeaderCheckpointer(self, checkpointer)

    # ---- weights out ----
    def gather(self, params, dtype: str | None = None):
        """params whole on this process's first device (every process takes part)."""
        with self.lock:
            self.send("gather", {"gen": self.generation(params), "dtype": dtype})
            return sharding.gather(params, self.layout, dtype)

    def fetch(self, arrays: list, dtype: str | None = None) -> list:
        """Some leaves of one params generation, whole on this process (a bucket of a weight
        sync, a shard of an export): never more of the model than asked for."""
        if all(x.is_fully_addressable for x in arrays):
            return sharding.gather(list(arrays), self.layout, dtype)
        where = [self._leaf_of.get(id(x)) for x in arrays]
        if None in where or len({gen for gen, _ in where}) != 1:
            raise ValueError("fetch: arrays must be leaves of one params generation of this learner")
        with self.lock:
            self.send("fetch", {"gen": where[0][0], "leaves": [i for _, i in where], "dtype": dtype})
            return sharding.gather(list(arrays), self.layout, dtype)

    def call(self, name: str, fn: Callable[[], Any], meta: dict | None = None, params=None) -> Any:
        """Runs fn here and the follower's handler `name` there (e.g. saving the final params)."""
        with self.lock:
            gen = None if params is None else self.generation(params)
            self.send("call", {"name": name, "gen": gen, **(meta or {})})
            return fn()

    def stop(self) -> None:
        with self.lock:
            self.send("stop")


class _Wrapped:
    def __init__(self, leader: Leader, inner):
        self._leader, self._inner = leader, inner

    def __getattr__(self, name):  # everything else (cfg, cache_sizes, metric_keys, ...) as is
        return getattr(self._inner, name)


class _LeaderStep(_Wrapped):
    def init(self, params):
        lead = self._leader
        with lead.lock:
            lead.send("init", {"gen": lead.generation(params)})
            state = self._inner.init(params)
            lead.register(state.params)
            return state

    def update(self, state, microbatches, num_tokens: int, units=None, unit_objective: str = "trained"):
        lead = self._leader
        if not microbatches:
            raise ValueError("update: no microbatches")
        units = None if units is None else [int(u) for u in units]
        with lead.lock:
            whole, parts = whole_batch(microbatches), lead.split_rows(microbatches)
            lead.send("update", {"num_tokens": int(num_tokens), "gen": lead.generation(state.params),
                                 "step": int(state.step), "whole": list(whole), "units": units,
                                 "unit_objective": unit_objective},
                      parts=[microbatch_arrays(part) for part in parts])
            state, metrics = self._inner.update(state, parts[0], num_tokens, whole=whole, units=units,
                                                unit_objective=unit_objective)
            lead.register(state.params)
            return state, metrics

    def set_hyperparams(self, state, **values):
        with self._leader.lock:
            self._leader.send("hyper", {k: float(as_host(v)) for k, v in values.items()})
            return self._inner.set_hyperparams(state, **values)


class _LeaderSFT(_Wrapped):
    def init(self, params):
        with self._leader.lock:
            self._leader.send("sft_init", {"gen": self._leader.generation(params)})
            return self._inner.init(params)

    def update(self, params, opt_state, batch):
        lead = self._leader
        with lead.lock:
            rows, parts = len(batch.tokens), lead.split_rows([batch])
            lead.send("sft", {"rows": rows}, parts=[microbatch_arrays(part) for part in parts])
            params, opt_state, metrics = self._inner.update(params, opt_state, parts[0][0], rows=rows)
            lead.register(params)
            return params, opt_state, metrics


class _LeaderCheckpointer(_Wrapped):
    """Every process writes its shards (orbax); only process 0's metadata is written.

    Saves are asynchronous as in one process: each process writes on its own writer thread, and
    orbax's barriers between them go through the jax.distributed client, not device collectives
    (learner/checkpoint.py), so they never interleave with training's. Each process waits for its
    write before the next update donates the Adam moments it is writing.
    """

    def save(self, step: int, arrays, meta: dict, *, wait: bool = False) -> None:
        lead = self._leader
        with lead.lock:
            lead.send("save", {"step": int(step), "gen": lead.generation(arrays["params"]), "wait": bool(wait)})
            self._inner.save(step, arrays, meta, wait=wait)

    def close(self) -> None:
        with self._leader.lock:
            self._leader.send("close_checkpointer")
            self._inner.close()

    def restore_latest(self, template):
        lead = self._leader
        with lead.lock:
            lead.send("restore")
            out = self._inner.restore_latest(template)
            if out is not None:
                lead.register(out[1]["params"])
            return out


class Follower:
    """A process other than 0: holds its shards and runs what process 0 sends until "stop".

    Args:
      group, layout: this process's Group and the learner's Layout.
      train_step: the same sharded train step process 0 built (unwrapped).
      params: the initial params (the same values as process 0's, placed on the mesh); the
        learner state is made by process 0's init command.
      checkpointer: the Checkpointer on the same directory; arrays_of(state) -> what it saves.
      sft: the warm-up step (unwrapped), if process 0 runs one.
      calls: handlers for Leader.call: name -> fn(meta, params of meta["gen"]).
    """

    def __init__(self, group: Group, layout: sharding.Layout, train_step, params, checkpointer,
                 arrays_of: Callable[[Any], dict], sft=None, calls: dict[str, Callable] | None = None):
        self.channel = Channel(group)
        self.layout, self.step, self.state = layout, train_step, None
        self.checkpointer, self.arrays_of, self.sft = checkpointer, arrays_of, sft
        self.calls = dict(calls or {})
        self.held: dict[int, Any] = {}  # params generation -> params, until process 0 releases it
        self._gen = -1
        self._sft: list = []  # [params, opt_state] of a warm-up in progress
        self.checkpointer_closed = False
        self.received_bytes: collections.Counter = collections.Counter()  # per command name
        self._hold(params)

    def _hold(self, params) -> None:
        self._gen += 1
        self.held[self._gen] = params

    def _params(self, gen: int):
        try:
            return self.held[gen]
        except KeyError:
            raise RuntimeError(f"follower: params generation {gen} was released") from None

    def run(self):
        """Follow until process 0 says stop; returns the final state. SIGINT/SIGTERM are left
        to process 0 (a Ctrl-C reaches every process of the terminal's group)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            while True:
                command, meta, arrays = self.channel.receive()
                self.received_bytes[command] += self.channel.last_bytes
                for gen in meta.get("released", ()):
                    self.held.pop(gen, None)
                if command == "stop":
                    return self.state
                getattr(self, f"_on_{command}")(meta, arrays)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _with_params(self, gen: int):
        params = self._params(gen)
        return self.state if params is self.state.params else self.state._replace(params=params)

    def _on_init(self, meta, arrays):
        self.state = self.step.init(self._params(meta["gen"]))
        self._hold(self.state.params)

    def _on_update(self, meta, arrays):
        if self.checkpointer is not None:  # the update donates the Adam moments a save may be writing
            self.checkpointer.wait()
        state = self._with_params(meta["gen"])._replace(step=meta["step"])
        rows, sequences, loss_tokens, signal = meta["whole"]
        # the same units and skipped microbatches as the leader: every process runs the same
        # programs in the same order
        self.state, _ = self.step.update(state, microbatches_from(arrays), meta["num_tokens"],
                                         whole=WholeBatch(rows, tuple(sequences), tuple(loss_tokens), tuple(signal)),
                                         units=meta.get("units"),
                                         unit_objective=meta.get("unit_objective", "trained"))
        self._hold(self.state.params)

    def _on_hyper(self, meta, arrays):
        self.state = self.step.set_hyperparams(self.state, **{k: v for k, v in meta.items() if k != "released"})

    def _on_sft_init(self, meta, arrays):
        params = self._params(meta["gen"])
        self._sft = [params, self.sft.init(params)]

    def _on_sft(self, meta, arrays):
        (batch,) = microbatches_from(arrays)
        params, opt_state, _ = self.sft.update(*self._sft, batch, rows=meta["rows"])
        self._sft = [params, opt_state]
        self._hold(params)

    def _on_save(self, meta, arrays):
        state = self._with_params(meta["gen"])
        self.checkpointer.save(meta["step"], self.arrays_of(state), {}, wait=meta.get("wait", True))

    def _on_close_checkpointer(self, meta, arrays):
        self.checkpointer.close()
        self.checkpointer_closed = True

    def _on_restore(self, meta, arrays):
        out = self.checkpointer.restore_latest(self.arrays_of(self.state))
        if out is not None:
            step, restored, _ = out
            self.state = self.state._replace(**restored, step=step)
            self._hold(self.state.params)

    def _on_gather(self, meta, arrays):
        sharding.gather(self._params(meta["gen"]), self.layout, meta.get("dtype"))

    def _on_fetch(self, meta, arrays):
        leaves = _leaves(self._params(meta["gen"]))
        sharding.gather([leaves[i] for i in meta["leaves"]], self.layout, meta.get("dtype"))

    def _on_call(self, meta, arrays):
        gen = meta.get("gen")
        self.calls[meta["name"]](meta, None if gen is None else self._params(gen))


def _take_rows(mb: Microbatch, rows: np.ndarray) -> Microbatch:
    return Microbatch(*(None if x is None else np.asarray(x)[rows] for x in mb))


def _leaves(params) -> list:
    import jax

    return jax.tree.leaves(params)

