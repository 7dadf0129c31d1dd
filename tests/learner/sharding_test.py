"""Sharding rules, meshes, the command channel's wire format, and the layout path on one device.

The multi-device and multi-process checks run in child processes (sharded_step_test.py,
tests/e2e/learner_group_test.py); these run on this suite's single device.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from cadence.learner import multihost, sharding
from cadence.learner.batching import Microbatch, build_microbatches
from cadence.learner.config import DistributedConfig, LearnerConfig, MeshConfig, OptimizerConfig
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig
from cadence.learner.steps import make_train_step
from cadence.protocols.testing import rollout_group


class FakeMesh:
    """Only .shape is read by logical_spec."""

    def __init__(self, **shape):
        self.shape = {"data": 1, "fsdp": 1, "tensor": 1, **shape}


def test_logical_names_map_to_mesh_axes_and_skip_what_does_not_divide():
    rules = sharding.parse_rules()
    mesh = FakeMesh(fsdp=2, tensor=4)
    assert sharding.logical_spec(("vocab", "embed"), rules, mesh, (64, 32)) == P("tensor", "fsdp")
    assert sharding.logical_spec(("norm",), rules, mesh, (64,)) == P(("fsdp", "tensor"))
    # 2 KV heads x 4 wide = 8 columns: tensor 4 divides; 6 columns do not -> kept whole on tensor
    assert sharding.logical_spec(("embed", "kv"), rules, mesh, (32, 6)) == P("fsdp", None)
    assert sharding.logical_spec(("batch", None, "act_embed"), rules, mesh, (8, 16, 32)) == P("fsdp", None, None)
    # a mesh axis is used once per array; size-1 axes are left out
    assert sharding.logical_spec(("embed", "embed"), rules, mesh, (4, 4)) == P("fsdp", None)
    assert sharding.logical_spec(("batch",), rules, FakeMesh(data=2, fsdp=2)) == P(("data", "fsdp"))
    over = sharding.parse_rules(["embed=", "mlp=fsdp+tensor"])
    assert sharding.logical_spec(("embed", "mlp"), over, mesh, (32, 64)) == P(None, ("fsdp", "tensor"))


def test_mesh_sizes_fill_the_devices_and_name_the_key_when_they_cannot():
    assert sharding.mesh_shape(MeshConfig(), 8) == (1, 8, 1)
    assert sharding.mesh_shape(MeshConfig(data=2, tensor=2), 8) == (2, 2, 2)
    assert sharding.mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=1), 6) == (3, 2, 1)
    with pytest.raises(ValueError, match="learner.mesh"):
        sharding.mesh_shape(MeshConfig(tensor=3), 4)
    with pytest.raises(ValueError, match="learner.mesh"):
        sharding.mesh_shape(MeshConfig(data=2, fsdp=2, tensor=2), 4)
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, fsdp=-1).validate()


def test_every_llama_param_declares_logical_axes():
    cfg = ModelConfig(qkv_bias=True, qk_norm=True, tie_embeddings=False)
    _, abstract = llama.abstract_params(cfg)
    specs = jax.tree.leaves(jax.tree.map(lambda v: v, __import__("flax").nnx.get_partition_spec(abstract)),
                            is_leaf=lambda x: isinstance(x, P))
    shapes = jax.tree.leaves(abstract)
    assert len(specs) == len(shapes)
    for spec, x in zip(specs, shapes):
        assert len(spec) == x.ndim and all(name in dict(sharding.DEFAULT_RULES) for name in spec), spec


def test_one_device_gets_the_plain_program_unless_forced():
    _, abstract = llama.abstract_params(ModelConfig())
    assert sharding.make_layout(MeshConfig(), abstract) is None
    layout = sharding.make_layout(MeshConfig(), abstract, force=True)
    assert layout.mesh.size == 1 and layout.rows == 1


def _groups(n, seed):
    rng = np.random.default_rng(seed)
    return [rollout_group(f"g{i}", "t", [1, 5], [[int(x) for x in rng.integers(3, 30, 5)] for _ in range(4)],
                          [[-1.0] * 5] * 4, [float(x) for x in rng.random(4)], 0) for i in range(n)]


def test_layout_path_on_one_device_equals_the_plain_step():
    # The sharded code path (explicit shardings, placement, activation constraints) on a 1-device
    # mesh computes what the plain path does, and a batch-size change does not recompile it.
    mcfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=8)
    graphdef, params = llama.init_params(mcfg, 0)
    cfg = LearnerConfig(batch_size=16, microbatch_size=4, group_size=4, optimizer=OptimizerConfig(lr=1e-2))
    layout = sharding.make_layout(cfg.mesh, params, force=True)
    plain, sharded = make_train_step(graphdef, cfg), make_train_step(graphdef, cfg, layout)
    s1, s2 = plain.init(params), sharded.init(layout.place(params))
    for k, n in enumerate((3, 1, 2)):
        mbs, stats = build_microbatches(_groups(n, k), 8, 4, 0, cfg.grpo)
        s1, m1 = plain.update(s1, mbs, stats["num_tokens"])
        s2, m2 = sharded.update(s2, mbs, stats["num_tokens"])
        np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert sharded.cache_sizes() == {"zeros": 1, "accumulate": 1, "apply": 1, "accumulate_apply": 1}  # n=1: fused
    whole = sharding.gather(s2.params, layout, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(whole)} == {np.dtype(jax.numpy.bfloat16)}


def test_channel_wire_format_round_trips_arrays_without_pickle():
    arrays = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.array([True, False]),
              "c": np.array([1.5, -2.25], np.float32), "d": np.zeros((0, 4), np.float32),
              "e": np.array(7, np.int64), "f": np.arange(3, dtype=np.uint8)}
    words = multihost.encode("update", {"num_tokens": 12, "x": [1, 2]}, arrays)
    assert words.dtype == np.int32
    command, meta, out = multihost.decode(words)
    assert command == "update" and meta == {"num_tokens": 12, "x": [1, 2]}
    for k, v in arrays.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and np.array_equal(out[k], v), k
    with pytest.raises(TypeError, match="object"):
        multihost.encode("x", {}, {"o": np.array([{}], dtype=object)})
    assert multihost._bucket(1) == 256 and multihost._bucket(257) == 512 and multihost._bucket(4096) == 4096


def test_microbatches_cross_the_channel_unchanged():
    mbs, _ = build_microbatches(_groups(3, 0), 8, 4, 0, LearnerConfig().grpo)
    back = multihost.microbatches_from(multihost.decode(multihost.encode("u", {}, multihost.microbatch_arrays(mbs)))[2])
    assert len(back) == len(mbs)
    for a, b in zip(mbs, back):
        assert isinstance(b, Microbatch)
        for x, y in zip(a, b):
            assert np.array_equal(np.asarray(x), y) and np.asarray(x).dtype == y.dtype


def test_join_without_a_group_is_one_process_and_half_a_group_names_the_keys(monkeypatch):
    for var in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
        monkeypatch.delenv(var, raising=False)
    assert multihost.join(DistributedConfig()) == multihost.Group(0, 1)
    monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match="coordinator, num_processes and process_id"):
        multihost.join(DistributedConfig())
    with pytest.raises(ValueError, match="process_id"):
        DistributedConfig(num_processes=2, process_id=2).validate()
    with pytest.raises(ValueError, match="processes"):
        LearnerConfig(processes=2, distributed=DistributedConfig(coordinator="h:1")).validate()
