"""Low-rank adapters (LoRA) on a frozen base: the model side.

A LoRA policy is the Llama of llama.py built with ``lora=`` (learner.lora): each targeted
projection is an ``nnx.LoRALinear`` whose kernel keeps its path (``layers[i].self_attn.q_proj.kernel``)
and whose adapters sit beside it, float32 ``nnx.LoRAParam``s:

    layers[i].self_attn.q_proj.lora.lora_a   [in, r]   sharded like the kernel's input axis
    layers[i].self_attn.q_proj.lora.lora_b   [r, out]  sharded like its output axis; zeros at start

and computes ``x W (+ b) + alpha / r * (x A) B`` (PEFT's scaling; nnx.LoRA has none). The base part
of the LoRA params is exactly the plain model's params, so a checkpoint loads unchanged:

    graphdef, adapters = init_adapters(model_cfg, lora_cfg, seed)      # adapters only
    params = join(base, adapters)             # nnx.merge(graphdef, params) runs base + adapters
    adapters, base = split(params)            # what trains, what stays frozen
    merged = merge_weights(base, adapters, lora_cfg)   # plain-model params: W + alpha / r * A B

``merged`` is what actors, evaluation and the Hugging Face export get (every engine and weight sync
works unchanged); ``peft_tensors`` / ``write_peft_adapter`` write the adapters as a PEFT directory.

Dropout (learner.lora.dropout > 0) acts on the adapters' input, as PEFT's ``lora_dropout`` does
(``lora_B(lora_A(dropout(x)))``, the base path undropped), and only while a train step traces its
gradient pass inside ``adapter_dropout(key, rate)``; everywhere else (sampling, evaluation, the
decoupled correction's proximal log-probs, exports) the adapters run whole, as PEFT's do in eval().
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cadence.learner.models.config import ModelConfig

# learner.lora.targets -> the Hugging Face module name (PEFT's target_modules)
HF_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


class ScaledLoRALinear(nnx.LoRALinear):
    """nnx.LoRALinear with PEFT's scaling alpha / rank, float32 adapters computed in the layer's
    compute dtype, and the adapters' axes named after the kernel's (``names`` = (in, out))."""

    def __init__(self, d_in: int, d_out: int, lora, names: tuple[str, str], init, **kwargs):
        super().__init__(
            d_in, d_out, lora_rank=lora.rank, lora_dtype=kwargs["dtype"], lora_param_dtype=jnp.float32,
            a_initializer=init(nnx.initializers.he_uniform()),  # nnx.LoRA's default
            b_initializer=init(nnx.initializers.zeros_init()),  # zero: the start is the base
            a_metadata={"out_sharding": (names[0], None), "eager_sharding": False},
            b_metadata={"out_sharding": (None, names[1]), "eager_sharding": False},
            **kwargs)
        self.lora_scale = float(lora.alpha) / lora.rank

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
        dropout = _DROPOUT.get()
        return y + self.lora(x if dropout is None else dropout(x)) * self.lora_scale


class _Dropout:
    """Inverted dropout for one traced forward: the n-th adapter reached draws its mask from
    fold_in(key, n) (the layers run in a fixed order, so a key names every mask of the pass)."""

    def __init__(self, key: jax.Array, rate: float):
        self.key, self.rate, self.count = key, float(rate), 0

    def __call__(self, x: jax.Array) -> jax.Array:
        keep = jax.random.bernoulli(jax.random.fold_in(self.key, self.count), 1.0 - self.rate, x.shape)
        self.count += 1
        return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros((), x.dtype))


_DROPOUT: contextvars.ContextVar[_Dropout | None] = contextvars.ContextVar("lora_dropout", default=None)


@contextlib.contextmanager
def adapter_dropout(key: jax.Array | None, rate: float):
    """While active (a train step tracing its loss), every adapter's input passes through inverted
    dropout at `rate` (masks from `key`, a typed PRNG key); a no-op for key None or rate 0."""
    if key is None or not rate > 0:
        yield
        return
    token = _DROPOUT.set(_Dropout(key, rate))
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def dropout_key(seed: int, step, minibatch, microbatch) -> jax.Array:
    """The key of one microbatch's dropout masks (traceable): learner.seed, then the update's step
    (the policy version a checkpoint restores), its minibatch and the microbatch: a resumed run
    draws the masks an uninterrupted one drew, on any number of processes."""
    key = jax.random.fold_in(jax.random.key(seed), 0x6C6F7261)  # apart from init_adapters' keys
    for value in (step, minibatch, microbatch):
        key = jax.random.fold_in(key, value)
    return key


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """LoRA params -> (adapters, base): the LoRAParam leaves, and everything else (the plain
    model's params, path for path)."""
    return nnx.split_state(params, nnx.LoRAParam, ...)


def join(base: nnx.State, adapters: nnx.State) -> nnx.State:
    """The inverse of ``split``: the params the LoRA graphdef merges with."""
    return nnx.merge_state(base, adapters)


def on_mesh(layout, adapters: nnx.State, shardings) -> nnx.State:
    """The adapters placed by `shardings` on the layout's mesh: fresh ones (the same values on every
    process) are put there; those already there (a warm-up's, a restore's) are kept as they are."""
    return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s else layout.place(x, s),
                        adapters, shardings)


def lora_graphdef(model_cfg: ModelConfig, lora_cfg) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef of the LoRA model, its adapters as ShapeDtypeStructs with sharding metadata)."""
    from cadence.learner.models.llama import abstract_params

    graphdef, abstract = abstract_params(model_cfg, lora_cfg)
    return graphdef, split(abstract)[0]


def init_adapters(model_cfg: ModelConfig, lora_cfg, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """(LoRA graphdef, fresh adapters): A he-uniform from `seed` (one key per adapter, in path
    order), B zero, so the LoRA model starts exactly at its base. The base is not touched."""
    graphdef, abstract = lora_graphdef(model_cfg, lora_cfg)
    flat = list(nnx.to_flat_state(abstract))
    he = nnx.initializers.he_uniform()

    def make():
        key = jax.random.key(seed)
        out = []
        for i, (path, var) in enumerate(flat):
            shape, dtype = var.get_value().shape, var.get_value().dtype
            value = (he(jax.random.fold_in(key, i), shape, dtype) if path[-1] == "lora_a"
                     else jnp.zeros(shape, dtype))
            out.append(value)
        return out

    values = jax.jit(make)()
    return graphdef, nnx.from_flat_state([(p, v.replace(x)) for (p, v), x in zip(flat, values)])


def _kernel_path(adapter_path: tuple) -> tuple:
    return (*adapter_path[:-2], "kernel")  # (..., q_proj, lora, lora_a) -> (..., q_proj, kernel)


def _pairs(adapters: nnx.State) -> dict[tuple, dict[str, jax.Array]]:
    """{kernel path: {"a": [in, r], "b": [r, out]}}."""
    pairs: dict[tuple, dict] = {}
    for path, var in nnx.to_flat_state(adapters):
        pairs.setdefault(_kernel_path(path), {})[path[-1][-1]] = var.get_value()
    return pairs


def merge_weights(base: nnx.State, adapters: nnx.State, lora_cfg) -> nnx.State:
    """Plain-model params with every targeted kernel replaced by W + alpha / rank * A B (in float32,
    then the kernel's dtype). Pure and jittable; the inputs are not modified."""
    scale = float(lora_cfg.alpha) / lora_cfg.rank
    pairs = _pairs(adapters)
    out = []
    for path, var in nnx.to_flat_state(base):
        pair = pairs.get(tuple(path))
        if pair is None:
            out.append((path, var))
            continue
        w = var.get_value()
        delta = jnp.dot(pair["a"].astype(jnp.float32), pair["b"].astype(jnp.float32))
        out.append((path, var.replace((w.astype(jnp.float32) + scale * delta).astype(w.dtype))))
    return nnx.from_flat_state(out)


def adapter_bytes(adapters: nnx.State) -> int:
    """Bytes of the adapters (arrays or ShapeDtypeStructs)."""
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(adapters)))


# ---- PEFT ---------------------------------------------------------------------------------------

def peft_tensors(adapters: nnx.State) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names and layout: ``base_model.model.model.layers.{i}.self_attn.
    q_proj.lora_A.weight`` = A.T [r, in] and ``...lora_B.weight`` = B.T [out, r] (torch Linear
    weights are [out, in]; Cadence kernels are [in, out])."""
    out = {}
    for kernel, pair in _pairs(adapters).items():
        module = "base_model.model.model." + ".".join(str(p) for p in kernel[:-1])
        out[f"{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(pair["a"], np.float32).T)
        out[f"{module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(pair["b"], np.float32).T)
    return out


def peft_config(lora_cfg, base_path: str = "") -> dict:
    """adapter_config.json: the fields peft.LoraConfig and SGLang's LoRA loader read (rsLoRA off:
    the scale is alpha / r)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path or None,
        "r": int(lora_cfg.rank), "lora_alpha": float(lora_cfg.alpha),
        "target_modules": sorted(HF_MODULES[t] for t in lora_cfg.targets),
        "lora_dropout": float(lora_cfg.dropout), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "inference_mode": True,
    }


def write_peft_adapter(adapters: nnx.State, lora_cfg, out_dir: str, base_path: str = "") -> str:
    """Writes adapter_config.json and adapter_model.safetensors (PEFT's names) to out_dir, which
    ``peft.PeftModel.from_pretrained(base_model, out_dir)`` loads. Returns out_dir."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(peft_tensors(jax.device_get(adapters)), os.path.join(out_dir, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(lora_cfg, base_path), f, indent=2)
    return out_dir
