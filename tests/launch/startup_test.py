"""Startup: the persistent compilation cache is on by default (and can be moved or turned off),
and a default run imports nothing its path does not use."""
import json
import os
import subprocess
import sys

import pytest

from cadence.launch import compile_cache

UNUSED_BY_DEFAULT = ("math_verify", "sympy", "orbax", "aiohttp", "transformers", "sglang", "torch")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **extra)
    env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_dir("auto") == str(tmp_path / "cadence" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.cache_dir("auto") == os.path.join(os.path.expanduser("~"), ".cache", "cadence", "jax")
    assert compile_cache.cache_dir("~/x") == os.path.join(os.path.expanduser("~"), "x")
    assert compile_cache.cache_dir("none") is None and compile_cache.cache_dir("") is None


def test_default_path_imports_only_what_it_uses():
    code = ("import sys, cadence.launch.cli, cadence.launch.run.train; from cadence.launch.config import load_config; load_config(); "
            f"print([m for m in {UNUSED_BY_DEFAULT!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_run_fills_the_cache_it_is_given_and_none_turns_it_off(tmp_path):
    base = [sys.executable, "-m", "cadence.launch.cli", "train", "run.steps=1", "learner.sft.steps=0",
            "task.heldout_size=8", "run.progress=false", "learner.batch_size=16", "learner.microbatch_size=16"]
    cache = tmp_path / "cache"
    out = subprocess.run([*base, f"run.dir={tmp_path / 'a'}", f"run.jax_cache={cache}"],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == 1
    assert len(os.listdir(cache)) >= 4  # engine, warm-up-free eval, train step pieces: one file each
    # "none", and JAX's own switch, leave no cache behind
    home = tmp_path / "home"
    out = subprocess.run([*base, f"run.dir={tmp_path / 'b'}", "run.jax_cache=none"],
                         capture_output=True, text=True, env=_env(XDG_CACHE_HOME=str(home)), timeout=600)
    assert out.returncode == 0, out.stderr
    assert not home.exists()


@pytest.mark.slow
def test_a_second_run_loads_its_programs_from_the_cache(tmp_path):
    base = [sys.executable, "-m", "cadence.launch.cli", "train", "run.steps=2", "run.progress=false",
            f"run.jax_cache={tmp_path / 'cache'}"]
    env = _env(JAX_LOGGING_LEVEL="DEBUG")
    first = subprocess.run([*base, f"run.dir={tmp_path / 'a'}"], capture_output=True, text=True, env=env, timeout=900)
    second = subprocess.run([*base, f"run.dir={tmp_path / 'b'}"], capture_output=True, text=True, env=env, timeout=900)
    assert first.returncode == 0 and second.returncode == 0, second.stderr[-2000:]
    writes = first.stderr.count("Writing jit_")
    assert writes >= 4 and "Persistent compilation cache hit" in second.stderr
    assert second.stderr.count("Writing jit_") < writes / 4  # nearly everything came from disk
