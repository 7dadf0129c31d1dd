"""Helpers for tests and benchmarks that run a real sglang-jax server (CPU)."""
from __future__ import annotations

import os

from cadence.learner.models.config import ModelConfig

# The python of a venv with sglang-jax[cpu]==0.1.0rc0 (Python 3.12); .ci/run sets it.
PYTHON_ENV = "CADENCE_SGLANG_PYTHON"
SKIP_REASON = (f"${PYTHON_ENV} is not set: point it at the python of a Python 3.12 venv with "
               "'sglang-jax[cpu]==0.1.0rc0' (see BUILD.md) to run the real-server tests")


def sglang_python() -> str:
    """The configured server python, or "" when unset or missing."""
    path = os.environ.get(PYTHON_ENV, "")
    return path if path and os.path.exists(path) else ""


def tiny_server_model(n_layers: int = 1, max_seq_len: int = 128) -> ModelConfig:
    """The smallest Llama sglang-jax serves on CPU: head_dim must be 128 (hidden 256, 2 heads)."""
    return ModelConfig(d_model=256, n_heads=2, n_kv_heads=2, d_ff=256, n_layers=n_layers,
                       max_seq_len=max_seq_len)
