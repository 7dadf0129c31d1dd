"""sync="distributed": the learner broadcasts its weights through torch.distributed (gloo on CPU).

The receiving servers here are STAND-INS (dist_receiver.py): main SGLang cannot run on these
machines and sglang-jax has no update endpoints. They follow SGLang's receive side (join at
rank_offset through the learner's rendezvous store, allocate the announced names/dtypes/shapes,
receive each by broadcast from rank 0, load by name) into a real transformers Llama, so the
transport, the tensor names and the layout are checked for real; the same sends into main SGLang
are left to benchmarks/gpu_sglang.sh on a GPU. The server killed below is a real process kill.
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.engine import SGLangEngine, SGLangError
from cadence.actors.sglang.server import free_port
from cadence.actors.sglang.weight_broadcast import (UpdateGroup, bucket_tensors, init_request, plan_buckets,
                                            update_request)
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_export import HFTensor, export_checkpoint, hf_tensors
from cadence.learner.models.hf_random import write_random_checkpoint
from cadence.learner.models.llama import forward, init_params

CK = ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64)
TOKENS = [[1, 5, 9, 3, 7, 2, 11, 40]]
# fp32 on both sides, different kernels: measured max |difference| 2.3e-7 on logits of size ~0.4.
LOGITS_ATOL = 1e-5


def test_requests_carry_sglangs_fields():
    assert init_request("127.0.0.1", 4000, 3, 5, "g", "nccl") == {
        "master_address": "127.0.0.1", "master_port": 4000, "rank_offset": 3, "world_size": 5,
        "group_name": "g", "backend": "nccl"}
    pairs = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b.bias", torch.zeros(4))]
    assert update_request(pairs, "g") == {"names": ["a.weight", "b.bias"], "dtypes": ["bfloat16", "float32"],
                                          "shapes": [[2, 3], [4]], "group_name": "g", "flush_cache": False}
    last = update_request(pairs, "g", version=7, flush_cache=True)
    assert last["weight_version"] == "7" and last["flush_cache"] is True


def test_buckets_keep_order_and_size_and_count_the_sent_dtype():
    ts = [HFTensor(f"t{i}", jnp.zeros((n,), jnp.float32), False) for i, n in enumerate([10, 10, 30, 5, 5])]
    assert [[t.name for t in b] for b in plan_buckets(ts, 80)] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    # Sent as bfloat16 the same tensors take half the bytes.
    assert [[t.name for t in b] for b in plan_buckets(ts, 80, "bfloat16")] == [["t0", "t1"], ["t2", "t3", "t4"]]
    assert sum(len(b) for b in plan_buckets(ts, 1)) == 5  # each too big alone: one bucket each


def test_bucket_tensors_are_the_exported_checkpoint_tensors(tmp_path):
    _, params = init_params(CK, 3)
    export_checkpoint(CK, params, str(tmp_path))
    on_disk = {}
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            on_disk.update(load_file(str(tmp_path / f)))
    pairs = bucket_tensors(hf_tensors(CK, params), None, "gloo")
    assert sorted(n for n, _ in pairs) == sorted(on_disk)
    for name, t in pairs:
        np.testing.assert_array_equal(t.numpy(), on_disk[name], err_msg=name)
    for name, t in bucket_tensors(hf_tensors(CK, params), "bfloat16", "gloo"):
        assert t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.float().numpy(), on_disk[name].astype(jnp.bfloat16).astype(np.float32))


def _listening(port: int) -> list[str]:
    """Local addresses listening on port (from /proc/net/tcp{,6}, hex)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    found.append(addr)
    return found


def test_rendezvous_store_listens_only_on_the_configured_address():
    group = UpdateGroup("gloo", "127.0.0.1", 0, 2, "g", 5)
    try:
        assert _listening(group.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 / ::
    finally:
        group.close()
    assert _listening(group.port) == []


def test_config_names_the_distributed_fields():
    for kw, field in [({"sync": "distributed", "urls": ("http://h:1",), "dist_address": "10.0.0.2"}, "dist_address"),
                      ({"dist_dtype": "int8"}, "dist_dtype"), ({"dist_bucket_mb": 0}, "dist_bucket_mb"),
                      ({"dist_backend": "mpi"}, "dist_backend"), ({"dist_timeout_s": 0}, "dist_timeout_s")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SGLangConfig(**kw).validate()
    SGLangConfig(sync="distributed", urls=("http://h:1",), dist_address="10.0.0.2", dist_trusted_network=True).validate()
    with pytest.raises(ValueError, match="tensors_fn"):
        SGLangEngine(SGLangConfig(sync="distributed", urls=("http://h:1",)), max_new_tokens=1, eos_id=2, pad_id=0,
                     export_fn=lambda p, d: None, work_dir="/tmp/unused")


# -- the engine against stand-in receivers -------------------------------------------------------

def _get(port, path):
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60).read())


def _logits(port):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/stand_in/logits", data=json.dumps({"input_ids": TOKENS}).encode(),
                                 headers={"Content-Type": "application/json"})
    return np.array(json.loads(urllib.request.urlopen(req, timeout=60).read())["logits"])


def _jax_logits(graphdef, params):
    toks = jnp.array(TOKENS)
    n = toks.shape[1]
    return np.asarray(forward(graphdef, params, toks, jnp.arange(n)[None], jnp.ones((1, n), bool)))


def _start_receivers(model_dir, tps):
    """Stand-in servers, one per entry of tps (its --tp); returns their ports and processes."""
    ports = [free_port() for _ in tps]
    procs = [subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "dist_receiver.py"),
                               "--model-dir", model_dir, "--port", str(p), "--tp", str(tp)],
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}) for p, tp in zip(ports, tps)]
    deadline = time.monotonic() + 120
    for p in ports:
        while True:
            try:
                _get(p, "/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "stand-in receiver did not start"
                time.sleep(0.2)
    return ports, procs


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets, in this process and the receivers
    write_random_checkpoint(str(tmp_path / "start"), CK, seed=1)
    started = []

    def start(tps):
        started.append(_start_receivers(str(tmp_path / "start"), tps))
        return started[-1]

    yield start
    for _, procs in started:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def receivers(stand_ins):
    return stand_ins((1, 1))


def _engine(ports, tmp_path, **kw):
    sg = SGLangConfig(urls=tuple(f"http://127.0.0.1:{p}" for p in ports), sync="distributed", dist_backend="gloo",
                      dist_timeout_s=30.0, heartbeat_s=0.5, request_timeout_s=10.0, backoff_s=0.05,
                      dist_bucket_mb=0.02, **kw)
    return SGLangEngine(sg, max_new_tokens=4, eos_id=2, pad_id=0, work_dir=str(tmp_path / "engine"),
                        export_fn=lambda p, d: pytest.fail("attached servers need no export"),
                        tensors_fn=lambda p: hf_tensors(CK, p))


def test_broadcast_reaches_every_server_reuses_the_group_and_regroups_after_a_kill(receivers, tmp_path):
    ports, procs = receivers
    graphdef, _ = init_params(CK, 0)
    versions = {v: init_params(CK, 10 + v)[1] for v in (1, 2, 3)}
    n_buckets = len(plan_buckets(hf_tensors(CK, versions[1]), int(0.02 * (1 << 20))))
    assert n_buckets >= 3  # several requests per update
    eng = _engine(ports, tmp_path)
    try:
        assert eng.sync_weights(versions[1], 1)
        for p in ports:
            np.testing.assert_allclose(_logits(p), _jax_logits(graphdef, versions[1]), atol=LOGITS_ATOL)
            info = _get(p, "/get_server_info")
            assert info["weight_version"] == "1" and info["updates"] == n_buckets
        group = eng.weight_sync.group
        assert eng.served_version == 1 and all(s.ready for s in eng.servers)
        assert eng.stats.sync_bytes == sum(t.value.nbytes for t in hf_tensors(CK, versions[1]))

        assert not eng.sync_weights(versions[1], 1)  # already served
        assert eng.sync_weights(versions[2], 2)
        assert eng.weight_sync.group is group  # same members: the group is kept
        for p in ports:
            np.testing.assert_allclose(_logits(p), _jax_logits(graphdef, versions[2]), atol=LOGITS_ATOL)
            assert _get(p, "/get_server_info")["weight_version"] == "2"

        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        assert eng.sync_weights(versions[3], 3)
        assert eng.weight_sync.group is not group and eng.weight_sync.members == (0,)  # regrouped without the dead one
        np.testing.assert_allclose(_logits(ports[0]), _jax_logits(graphdef, versions[3]), atol=LOGITS_ATOL)
        assert eng.servers[0].ready and eng.servers[0].version == 3 and not eng.servers[1].ready
    finally:
        eng.close()


def test_a_tensor_parallel_server_gets_a_rank_per_tp_worker(stand_ins, tmp_path):
    """SGLang ranks a server's receivers rank_offset + tp_rank: with servers of tp 2 and 1 the group
    has 4 ranks and the second server starts at 3 (a wrong offset collides or hangs the rendezvous)."""
    ports, _ = stand_ins((2, 1))
    graphdef, params = init_params(CK, 40)
    eng = _engine(ports, tmp_path)
    try:
        assert eng.sync_weights(params, 1)
        assert eng.weight_sync.group.world_size == 4
        want = {t.name: float(np.asarray(t.value, np.float64).sum()) for t in hf_tensors(CK, params)}
        ranks = _get(ports[0], "/stand_in/tp_checksums")["ranks"]
        assert len(ranks) == 2
        for sums in ranks:  # each tp rank received every tensor
            assert sums.keys() == want.keys()
            for name in want:
                assert sums[name] == pytest.approx(want[name], rel=1e-9, abs=1e-9), name
        for p in ports:
            np.testing.assert_allclose(_logits(p), _jax_logits(graphdef, params), atol=LOGITS_ATOL)
        assert all(s.ready and s.version == 1 for s in eng.servers)
    finally:
        eng.close()


def test_a_failed_update_keeps_the_partly_updated_servers_out_until_one_succeeds(receivers, tmp_path):
    ports, _ = receivers
    graphdef, params = init_params(CK, 20)
    bogus = HFTensor("model.not_a_layer.weight", jnp.ones((3,)), False)
    sending_bogus = [True]
    sg = SGLangConfig(urls=(f"http://127.0.0.1:{ports[0]}",), sync="distributed", dist_backend="gloo",
                      dist_timeout_s=30.0, request_timeout_s=10.0, retries=1, backoff_s=0.05)
    eng = SGLangEngine(sg, max_new_tokens=4, eos_id=2, pad_id=0, work_dir=str(tmp_path / "engine"),
                       export_fn=lambda p, d: None,
                       tensors_fn=lambda p: hf_tensors(CK, p) + ([bogus] if sending_bogus[0] else []))
    try:
        with pytest.raises(SGLangError, match="failed 2 times.*not_a_layer"):
            eng.sync_weights(params, 1)
        server = eng.servers[0]
        assert not server.ready and server.awaiting_weights and eng.stats.sync_failures == 2
        assert eng.needs_sync(1, 1)  # it must get whole weights before it serves again
        sending_bogus[0] = False
        assert eng.sync_weights(params, 1)
        assert server.ready and not server.awaiting_weights and server.version == 1
        np.testing.assert_allclose(_logits(ports[0]), _jax_logits(graphdef, params), atol=LOGITS_ATOL)
    finally:
        eng.close()


def test_jax_arrays_reach_torch_without_a_copy():
    x = jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(3, 4))
    (_, t), = bucket_tensors([HFTensor("x", x, False)], None, "gloo")
    assert t.data_ptr() == x.unsafe_buffer_pointer()  # DLPack shares the buffer
    (_, tt), = bucket_tensors([HFTensor("x", x, True)], None, "gloo")
    np.testing.assert_array_equal(tt.numpy(), np.asarray(x).T)


def test_a_launched_server_restarted_after_a_kill_waits_out_of_rotation_for_the_newest_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sg = SGLangConfig(launch_python=sys.executable, launch_module="tests.actors.dist_receiver", launch_args=(),
                      launch_env=(f"PYTHONPATH={root}", "JAX_PLATFORMS=cpu"), compile_cache=False,
                      sync="distributed", dist_backend="gloo", dist_timeout_s=30.0, heartbeat_s=0.3,
                      request_timeout_s=10.0, backoff_s=0.05, startup_timeout_s=120.0)
    graphdef, v0 = init_params(CK, 30)
    _, v1 = init_params(CK, 31)
    eng = SGLangEngine(sg, max_new_tokens=4, eos_id=2, pad_id=0, work_dir=str(tmp_path / "engine"),
                       export_fn=lambda p, d: export_checkpoint(CK, p, d), tensors_fn=lambda p: hf_tensors(CK, p))
    server = eng.servers[0]
    port = server.process.port
    try:
        assert eng.sync_weights(v0, 0)  # launched on the exported v0 (loaded from disk)
        np.testing.assert_allclose(_logits(port), _jax_logits(graphdef, v0), atol=LOGITS_ATOL)
        assert eng.sync_weights(v1, 1) and eng.stats.sync_bytes > 0  # v1 arrives by broadcast
        np.testing.assert_allclose(_logits(port), _jax_logits(graphdef, v1), atol=LOGITS_ATOL)

        server.process.kill()
        deadline = time.monotonic() + 120
        while not (server.awaiting_weights and server.recovering is None):
            assert time.monotonic() < deadline, "the killed server was not restarted"
            time.sleep(0.1)
        assert eng.stats.restarts == 1 and server.process.alive() and not server.ready
        np.testing.assert_allclose(_logits(port), _jax_logits(graphdef, v0), atol=LOGITS_ATOL)  # the launch checkpoint
        assert eng.needs_sync(1, 0)  # even though v1 is within any staleness bound
        assert eng.sync_weights(v1, 1)
        assert server.ready and server.version == 1 and not server.awaiting_weights
        np.testing.assert_allclose(_logits(port), _jax_logits(graphdef, v1), atol=LOGITS_ATOL)
    finally:
        eng.close()


@pytest.mark.slow
def test_cli_train_with_distributed_sync_carries_the_learning_to_the_server(tmp_path):
    """`cadence train` with a launched stand-in server and sync=distributed: the reward of what the
    server samples rises only if each broadcast really changed its weights."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = tmp_path / "run"
    steps = 40  # the default sort task: with the built-in engine, reward 0.20 -> 0.38 over these steps
    args = [f"run.dir={run}", f"run.steps={steps}", "run.eval_every=0", "run.progress=false",
            "actors.max_staleness=1", "actors.engine=sglang", f"actors.sglang.launch_python={sys.executable}",
            "actors.sglang.launch_module=tests.actors.dist_receiver", "actors.sglang.launch_args=[]",
            f"actors.sglang.launch_env=[PYTHONPATH={root},JAX_PLATFORMS=cpu]", "actors.sglang.compile_cache=false",
            "actors.sglang.sync=distributed", "actors.sglang.dist_backend=gloo"]
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", *args], capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, PYTHONPATH=root, GLOO_SOCKET_IFNAME="lo"))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    from cadence.launch.metrics import read_metrics
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(steps + 1)) and summary["ledger"]["in_flight"] == 0
    assert max(r["staleness/max"] for r in rows[1:]) <= 1
    last = rows[-1]
    assert last["sglang/restarts"] == 0 and last["sglang/misaligned"] == 0
    # One launch on the exported v0, then broadcasts: about one per step at max_staleness=1.
    assert last["sglang/syncs"] >= steps // 2 and last["sglang/sync_bytes"] > 0
    first = np.mean([r["reward/mean"] for r in rows[1:4]])
    final = np.mean([r["reward/mean"] for r in rows[-10:]])
    assert final > first + 0.08, (first, final)
