"""Load a Hugging Face Llama / Qwen2 / Qwen3 checkpoint directory into the Flax model.

    model_cfg, graphdef, params = load_checkpoint("/ckpt/Qwen2.5-0.5B", ModelConfig(param_dtype="bfloat16"))

Reads config.json and the safetensors weights (one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``) one tensor at a time: each is read, transposed if it is a linear
kernel (HF stores [out, in], nnx.Linear [in, out]), cast to the param dtype and placed on the
device. Tensors are read with preadv from the page cache; each lands once in its parameter's
own aligned buffer, which the device adopts (kernels via a per-thread scratch read and a fused
transpose + cast), on a few threads with at most 2 x threads in flight, so the host never holds
a second model copy.

With ``shardings`` (the learner's NamedSharding per parameter) each tensor goes straight onto the
mesh instead: ``jax.make_array_from_callback`` asks for the slice each of this process's devices
holds, which is read alone from the file (a block of HF rows with one read; a column slice, e.g.
an FSDP-split kernel, through a memory map, touching only the pages of those columns), then
transposed and cast. No device ever holds more than its shard, and no process reads the slices
only other processes' devices hold.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import threading
from typing import Callable, NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from cadence.learner.models import hf_config
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.llama import abstract_params

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


SAFETENSORS_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
                       "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}


class TensorEntry(NamedTuple):
    """Where one tensor sits in a safetensors file."""

    dtype: np.dtype
    shape: tuple
    offset: int  # absolute byte offset of its data in the file
    nbytes: int


def tensor_index(file: str) -> dict[str, TensorEntry]:
    """Every tensor of a safetensors file, from its header alone (no data read).

    The format is an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the raw little-endian data.
    """
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} in {file!r} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        out[name] = TensorEntry(SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + start, end - start)
    return out


def _read_into(fd: int, entry: TensorEntry, out: np.ndarray) -> np.ndarray:
    """Reads entry's bytes into the C-contiguous out (the kernel copies straight from the page
    cache: no page-fault per 4 KiB as with a memory map)."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    while done < entry.nbytes:  # preadv may return short on large reads
        got = os.preadv(fd, [view[done:]], entry.offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file reading a tensor at byte {entry.offset + done}")
        done += got
    return out.view(entry.dtype).reshape(entry.shape)


def _scratch(store: dict, nbytes: int, slot: str = "") -> np.ndarray:
    """A per-thread byte buffer reused across tensors (no fresh pages to fault in); store lives
    only as long as one load, so the buffers go with it. slot: a second buffer the same thread
    uses at the same time."""
    key = (threading.get_ident(), slot)
    buf = store.get(key)
    if buf is None or buf.nbytes < nbytes:
        buf = store[key] = np.empty(nbytes, np.uint8)
    return buf[:nbytes]


def load_params(path: str, cfg: ModelConfig, shardings=None,
                on_tensor: Callable[[str, jax.Array], None] | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Reads the weights of the checkpoint at ``path`` into params for the model cfg describes.

    Args:
      path: the checkpoint directory.
      cfg: the model config (normally ``hf_config.model_config_from_checkpoint(path, ...)``);
        params are cast to cfg.param_dtype.
      shardings: where each parameter goes (a pytree of NamedSharding like the params, e.g.
        ``Layout.params``): each tensor is placed straight onto its shards, each device receiving
        only its slice. None: whole, on the default device.
      on_tensor: called with (HF name, the placed array) after each tensor, in file order.

    Returns:
      (graphdef, params) as ``llama.init_params`` returns them.

    Raises:
      ValueError: naming the tensor, if one the model needs is missing, has the wrong shape, or
        the checkpoint holds a tensor the model has no place for.
    """
    graphdef, abstract = abstract_params(cfg)
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
    by_file = collections.defaultdict(list)
    for name in wanted:
        by_file[files[name]].append(name)
    index = {file: tensor_index(file) for file in by_file}
    for file, names in by_file.items():  # every shape checked before the first byte is read
        for name in names:
            p, var = wanted[name]
            _check_shape(path, name, index[file][name].shape, tuple(var.get_value().shape), is_kernel(p))
    dtype = _NP_DTYPES[cfg.param_dtype]
    target = None if shardings is None else {p: _value(s) for p, s in nnx.to_flat_state(shardings)}
    loaded, scratch = {}, {}
    workers = min(4, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for file in sorted(by_file):
            fd = os.open(file, os.O_RDONLY)
            try:
                work = [(wanted[n][0], index[file][n]) for n in by_file[file]]
                if target is None:
                    copy = lambda pe: _device_copy(fd, *pe, dtype, scratch)  # noqa: E731
                else:
                    mapped = np.memmap(file, np.uint8, mode="r")  # column slices: their pages only
                    copy = lambda pe: _sharded_copy(fd, mapped, *pe, dtype, target[pe[0]], scratch)  # noqa: E731
                for p, array in _bounded_map(pool, copy, work, 2 * workers):
                    loaded[p] = wanted[hf_name(p)][1].replace(array)
                    if on_tensor is not None:
                        on_tensor(hf_name(p), array)
            finally:
                os.close(fd)
    params = nnx.from_flat_state([(p, loaded[p]) for p, _ in flat])
    return graphdef, params


def _check_shape(path: str, name: str, shape: tuple, want: tuple, kernel: bool) -> None:
    got = shape[::-1] if kernel else shape
    if tuple(got) != want:
        raise ValueError(f"tensor {name!r} in {path!r} has shape {tuple(shape)}, "
                         f"the model expects {want[::-1] if kernel else want}")


def _bounded_map(pool, fn, items, limit):
    """pool.map(fn, items) in order, with at most ``limit`` results held (bounds host memory)."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= limit:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _device_copy(fd: int, path: tuple, entry: TensorEntry, dtype: np.dtype,
                 scratch: dict) -> tuple[tuple, jax.Array]:
    """(path, the tensor on the device). The one copy into the parameter's own buffer (a read
    straight into it, or a transpose + cast from a per-thread scratch read) goes into a
    64-byte-aligned array, which jax.device_put on CPU adopts without a second copy. File reads
    and NumPy copies release the GIL, so the pool's threads work in parallel."""
    kernel = is_kernel(path)
    out = aligned_empty(entry.shape[::-1] if kernel else entry.shape, dtype)
    if not kernel and entry.dtype == dtype:
        _read_into(fd, entry, out)
    else:
        src = _read_into(fd, entry, _scratch(scratch, entry.nbytes))
        if kernel:
            transpose_into(out, src)
        else:
            np.copyto(out, src, casting="same_kind")
    return path, jax.device_put(out)


def _value(leaf):
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def _sharded_copy(fd: int, mapped: np.ndarray, path: tuple, entry: TensorEntry, dtype: np.dtype,
                  sharding: jax.sharding.Sharding, scratch: dict) -> tuple[tuple, jax.Array]:
    """(path, the tensor on its shards): each of this process's devices gets its own slice;
    devices holding the same slice (replicated axes) share one read.

    HF stores row-major [out, in]. A slice of whole HF rows is one contiguous read. Column
    slices (a kernel's input axis split over fsdp) whose union is whole rows (all of this
    process's devices together hold every column) share one read of those rows; narrower ones (a
    host holding some columns only) are copied out of the memory map, which reads their pages.
    """
    kernel = is_kernel(path)
    shape = entry.shape[::-1] if kernel else entry.shape
    flip = (lambda b: b[::-1]) if kernel else (lambda b: b)  # noqa: E731  model <-> file axis order
    wanted = {tuple(s.indices(n)[:2] for s, n in zip(index, shape))
              for index in sharding.addressable_devices_indices_map(shape).values()}
    rows = _rows_source(fd, entry, [flip(b) for b in wanted], scratch)
    slices: dict[tuple, np.ndarray] = {}

    def shard(index: tuple) -> np.ndarray:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if bounds in slices:
            return slices[bounds]
        stored, out = flip(bounds), aligned_empty(tuple(b - a for a, b in bounds), dtype)
        if _whole_rows(stored, entry.shape) and not kernel and entry.dtype == dtype:
            _read_rows(fd, entry, stored[0] if stored else (0, 1), None, out)  # straight into the shard
            src = out
        elif _whole_rows(stored, entry.shape):
            src = _read_rows(fd, entry, stored[0] if stored else (0, 1), scratch)
        elif rows is not None:
            block, lo = rows
            src = block[(slice(stored[0][0] - lo, stored[0][1] - lo),) + tuple(slice(a, b) for a, b in stored[1:])]
        else:
            whole = np.ndarray(entry.shape, entry.dtype, buffer=mapped, offset=entry.offset)
            src = whole[tuple(slice(a, b) for a, b in stored)]
        if src is not out:
            if kernel:
                transpose_into(out, src)
            else:
                np.copyto(out, src, casting="same_kind")
        slices[bounds] = out
        return out

    return path, jax.make_array_from_callback(shape, sharding, shard, dtype=dtype)


def _whole_rows(stored: tuple, shape: tuple) -> bool:
    return all(a == 0 and b == n for (a, b), n in zip(stored[1:], shape[1:]))


def _rows_source(fd: int, entry: TensorEntry, stored: list, scratch: dict):
    """(the HF rows all column slices lie in, their first row) when the slices together span
    whole rows and at least one is narrower; else None."""
    if not entry.shape or all(_whole_rows(b, entry.shape) for b in stored):
        return None
    lo, hi = min(b[0][0] for b in stored), max(b[0][1] for b in stored)
    for axis in range(1, len(entry.shape)):
        if min(b[axis][0] for b in stored) > 0 or max(b[axis][1] for b in stored) < entry.shape[axis]:
            return None  # some columns are no device's here: read only the pages of the slices
    return _read_rows(fd, entry, (lo, hi), scratch, slot="rows"), lo


def _read_rows(fd: int, entry: TensorEntry, rows: tuple, scratch: dict | None, out=None,
               slot: str = "slice") -> np.ndarray:
    """HF rows [r0, r1) with one read: into a per-thread scratch buffer (to be transposed or
    cast), or with scratch None into out."""
    r0, r1 = rows
    row = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else entry.nbytes
    block = TensorEntry(entry.dtype, (r1 - r0, *entry.shape[1:]) if entry.shape else (), entry.offset + r0 * row,
                        (r1 - r0) * row)
    return _read_into(fd, block, out if scratch is None else _scratch(scratch, block.nbytes, slot))


def aligned_empty(shape: tuple, dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``alignment``-byte boundary
    (XLA's CPU client aliases only such buffers)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def transpose_into(out: np.ndarray, matrix: np.ndarray, rows: int = 128, pad: int = 16) -> None:
    """out[...] = matrix.T (cast to out's dtype), one block of rows at a time.

    Each block is first copied (contiguous) into a buffer whose row stride is padded: reading the
    columns of a matrix whose row stride is a power of two (e.g. 2048 floats) maps every row to
    the same cache sets, which made plain ``np.ascontiguousarray(matrix.T)`` 2-5x slower.
    """
    r, c = matrix.shape
    buf = np.empty((min(rows, r), c + pad), matrix.dtype)
    for i in range(0, r, rows):
        n = min(rows, r - i)
        buf[:n, :c] = matrix[i:i + n]
        np.copyto(out[:, i:i + n], buf[:n, :c].T, casting="same_kind")


def load_checkpoint(path: str, base: ModelConfig = ModelConfig(), shardings=None,
                    ) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Config and weights of a Hugging Face checkpoint directory.

    Args:
      path: directory with config.json and safetensors weights.
      base: supplies param_dtype and compute_dtype (the architecture comes from config.json).
      shardings: as for load_params (straight onto the mesh); None: one device.

    Returns:
      (model_cfg, graphdef, params).

    Raises:
      ValueError: unsupported architecture, missing tensor or shape mismatch (each named).
      FileNotFoundError: no config.json or no weights.
    """
    cfg = hf_config.model_config_from_checkpoint(path, base)
    graphdef, params = load_params(path, cfg, shardings)
    return cfg, graphdef, params
