"""An HF checkpoint loaded straight onto a 4-device CPU mesh (run by sharded_load_test.py).

`python sharded_load_checks.py CKPT_DIR` prints one JSON line per (mesh, dtype): the largest
parameter bytes any device held after any tensor was placed (counted from jax.live_arrays()),
the per-device shard of the whole model, the largest tensor, whether every value equals the
one-device load, and the same peak for the old way (whole on one device, then placed).
"""
from __future__ import annotations

import collections
import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cadence.learner import sharding  # noqa: E402
from cadence.learner.config import MeshConfig  # noqa: E402
from cadence.learner.models import hf_config, hf_load  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.models.llama import abstract_params  # noqa: E402

MESHES = {"fsdp4": MeshConfig(fsdp=4), "fsdp2_tensor2": MeshConfig(fsdp=2, tensor=2),
          "data2_fsdp2": MeshConfig(data=2, fsdp=2)}


def main(ckpt: str) -> None:
    assert len(jax.devices()) == 4
    for dtype in ("float32", "bfloat16"):
        cfg = hf_config.model_config_from_checkpoint(ckpt, ModelConfig(param_dtype=dtype))
        whole_bytes = sharding.tree_bytes(abstract_params(cfg)[1])
        for name, mesh in MESHES.items():
            layout = sharding.make_layout(mesh, abstract_params(cfg)[1])
            peak, largest = collections.Counter(), 0

            def record(_name, array):
                nonlocal largest
                largest = max(largest, array.nbytes)
                for device, n in sharding.live_device_bytes().items():
                    peak[device] = max(peak[device], n)

            _, params = hf_load.load_params(ckpt, cfg, layout.params, on_tensor=record)
            placed_as_laid_out = all(
                a.sharding == s for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(layout.params)))
            sharded = [np.asarray(x) for x in jax.tree.leaves(params)]
            del params
            # the old way: the whole model on the default device, then placed by the layout
            _, whole = hf_load.load_params(ckpt, cfg)
            before_place = max(sharding.live_device_bytes().values())
            same = all(np.array_equal(a, np.asarray(b), equal_nan=True)
                       for a, b in zip(sharded, jax.tree.leaves(whole)))
            del whole
            print(json.dumps({
                "mesh": name, "dtype": dtype, "peak_device_bytes": max(peak.values()),
                "shard_bytes": sharding.shard_bytes(abstract_params(cfg)[1], layout.params),
                "largest_tensor_bytes": largest, "whole_bytes": whole_bytes,
                "whole_then_place_peak_bytes": before_place,
                "same_values": same, "placed_as_laid_out": placed_as_laid_out}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
