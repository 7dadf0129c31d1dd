"""Sharding by logical axis names: the mesh, the rules, and the helpers the steps use.

The model declares what each parameter axis *is* (``vocab``, ``embed``, ``heads``, ``kv``,
``mlp``, ``norm``) where it creates the parameter (learner/models/llama.py); a rules table maps
those names to mesh axes (``data``, ``fsdp``, ``tensor``), as MaxText does. Activations use
``batch`` (rows, split over data x fsdp) and ``act_*`` names. The learner's train steps take a
``Layout`` (mesh + shardings of params, optimizer state and batch) and jit with explicit in/out
shardings; ``constrain`` pins activation layouts inside the traced model.

    layout = make_layout(learner_cfg.mesh, graphdef, abstract)   # None on a single device
    params = layout.place(params)                                  # each process places its shards
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # mesh axes that split the rows of a batch

# logical name -> mesh axes (in order). Parameters: embed rows are FSDP-split, heads / MLP width /
# vocabulary tensor-split; 1-D norm scales are split over both so every parameter's per-device
# share is exactly 1 / (fsdp x tensor). Activations: rows over data x fsdp, the MLP hidden and
# the logits' vocabulary over tensor, the residual stream whole on each device of a row shard.
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv", ("tensor",)),
    ("mlp", ("tensor",)),
    ("norm", ("fsdp", "tensor")),
    ("batch", BATCH),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
)


def parse_rules(overrides: Sequence[str] = ()) -> dict[str, tuple[str, ...]]:
    """DEFAULT_RULES with "logical=axis[+axis]" overrides applied ("name=" replicates)."""
    rules = dict(DEFAULT_RULES)
    for rule in overrides:
        name, _, axes = rule.partition("=")
        rules[name.strip()] = tuple(a.strip() for a in axes.split("+") if a.strip())
    return rules


def mesh_shape(cfg, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes for num_devices; -1 takes what the others leave.

    Raises ValueError naming learner.mesh.<axis> when the sizes do not multiply to num_devices.
    """
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise ValueError(f"learner.mesh: {dict(zip(AXES, sizes))} does not divide the "
                             f"{num_devices} devices")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ValueError(f"learner.mesh: data x fsdp x tensor = {math.prod(sizes)} but there are "
                         f"{num_devices} devices ({dict(zip(AXES, sizes))})")
    return tuple(sizes)


def make_mesh(cfg, devices: Sequence | None = None) -> Mesh:
    """Mesh(data, fsdp, tensor) over `devices` (default: every device of every process).

    Axes are Auto (GSPMD propagates shardings from the jit boundaries and constraints).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    try:
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    except (ValueError, NotImplementedError):  # device kinds make_mesh cannot lay out: plain order
        return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 3)


def logical_spec(names: Sequence[str | None], rules: dict, mesh: Mesh,
                 shape: Sequence[int] | None = None) -> P:
    """PartitionSpec for an array whose axes have these logical names.

    A mesh axis is used once per array (first come) and left out where it would not divide the
    dimension (e.g. 2 KV heads on tensor 4 stay whole), so any model shape is placeable.
    """
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        axes = []
        for axis in rules.get(name, ()) if name is not None else ():
            if axis in used or mesh.shape[axis] == 1:
                continue
            size = math.prod(mesh.shape[a] for a in axes) * mesh.shape[axis]
            if shape is not None and shape[i] % size:
                continue
            axes.append(axis)
            used.add(axis)
        spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return P(*spec)


# ---- activation constraints: active only while a sharded step traces the model ----

_ACTIVE: contextvars.ContextVar[tuple[Mesh, dict] | None] = contextvars.ContextVar("layout", default=None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """x with its layout pinned to the logical names (no-op outside a sharded step's trace)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(names, rules, mesh, x.shape)))


@contextlib.contextmanager
def _activation_rules(mesh: Mesh, rules: dict):
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _f32(tree):
    return jax.tree.map(lambda x: x.astype(np.float32) if hasattr(x, "astype") else x, tree)


def init_opt_state(optimizer: optax.GradientTransformation, params):
    """optimizer.init with float32 moments whatever the params' dtype (bf16 params, fp32 Adam)."""
    return optimizer.init(_f32(params))


def fp32_grads(grads):
    """Gradients in float32 for the optimizer (moments stay float32; apply_updates casts back)."""
    return _f32(grads)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the learner's arrays live on the mesh.

    params: NamedSharding per parameter (a pytree like the params); batch: rows of a microbatch;
    replicated: scalars, hyperparameters, metrics.
    """

    mesh: Mesh
    rules: dict
    params: Any  # pytree of NamedSharding, same structure as the params
    abstract: Any  # the params as ShapeDtypeStructs (what optimizer-state shardings derive from)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch(self) -> NamedSharding:
        return NamedSharding(self.mesh, logical_spec(("batch",), self.rules, self.mesh))

    @property
    def rows(self) -> int:
        """Devices a batch's rows are split over (microbatch sizes must be multiples)."""
        return math.prod(self.mesh.shape[a] for a in self.rules.get("batch", ()))

    def like(self, tree, shardings=None) -> Any:
        """Shardings for `tree`: `shardings` where given (a matching pytree), else replicated."""
        if shardings is not None:
            return shardings
        return jax.tree.map(lambda _: self.replicated, tree)

    def opt_state(self, optimizer: optax.GradientTransformation, params_shardings=None,
                  abstract_params=None) -> Any:
        """Shardings of init_opt_state(optimizer, params) (default: the model's params): moments
        like their params, the rest (counts, injected hyperparameters) replicated."""
        params_shardings = self.params if params_shardings is None else params_shardings
        abstract_params = self.abstract if abstract_params is None else abstract_params
        abstract = jax.eval_shape(lambda p: init_opt_state(optimizer, p), abstract_params)
        return optax.tree_utils.tree_map_params(
            optimizer, lambda _, s: s, abstract, params_shardings,
            transform_non_params=lambda _: self.replicated)

    def trained_shardings(self, tree, optimizer: optax.GradientTransformation) -> tuple[Any, Any]:
        """(shardings of `tree` by the logical names its leaves carry, shardings of optimizer's state
        for it): for a trained tree other than the model's params (a LoRA run's adapters)."""
        p = param_shardings(self.mesh, self.rules, tree)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        return p, self.opt_state(optimizer, p, abstract)

    def place(self, tree, shardings=None):
        """Puts host or single-device arrays on the mesh; every process keeps only its shards
        (each must hold the same full values, e.g. from the same seed or checkpoint)."""
        shardings = self.params if shardings is None else shardings
        return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x) if _needs_host(x, s) else x, s),
                            tree, shardings)

    def put_batch(self, host_rows: Sequence[np.ndarray]) -> list[jax.Array]:
        """Host arrays split by rows over data x fsdp (each process places its own rows)."""
        return jax.device_put(list(host_rows), self.batch)

    def process_rows(self, rows: int, process: int) -> np.ndarray:
        """Indices of the rows of a [rows, ...] batch that `process`'s devices hold, in the order
        put_process_rows takes them (ascending)."""
        spans = sorted({index[0].indices(rows)[:2]
                        for device, index in self.batch.devices_indices_map((rows,)).items()
                        if device.process_index == process})
        return np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0, np.int64)

    def put_process_rows(self, host_rows: Sequence[np.ndarray], rows: int) -> list[jax.Array]:
        """Arrays of `rows` rows split over data x fsdp, built from only this process's rows
        (host arrays cut by process_rows): what a learner process receives of a batch."""
        return [jax.make_array_from_process_local_data(self.batch, x, (rows, *x.shape[1:])) for x in host_rows]

    def scalar(self, value, dtype=np.float32) -> jax.Array:
        return jax.device_put(np.asarray(value, dtype), self.replicated)

    def activations(self, fn: Callable) -> Callable:
        """fn with activation constraints active while it is traced."""

        def wrapped(*args, **kwargs):
            with _activation_rules(self.mesh, self.rules):
                return fn(*args, **kwargs)

        return wrapped


def _needs_host(x, sharding) -> bool:
    # device_put onto devices of other processes takes host data only.
    return isinstance(x, jax.Array) and not sharding.is_fully_addressable


def param_shardings(mesh: Mesh, rules: dict, abstract_params) -> Any:
    """NamedSharding per parameter from the logical names its Variable was created with."""
    logical = nnx.get_partition_spec(abstract_params)  # Variables holding P(logical names)
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, logical_spec(tuple(spec), rules, mesh, x.shape)),
        logical, abstract_params, is_leaf=lambda s: isinstance(s, P))


def make_layout(mesh_cfg, abstract_params, *, devices: Sequence | None = None,
                force: bool = False) -> Layout | None:
    """The learner's Layout for the params of `abstract_params` (an nnx.State of arrays or
    ShapeDtypeStructs); None on a single device unless `force` (the plain program)."""
    mesh = make_mesh(mesh_cfg, devices)
    if mesh.size == 1 and not force:
        return None
    rules = parse_rules(mesh_cfg.rules)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params)
    return Layout(mesh, rules, param_shardings(mesh, rules, abstract_params), abstract)


def shard_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` laid out by `shardings` (the largest shard per array)."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        shape = s.shard_shape(tuple(x.shape))
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def live_device_bytes() -> dict[int, int]:
    """{device id: bytes of every array alive now on it}, each buffer counted once (a global array
    and a single-device view of one of its shards share the buffer): what a device holds while a
    load or a publication runs (instrumentation for tests and benchmarks)."""
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffers[shard.device.id, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    held: dict[int, int] = {}
    for (device, _), n in buffers.items():
        held[device] = held.get(device, 0) + n
    return held


def gather(tree, layout: Layout | None, dtype: str | None = None):
    """The arrays whole on this process's first device (what the built-in engine and exports use),
    cast to dtype if given (float32 master weights published as the model's bfloat16).

    One device: unchanged. Several devices of one process: a device-to-device copy. Several
    processes: a collective every process must join in the same order (learner/leader.py).
    """
    if dtype is not None:
        tree = jax.tree.map(lambda x: x.astype(dtype) if x.dtype != jnp.dtype(dtype) else x, tree)
    if layout is None:
        return tree
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_put(tree, jax.local_devices()[0])
    whole = _replicate(layout.replicated)(tree)
    return jax.tree.map(lambda x: x.addressable_data(0), whole)


@functools.lru_cache(maxsize=8)
def _replicate(replicated: NamedSharding):
    return jax.jit(lambda tree: tree, out_shardings=replicated)
