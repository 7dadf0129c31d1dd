"""Checkpoints with orbax: asynchronous saves, keep-last-K, restore that skips broken steps.

A checkpoint is one orbax step directory holding two items:
    state  params and optimizer state (incl. injected hyperparameters), arrays, StandardSave
    meta   everything else as JSON: step, policy version, RNG seeds, prompt-stream position,
           the sample ledger (with queued groups through the versioned codec), controller state,
           metrics cursor, elapsed wall time and the config it ran with.
orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves no step that looks complete; `restore_latest` also falls back past a step whose
files are corrupt, with a warning naming it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import warnings
from typing import Any

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 50  # save every this many updates (0 = off)
    every_seconds: float = 0.0  # also save when this long has passed since the last save (0 = off)
    keep: int = 3  # checkpoints kept (oldest deleted first)
    async_save: bool = True  # write in a background thread; the loop does not wait for the disk
    signal_timeout_seconds: float = 60.0  # after SIGTERM/SIGINT: final checkpoint and exit within this
    # orbax's OCDBT format: a few files per checkpoint (what network filesystems and object stores
    # want), but its write held +1.3-1.4 GiB for SmolLM2's 1.6 GB state inside a run (the run's peak);
    # false writes a file per array chunk, +0.3 GiB (docs/results/smollm2_memory.md). Either restores.
    ocdbt: bool = True

    def validate(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps: must be >= 0, got {self.every_steps}")
        if self.every_seconds < 0:
            raise ValueError(f"every_seconds: must be >= 0, got {self.every_seconds}")
        if self.keep < 1:
            raise ValueError(f"keep: must be >= 1, got {self.keep}")
        if self.signal_timeout_seconds <= 0:
            raise ValueError(f"signal_timeout_seconds: must be > 0, got {self.signal_timeout_seconds}")


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def _multiprocess_options(ocp) -> dict:
    """Several learner processes: orbax's barriers go through the jax.distributed client
    (naming every process as active does that) instead of device collectives, so a save on the
    writer thread never interleaves with the collectives training launches meanwhile. The
    directory exists already (Checkpointer makes it), which orbax requires with active processes."""
    import jax

    if jax.process_count() == 1:
        return {}
    processes = set(range(jax.process_count()))
    return {"create": False, "multiprocessing_options": ocp.options.MultiprocessingOptions(active_processes=processes)}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the directory and step."""


class Checkpointer:
    def __init__(self, directory: str, cfg: CheckpointConfig):
        self.directory = os.path.abspath(directory)
        self.cfg = cfg
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".write-test-{os.getpid()}")  # one per learner process
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self.directory} is not writable: {e}") from None
        # JAX arrays are immutable, so a background thread can write the very arrays of step N
        # while step N+1 runs: no copy. The train step donates the Adam moments to step N+1's
        # update, so the loop waits for the write before that update (LearnerLoop.before_update):
        # the write overlaps the batch's collection, not the update.
        # (orbax's own async mode first copies every array to host memory on the calling thread:
        # 0.1 s for a 25M-parameter model and Adam here, 14% of a step.)
        self._manager = None  # made on first use: importing orbax costs ~1 s of every start
        self._manager_lock = threading.Lock()  # the first use may be on the writer thread
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint") \
            if cfg.async_save else None
        self._pending: concurrent.futures.Future | None = None
        self._last_save_time = time.monotonic()
        self.blocked_seconds = 0.0  # time the training loop spent inside save() calls
        self.last_saved_at: float | None = None  # unix time the newest complete checkpoint was on disk

    @property
    def manager(self):
        """The orbax CheckpointManager (orbax is imported here, off the start of a run)."""
        with self._manager_lock:
            if self._manager is None:
                ocp = _orbax()
                options = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.keep,
                                                       enable_async_checkpointing=False,
                                                       **_multiprocess_options(ocp))
                handlers = {"state": ocp.StandardCheckpointHandler(use_ocdbt=self.cfg.ocdbt),
                            "meta": ocp.JsonCheckpointHandler()}
                self._manager = ocp.CheckpointManager(self.directory, options=options,
                                                      item_names=("state", "meta"), item_handlers=handlers)
            return self._manager

    # -- saving -----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        by_steps = self.cfg.every_steps and step % self.cfg.every_steps == 0
        by_time = self.cfg.every_seconds and time.monotonic() - self._last_save_time >= self.cfg.every_seconds
        return bool(by_steps or by_time)

    def save(self, step: int, arrays: Any, meta: dict, *, wait: bool = False) -> None:
        """Start saving step `step` (returns once arrays are copied when async). Raises
        CheckpointError if this or the previous asynchronous save failed; earlier complete
        checkpoints are untouched."""
        t0 = time.perf_counter()
        try:
            self.wait()  # one save at a time; raises if the previous background save failed
            if step in self.manager.all_steps():
                # A signal right after a periodic save: the arrays are those on disk already. Only a
                # run's last save (meta "finished") must replace it, so a resume knows it is done.
                if not meta.get("finished"):
                    return
                self.manager.delete(step)
            if self._writer is None or wait:
                self._write(step, arrays, meta)
            else:
                self._pending = self._writer.submit(self._write, step, arrays, meta)
        finally:
            self.blocked_seconds += time.perf_counter() - t0
        self._last_save_time = time.monotonic()

    def _write(self, step: int, arrays: Any, meta: dict) -> None:
        ocp = _orbax()
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                            meta=ocp.args.JsonSave(meta)), force=True)
            self.manager.wait_until_finished()
            self.last_saved_at = time.time()
        except Exception as e:  # orbax surfaces OSError (disk full, permissions) wrapped or not
            raise CheckpointError(f"could not write checkpoint step {step} to {self.directory}: "
                                  f"{type(e).__name__}: {e}") from e

    def wait(self) -> None:
        """Block until the background save (if any) is on disk; re-raise its CheckpointError."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
        try:
            if self._manager is not None:
                self._manager.close()
        except Exception as e:  # noqa: BLE001 - reported, never hides an earlier error
            log.warning("closing checkpoint manager: %s", e)

    # -- restoring --------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        self.wait()
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def restore_latest(self, template: Any) -> tuple[int, Any, dict] | None:
        """(step, arrays, meta) of the newest checkpoint that restores cleanly, or None if none.

        A newer step that fails to restore is skipped with a warning naming its directory."""
        ocp = _orbax()
        for step in reversed(self.steps()):
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()))
                self.last_saved_at = os.path.getmtime(os.path.join(self.directory, str(step)))
                return step, out["state"], out["meta"]
            except Exception as e:  # corrupt or partial: fall back to the previous one
                path = os.path.join(self.directory, str(step))
                warnings.warn(f"skipping checkpoint {path}: it does not restore ({type(e).__name__}: {e})",
                              stacklevel=2)
        return None
