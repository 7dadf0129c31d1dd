"""Load a Hugging Face Llama / Qwen2 / Qwen3 checkpoint directory into the Flax model.

    model_cfg, graphdef, params = load_checkpoint("/ckpt/Qwen2.5-0.5B", ModelConfig(param_dtype="bfloat16"))

Reads config.json and the safetensors weights (one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``) one tensor at a time: each is read, transposed if it is a linear
kernel (HF stores [out, in], nnx.Linear [in, out]), cast to the param dtype and placed on the
device before the next is read, so the host never holds more than one tensor beyond the params.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from learner.models import hf_config
from learner.models.config import ModelConfig
from learner.models.llama import Llama

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def hf_name(path: tuple) -> str:
    """HF tensor name of a flat nnx param path, e.g. ('layers', 0, 'mlp', 'up_proj', 'kernel')."""
    *head, leaf = (str(p) for p in path)
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    name = ".".join([*head, leaf])
    return name if head == ["lm_head"] else "model." + name


def is_kernel(path: tuple) -> bool:
    """True for linear kernels, which HF stores transposed."""
    return path[-1] == "kernel"


def weight_files(path: str) -> dict[str, str]:
    """Maps each tensor name to the safetensors file holding it.

    Raises:
      FileNotFoundError: if the directory has no safetensors weights (or the index names a
        missing shard).
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for shard in set(weight_map.values()):
            if not os.path.isfile(os.path.join(path, shard)):
                raise FileNotFoundError(f"{INDEX_FILE} in {path!r} lists missing shard {shard!r}")
        return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights (nor {INDEX_FILE}) in {path!r}")
    out = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="np") as f:
            out.update({name: os.path.join(path, file) for name in f.keys()})
    return out


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    # Old Llama exports carry the RoPE table; tied models may still store lm_head.weight.
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


def _read_in_file_order(files: dict[str, str], names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for the wanted names, opening each shard once."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, in_file in by_file.items():
        with safe_open(file, framework="np") as f:
            for name in in_file:
                yield name, f.get_tensor(name)


def load_params(path: str, cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Reads the weights of the checkpoint at ``path`` into params for the model cfg describes.

    Args:
      path: the checkpoint directory.
      cfg: the model config (normally ``hf_config.model_config_from_checkpoint(path, ...)``);
        params are cast to cfg.param_dtype.

    Returns:
      (graphdef, params) as ``llama.init_params`` returns them.

    Raises:
      ValueError: naming the tensor, if one the model needs is missing, has the wrong shape, or
        the checkpoint holds a tensor the model has no place for.
    """
    cfg.validate()
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))))
    flat = list(nnx.to_flat_state(abstract))
    wanted = {hf_name(p): (p, v) for p, v in flat}
    files = weight_files(path)
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(n for n in set(files) - set(wanted) if not _ignorable(n, cfg))
    if unexpected:
        raise ValueError(f"checkpoint {path!r} has tensor {unexpected[0]!r} that the configured "
                         f"model has no parameter for" + (f" (and {len(unexpected) - 1} more)"
                                                           if len(unexpected) > 1 else ""))
    dtype = _NP_DTYPES[cfg.param_dtype]
    loaded = {}
    for name, array in _read_in_file_order(files, list(wanted)):
        p, var = wanted[name]
        if is_kernel(p):
            array = array.T
        if array.shape != tuple(var.get_value().shape):
            hf_shape = array.shape[::-1] if is_kernel(p) else array.shape
            want = tuple(var.get_value().shape)[::-1] if is_kernel(p) else tuple(var.get_value().shape)
            raise ValueError(f"tensor {name!r} in {path!r} has shape {hf_shape}, the model expects {want}")
        # One host copy (transpose + cast together), then onto the device.
        host = np.ascontiguousarray(array, dtype=dtype)
        loaded[p] = var.replace(jax.device_put(host))
    params = nnx.from_flat_state([(p, loaded[p]) for p, _ in flat])
    return graphdef, params


def load_checkpoint(path: str, base: ModelConfig = ModelConfig()) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Config and weights of a Hugging Face checkpoint directory.

    Args:
      path: directory with config.json and safetensors weights.
      base: supplies param_dtype and compute_dtype (the architecture comes from config.json).

    Returns:
      (model_cfg, graphdef, params).

    Raises:
      ValueError: unsupported architecture, missing tensor or shape mismatch (each named).
      FileNotFoundError: no config.json or no weights.
    """
    cfg = hf_config.model_config_from_checkpoint(path, base)
    graphdef, params = load_params(path, cfg)
    return cfg, graphdef, params
