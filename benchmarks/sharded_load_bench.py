"""HF checkpoint load onto a 4-device CPU mesh (fsdp 4): straight into the mesh vs whole on one
device then placed (the old way), with the one-device load beside them.

Each phase runs in a fresh subprocess (JAX fixes the device count at start) on the same
checkpoint (default: SmolLM2-135M-Instruct, converted by benchmarks/real_model.py):
  one:    ``hf_load.load_params(path, cfg)``, the tuned one-device path.
  whole:  4 devices: the one-device load, then ``Layout.place`` (what build_policy did before).
  direct: 4 devices: ``hf_load.load_params(path, cfg, layout.params)``.
Seconds are the best of --repeats (page cache warm). Per-device peak bytes come from an extra run
that counts, after each tensor is placed, the live arrays' buffers on each device.
Prints one JSON line. Run: `.venv/bin/python benchmarks/sharded_load_bench.py [--ckpt DIR]`.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_CKPT = os.path.expanduser("~/.cache/cadence/smollm2-135m-instruct")


def _phase(name: str, ckpt: str, repeats: int, measure: bool) -> dict:
    import jax

    if name != "one":
        jax.config.update("jax_num_cpu_devices", 4)
    from cadence.learner import sharding
    from cadence.learner.config import MeshConfig
    from cadence.learner.models import hf_config, hf_load
    from cadence.learner.models.llama import abstract_params

    cfg = hf_config.model_config_from_checkpoint(ckpt)
    abstract = abstract_params(cfg)[1]
    layout = None if name == "one" else sharding.make_layout(MeshConfig(fsdp=4), abstract)
    peak = collections.Counter()

    def record(_name, _array):
        for device, n in sharding.live_device_bytes().items():
            peak[device] = max(peak[device], n)

    def load(hook=None):
        if name == "direct":
            return hf_load.load_params(ckpt, cfg, layout.params, on_tensor=hook)[1]
        params = hf_load.load_params(ckpt, cfg, on_tensor=hook)[1]
        return params if layout is None else layout.place(params)

    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(load())
        seconds.append(time.perf_counter() - t0)
    out = {"seconds": min(seconds)}
    if measure:
        jax.block_until_ready(load(record))
        out.update(peak_device_bytes=max(peak.values()), shard_bytes=sharding.shard_bytes(abstract, layout.params),
                   whole_bytes=sharding.tree_bytes(abstract))
    return out


def _run(name: str, ckpt: str, repeats: int, measure: bool = False) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, __file__, "--phase", name, "--ckpt", ckpt, "--repeats", str(repeats)]
    proc = subprocess.run(args + (["--measure"] if measure else []), env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=DEFAULT_CKPT)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phase", choices=["one", "whole", "direct"], help=argparse.SUPPRESS)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(_phase(args.phase, args.ckpt, args.repeats, args.measure)))
        return
    one = _run("one", args.ckpt, args.repeats)
    whole = _run("whole", args.ckpt, args.repeats, measure=True)
    direct = _run("direct", args.ckpt, args.repeats, measure=True)
    print(json.dumps({
        "bench": "sharded_load", "checkpoint": os.path.basename(args.ckpt.rstrip("/")), "mesh": "fsdp 4 (CPU)",
        "one_device_load_seconds": round(one["seconds"], 3),
        "whole_then_place_seconds": round(whole["seconds"], 3),
        "direct_seconds": round(direct["seconds"], 3),
        "shard_bytes_per_device": direct["shard_bytes"],
        "whole_bytes": direct["whole_bytes"],
        "whole_then_place_peak_device_bytes": whole["peak_device_bytes"],
        "direct_peak_device_bytes": direct["peak_device_bytes"],
    }))


if __name__ == "__main__":
    main()
