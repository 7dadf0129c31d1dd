"""JAX's persistent compilation cache for the learner process: a second run loads its programs
(engine, warm-up, train step, evaluation) from disk instead of compiling them again.

`run.jax_cache` picks the directory: "auto" is $XDG_CACHE_HOME/cadence/jax (~/.cache/cadence/jax),
a path moves it, "none" disables it. JAX's own switches win: JAX_ENABLE_COMPILATION_CACHE=false
turns it off (the benchmarks do, to time cold starts), JAX_COMPILATION_CACHE_DIR sets the place.
SGLang servers that Cadence launches keep their own cache (actors.sglang.compile_cache).
"""
from __future__ import annotations

import os
import sys

MAX_BYTES = 2 << 30  # JAX evicts the least recently used programs beyond this (2 GiB)


def cache_dir(setting: str) -> str | None:
    """The directory `run.jax_cache` names, or None when off."""
    if setting in ("none", ""):
        return None
    if setting == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "cadence", "jax")
    return os.path.expanduser(setting)


def enable(setting: str) -> str | None:
    """Turns the cache on for this process (before its first compile); returns the directory in
    use, or None (off, or the directory cannot be created: the run goes on without it)."""
    import jax

    if os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in ("0", "false", "no", "off"):
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = cache_dir(setting)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        print(f"cadence: run.jax_cache: cannot create {path} ({e}); compiling without a cache", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Cadence's programs compile in 0.05-1 s each on a CPU: keep them all (JAX's default keeps only
    # those over 1 s, which would keep none of them).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
