"""Write params back as a Hugging Face checkpoint directory (transformers / SGLang loadable).

    export_checkpoint(model_cfg, params, "/runs/x/hf", source="/ckpt/Qwen2.5-0.5B")

The directory gets config.json, ``model-0000k-of-0000n.safetensors`` shards with
``model.safetensors.index.json``, and the source checkpoint's tokenizer and generation files.
Shards are written one at a time and each shard a tensor at a time (its header computed from the
shapes first): beyond the params, export holds one tensor's host copy (a kernel transposed to
HF's [out, in]), not a shard's or the model's (safetensors' own save_file builds the whole file in
memory: +0.4 GB at SmolLM2's end of run).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from cadence.learner.models import hf_config
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_load import SAFETENSORS_DTYPES, INDEX_FILE, hf_name, is_kernel

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
        values = [flat[name].value for name in shard]
        if fetch is not None:  # several processes: the shard's arrays gathered here together
            values = fetch(values)

        def host(i, name):  # HF's layout, made as it is written
            value = np.asarray(jax.device_get(values[i]))
            return np.ascontiguousarray(value.T) if flat[name].transposed else value

        total += write_safetensors(os.path.join(out_dir, file),
                                   [(n, _hf_shape(flat[n]), np.dtype(flat[n].value.dtype)) for n in shard],
                                   host, metadata={"format": "pt"})
        weight_map.update((name, file) for name in shard)
        del values
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    src_cfg = hf_config.read_config_json(source) if source else None
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config.hf_from_model_config(cfg, src_cfg), f, indent=2)
    if source:
        copy_tokenizer_files(source, out_dir)
    return files


_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def write_safetensors(path: str, tensors: list[tuple[str, tuple[int, ...], np.dtype]], host,
                      metadata: dict[str, str] | None = None) -> int:
    """Writes a safetensors file a tensor at a time; returns the data bytes written.

    tensors: (name, shape, dtype) in file order; host(i, name) -> tensor i as a NumPy array of that
    shape and dtype, called once each, in order, so only one host copy need exist at a time. The
    format: an 8-byte little-endian header length, the JSON header ({name: {dtype, shape,
    data_offsets}}, "__metadata__"), padded with spaces so the data starts 8-byte aligned, then
    each tensor's C-order little-endian bytes.
    """
    header, offset = {"__metadata__": dict(metadata)} if metadata else {}, 0
    for name, shape, dtype in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for i, (name, shape, dtype) in enumerate(tensors):
            value = host(i, name)
            if value.shape != tuple(shape) or value.dtype != dtype:
                raise ValueError(f"tensor {name!r}: {value.dtype}{list(value.shape)} where the header says "
                                 f"{dtype}{list(shape)}")
            f.write(memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))  # a little-endian host
    return offset


def _hf_shape(t: HFTensor) -> tuple[int, ...]:
    return tuple(t.value.shape[::-1]) if t.transposed else tuple(t.value.shape)


def _hf_order(name: str) -> tuple:
    # Embeddings, then layers in numeric order, then the final norm and head (as HF writes them).
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)
