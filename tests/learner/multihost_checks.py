"""Two learner processes (2 CPU devices each, mesh fsdp 2 x tensor 2 across them): process 0 leads.

Run by multihost_test.py: `python multihost_checks.py OUT_DIR` twice, with CADENCE_COORDINATOR,
CADENCE_NUM_PROCESSES=2 and CADENCE_PROCESS_ID set. Checks on process 0: two updates through the
channel equal a single-device reference; an HF checkpoint loads onto the mesh across both
processes, each process reading its slices, equal to a one-device load; a weight-sync bucket of an *older* params generation
(as an actor thread's sync sees it after the learner moved on) arrives whole and exact; an HF
export written a shard at a time equals the gathered params; an asynchronous checkpoint save
reaches every process; each update delivers the follower only its rows (fewer bytes than the whole batch).
Each process writes OUT_DIR/result-<id>.json.
"""
from __future__ import annotations

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cadence.learner import sharding  # noqa: E402
from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from cadence.learner.config import DistributedConfig, LearnerConfig, MeshConfig, OptimizerConfig  # noqa: E402
from cadence.learner.leader import Follower, Leader  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.models import hf_load  # noqa: E402
from cadence.learner.models.hf_export import export_checkpoint, hf_tensors  # noqa: E402
from cadence.learner.models.hf_random import write_random_checkpoint  # noqa: E402
from cadence.learner.multihost import _bucket, encode, join, microbatch_arrays  # noqa: E402
from cadence.learner.steps import make_train_step  # noqa: E402
from cadence.protocols.testing import rollout_group  # noqa: E402

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
CFG = LearnerConfig(batch_size=16, microbatch_size=4, group_size=4, optimizer=OptimizerConfig(lr=3e-3),
                    mesh=MeshConfig(fsdp=2, tensor=2))


def groups(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        comps = [[int(x) for x in rng.integers(3, 32, rng.integers(2, 12))] for _ in range(4)]
        out.append(rollout_group(f"g{i}", "t", [1, 4, 5], comps, [[-float(rng.exponential()) for _ in c] for c in comps],
                                 [float(x) for x in rng.random(4)], 0))
    return out


def arrays_of(state) -> dict:
    return {"params": state.params, "opt_state": state.opt_state}


def host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def check_hf_load(out_dir: str, process: int, layout) -> bool:
    """An HF checkpoint loaded onto the mesh across both processes (each reads only the slices
    its devices hold: here half the rows of tensor-split and half the columns of fsdp-split
    kernels) equals a one-device load on every shard."""
    ckpt = os.path.join(out_dir, f"hf-in-{process}")  # each process writes the same checkpoint
    write_random_checkpoint(ckpt, MODEL, tokenizer=False, max_shard_bytes=20_000)
    _, sharded = hf_load.load_params(ckpt, MODEL, layout.params)
    _, whole = hf_load.load_params(ckpt, MODEL)
    return all(a.sharding == s and all(np.array_equal(np.asarray(shard.data), np.asarray(w)[shard.index])
                                       for shard in a.addressable_shards)
               for a, w, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole), jax.tree.leaves(layout.params)))


def main(out_dir: str) -> None:
    group = join(DistributedConfig())  # from the environment
    assert group.num_processes == 2 and len(jax.devices()) == 4
    _, abstract = llama.abstract_params(MODEL)
    layout = sharding.make_layout(CFG.mesh, abstract)
    graphdef, params = llama.init_params(MODEL, 0, layout.params)
    hf_load_ok = check_hf_load(out_dir, group.process_id, layout)
    step = make_train_step(graphdef, CFG, layout)
    ckpt = Checkpointer(os.path.join(out_dir, "ckpt"), CheckpointConfig())  # asynchronous saves
    result = {"process": group.process_id, "hf_load_ok": hf_load_ok}
    if not group.is_leader:
        follower = Follower(group, layout, step, params, ckpt, arrays_of)
        final = follower.run()
        rows = layout.process_rows(4, group.process_id).tolist()
        result.update(steps=int(final.step), held=sorted(follower.held), commands=follower.channel.commands,
                      update_bytes=follower.received_bytes["update"], rows=rows)
    else:
        lead = Leader(group, layout, params)
        leader_step = lead.wrap_step(step)
        state = leader_step.init(params)
        # single-device reference, from the same initial params
        plain = make_train_step(graphdef, CFG)
        ref = plain.init(lead.gather(state.params))
        batches = [build_microbatches(groups(n, k), 16, 4, 0, CFG.grpo) for k, n in enumerate((3, 2))]
        s1, m1 = leader_step.update(state, batches[0][0], batches[0][1]["num_tokens"])
        ref, r1 = plain.update(ref, batches[0][0], batches[0][1]["num_tokens"])
        whole1 = host(lead.gather(s1.params))
        s2, m2 = leader_step.update(s1, batches[1][0], batches[1][1]["num_tokens"])
        ref, r2 = plain.update(ref, batches[1][0], batches[1][1]["num_tokens"])
        losses = [[m1["loss"], r1["loss"]], [m2["loss"], r2["loss"]]]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(host(lead.gather(s2.params)), host(ref.params)))
        # a sync that took version 1 before the learner moved on: one bucket, fetched then
        from cadence.actors.sglang.weight_broadcast import bucket_tensors
        tensors = hf_tensors(MODEL, s1.params)
        bucket = bucket_tensors(tensors[:4], None, "gloo", gather=lead.fetch)
        by_leaf = {id(x): i for i, x in enumerate(jax.tree.leaves(s1.params))}
        bucket_ok = all(
            np.array_equal(t.numpy(), whole1[by_leaf[id(src.value)]].T if src.transposed else whole1[by_leaf[id(src.value)]])
            for (_, t), src in zip(bucket, tensors[:4]))
        export_checkpoint(MODEL, s2.params, os.path.join(out_dir, "hf"), max_shard_bytes=20_000, fetch=lead.fetch)
        from safetensors.numpy import load_file
        exported = {}
        for name in sorted(os.listdir(os.path.join(out_dir, "hf"))):
            if name.endswith(".safetensors"):
                exported.update(load_file(os.path.join(out_dir, "hf", name)))
        whole2 = [(t, np.asarray(jax.device_get(t.value))) for t in hf_tensors(MODEL, lead.gather(s2.params))]
        export_ok = set(exported) == {t.name for t, _ in whole2} and all(
            np.array_equal(exported[t.name], w.T if t.transposed else w) for t, w in whole2)
        gen1 = lead.generation(s1.params)
        del s1, tensors, bucket, by_leaf  # version 1 is gone on process 0: the next command releases it
        lead.wrap_checkpointer(ckpt).save(2, arrays_of(s2), {"step": 2})  # written while the next update runs
        save_was_async = ckpt._pending is not None  # returned before the write finished
        # a larger batch (16 microbatches), where what a process receives is mostly its rows
        batches.append(build_microbatches(groups(16, 2), 16, 4, 0, CFG.grpo))
        ckpt.wait()  # the update donates the Adam moments being written (LearnerLoop's before_update)
        s3, _ = leader_step.update(s2, batches[2][0], batches[2][1]["num_tokens"])
        lead.stop()
        # what a whole-batch broadcast of the same updates delivered to each process (its length,
        # then the payload padded to its bucket), the protocol before rows were cut per process
        whole_bytes = sum(4 + 4 * _bucket(len(encode("update", {}, microbatch_arrays(mbs)))) for mbs, _ in batches)
        result.update(losses=losses, whole_bytes=whole_bytes, save_was_async=save_was_async, max_param_diff=diff, bucket_ok=bucket_ok, export_ok=export_ok,
                      shards=len([n for n in os.listdir(os.path.join(out_dir, "hf")) if n.endswith(".safetensors")]),
                      released_gen=gen1, current_gen=lead.generation(s3.params), steps=int(s3.step))
    ckpt.close()
    with open(os.path.join(out_dir, f"result-{group.process_id}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
