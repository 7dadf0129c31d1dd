"""What the Engine and WeightSync interface tests share: the stand-in SGLang server (dist_receiver.py,
a real process serving a transformers Llama over SGLang's endpoints) and the model's own logprobs."""
import os
import subprocess
import sys
import time
import urllib.request

import jax.numpy as jnp
import numpy as np

from cadence.actors.sglang.server import free_port
from cadence.learner.algorithms.logprobs import token_logprobs
from cadence.learner.models.llama import forward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAND_IN = os.path.join(ROOT, "tests", "actors", "dist_receiver.py")
# Both sides fp32 on CPU; the stand-in's logits measured within 2.3e-7 of Cadence's (sglang_distributed_test).
LOGPROB_ATOL = 1e-4


def start_stand_in(model_dir: str, timeout_s: float = 120.0) -> tuple[str, subprocess.Popen]:
    """An attached stand-in server loading model_dir; returns (url, process): kill it when done."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, STAND_IN, "--model-dir", model_dir, "--port", str(port)],
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=10).read()
            return url, proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the stand-in server did not start (exit {proc.poll()})")
            time.sleep(0.2)


def launched_stand_in() -> dict:
    """SGLangConfig fields that make the engine launch (and restart) stand-ins as its own servers."""
    return dict(launch_python=sys.executable, launch_module="tests.actors.dist_receiver", launch_args=(),
                launch_env=(f"PYTHONPATH={ROOT}", "JAX_PLATFORMS=cpu"), compile_cache=False)


def model_logprobs(graphdef, params, prompt, completion) -> np.ndarray:
    """The model's log_softmax(logits)[token] for each completion token after prompt (T = 1)."""
    toks = jnp.array([list(prompt) + list(completion)])
    n = toks.shape[1]
    logits = forward(graphdef, params, toks, jnp.arange(n)[None], jnp.ones((1, n), bool))
    return np.asarray(token_logprobs(logits, toks)[0, len(prompt):])


def assert_rows_match_model(graphdef, params, prompts, result, pad_id: int) -> None:
    """Each row: a completion the model's own logprobs explain, pad and 0 after its end."""
    m = result.tokens.shape[1]
    for r, prompt in enumerate(prompts):
        n = int(result.lengths[r])
        assert 1 <= n <= m
        assert (result.tokens[r, n:] == pad_id).all() and (result.logprobs[r, n:] == 0).all()
        np.testing.assert_allclose(result.logprobs[r, :n], model_logprobs(graphdef, params, prompt, result.tokens[r, :n]),
                                   atol=LOGPROB_ATOL, rtol=0)

