"""Write params back as a Hugging Face checkpoint directory (transformers / SGLang loadable).

    export_checkpoint(model_cfg, params, "/runs/x/hf", source="/ckpt/Qwen2.5-0.5B")

The directory gets config.json, ``model-0000k-of-0000n.safetensors`` shards with
``model.safetensors.index.json``, and the source checkpoint's tokenizer and generation files.
Shards are written one at a time: only one shard's tensors are ever copied to the host, so export
never holds two full copies of the model.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from cadence.learner.models import hf_config
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_load import INDEX_FILE, hf_name, is_kernel

# Files of the source checkpoint that describe the weights (rewritten here), not the tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")
_REWRITTEN = {"config.json", INDEX_FILE, "pytorch_model.bin.index.json"}


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Groups (name, nbytes) in order into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


class HFTensor(NamedTuple):
    """One checkpoint tensor: its HF name, the param array, and whether HF stores it transposed."""

    name: str
    value: jax.Array
    transposed: bool  # a linear kernel: HF's [out, in] is value.T


def hf_tensors(cfg: ModelConfig, params: nnx.State) -> list[HFTensor]:
    """The params as Hugging Face checkpoint tensors, in HF order (a tied lm_head is left out).

    Values stay where they are (device arrays); callers transpose and copy as they need.
    """
    flat = [HFTensor(hf_name(p), v.get_value(), is_kernel(p)) for p, v in nnx.to_flat_state(params)]
    if cfg.tie_embeddings:
        flat = [t for t in flat if t.name != "lm_head.weight"]
    return sorted(flat, key=lambda t: _hf_order(t.name))


def copy_tokenizer_files(source: str, out_dir: str) -> list[str]:
    """Copies every non-weight, non-config file of source (tokenizer, generation config, ...)."""
    copied = []
    for name in sorted(os.listdir(source)):
        src = os.path.join(source, name)
        if not os.path.isfile(src) or name in _REWRITTEN or name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(src, os.path.join(out_dir, name))
        copied.append(name)
    return copied


def export_checkpoint(cfg: ModelConfig, params: nnx.State, out_dir: str, *, source: str = "",
                      max_shard_bytes: int = 2 * 1024**3, fetch=None) -> list[str]:
    """Writes params as a Hugging Face directory.

    Args:
      cfg: the model's config (its param_dtype is the dtype written).
      params: the params pytree (as from ``init_params`` or ``hf_load.load_checkpoint``).
      out_dir: where to write; created if needed, must not be ``source``.
      source: the checkpoint the model came from ("" = none): its config.json's other keys are
        kept and its tokenizer files copied.
      max_shard_bytes: shard size limit (a single larger tensor gets a shard of its own).
      fetch: fetch(arrays) -> the arrays whole on this process, called once per shard (a learner
        sharded over processes: launch.learner_group.LearnerProcesses.fetch); default
        jax.device_get, which gathers arrays sharded over this process's devices.

    Returns:
      The shard file names written, in order.

    Raises:
      ValueError: if out_dir is the source directory (its shards would be overwritten mid-read).
    """
    if source and os.path.realpath(source) == os.path.realpath(out_dir):
        raise ValueError(f"out_dir: {out_dir!r} is the source checkpoint; export somewhere else")
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):  # shards of an earlier export would confuse a glob-based loader
        if stale.startswith("model") and stale.endswith(".safetensors"):
            os.remove(os.path.join(out_dir, stale))
    flat = {t.name: t for t in hf_tensors(cfg, params)}
    shards = plan_shards([(n, t.value.nbytes) for n, t in flat.items()], max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        tensors = {}
        values = [flat[name].value for name in shard]
        values = jax.device_get(values if fetch is None else fetch(values))
        for name, host in zip(shard, values):
            t = flat[name]
            host = np.asarray(host)
            tensors[name] = np.ascontiguousarray(host.T) if t.transposed else host
            weight_map[name] = file
            total += host.nbytes
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        del tensors  # the next shard's host copies replace this one's
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    src_cfg = hf_config.read_config_json(source) if source else None
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config.hf_from_model_config(cfg, src_cfg), f, indent=2)
    if source:
        copy_tokenizer_files(source, out_dir)
    return files


def _hf_order(name: str) -> tuple:
    # Embeddings, then layers in numeric order, then the final norm and head (as HF writes them).
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)
