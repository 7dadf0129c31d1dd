#!/usr/bin/env bash
# Prepared GPU check for the SGLang engine (main SGLang on CUDA). Installs nothing from the network.
# NOT RUN YET: the GPU machine lent so far has no network and main SGLang cannot be carried to it
# (benchmarks/gpu_check.sh is what ran there); expect to fix small things on the first run. Needs:
#   SGLANG_PYTHON  python of a venv with main `sglang` installed (CUDA build)
#   MODEL          a small local HF checkpoint directory (e.g. Qwen2.5-0.5B), readable by the server
#   PY             python with Cadence's dependencies, jax[cuda12] and a CUDA torch (default .venv/bin/python;
#                  without a CUDA torch the distributed sync is reported as skipped)
# Measures (one JSON line):
#   1. tokens/s through Cadence's engine vs SGLang's own bench_serving client, same concurrency
#   2. weight sync from disk (/update_weights_from_disk) seconds, and per GB of weights
#   3. logprob mismatch KL between the server and Cadence's JAX model on the same tokens
#   4. weight sync by NCCL broadcast (sync=distributed, bf16) seconds and per GB, and the KL again
#      after it (the broadcast must not change what the server computes)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${SGLANG_PYTHON:?set SGLANG_PYTHON}" "${MODEL:?set MODEL}"
CONC="${CONC:-64}"; PORT="${PORT:-30123}"
PY="${PY:-.venv/bin/python}"
# One GPU for three users: the server's static pool, the JAX learner (no preallocation), NCCL buffers.
"$SGLANG_PYTHON" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 --mem-fraction-static 0.5 > /tmp/gpu_sglang_server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health_generate" >/dev/null && break; sleep 1; done
# 1. SGLang's own client (random prompts, 128 in / 128 out).
"$SGLANG_PYTHON" -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port "$PORT" \
  --dataset-name random --random-input-len 128 --random-output-len 128 --random-range-ratio 1.0 \
  --num-prompts 512 --max-concurrency "$CONC" --output-file /tmp/gpu_sglang_bench.jsonl >/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" - "$PORT" "$MODEL" "$CONC" <<'PYEOF'
import json, os, sys, time
import jax.numpy as jnp, numpy as np
from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.engine import SGLangEngine
from cadence.learner.algorithms.logprobs import token_logprobs_and_entropy
from cadence.learner.models.hf_export import hf_tensors
from cadence.learner.models.hf_load import load_checkpoint
from cadence.learner.models.llama import forward
port, model, conc = sys.argv[1], sys.argv[2], int(sys.argv[3])
bench = json.loads(open("/tmp/gpu_sglang_bench.jsonl").read().strip().splitlines()[-1])
model_cfg, graphdef, params = load_checkpoint(model)
cfg = SGLangConfig(urls=(f"http://127.0.0.1:{port}",), sync="disk", concurrency=conc)
# Export = the checkpoint itself: the sync measures the server's load time.
eng = SGLangEngine(cfg, max_new_tokens=128, eos_id=-1, pad_id=0, work_dir="/tmp/gpu_sglang",
                   export_fn=lambda p, d: os.path.exists(d) or os.symlink(os.path.abspath(model), d))
gb = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors")) / 1e9
t0 = time.perf_counter(); eng.sync_weights(params, 0); t_disk = time.perf_counter() - t0
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 1000, size=128).tolist() for _ in range(512)]
eng.generate(None, prompts[:conc], None)
t0 = time.perf_counter(); res = eng.generate(None, prompts, None); tps = res.num_tokens / (time.perf_counter() - t0)
def mismatch_kl(engine, rows=16):
    res = engine.generate(None, prompts[:rows], None)
    kls = []
    for r in range(rows):
        n = int(res.lengths[r]); toks = jnp.array([prompts[r] + res.tokens[r, :n].tolist()]); L = toks.shape[1]
        logits = forward(graphdef, params, toks, jnp.arange(L)[None], jnp.ones((1, L), bool))
        lp, _ = token_logprobs_and_entropy(logits, toks)
        kls.append(float(np.mean(res.logprobs[r, :n] - np.asarray(lp[0, len(prompts[r]):]))))  # k1 estimate of KL(server||learner)
    return float(np.mean(kls))
kl = mismatch_kl(eng)
eng.close()
out = {"bench": "gpu_sglang", "concurrency": conc, "cadence_tokens_per_s": round(tps, 1),
       "sglang_bench_output_tokens_per_s": bench.get("output_throughput"),
       "ratio": round(tps / bench["output_throughput"], 3) if bench.get("output_throughput") else None,
       "disk_sync_s": round(t_disk, 2), "disk_sync_s_per_gb": round(t_disk / gb, 2), "weights_gb": round(gb, 2),
       "mismatch_kl_k1": kl}
import torch
if not torch.cuda.is_available():
    out["distributed_sync"] = "skipped: the torch in this python has no CUDA"
else:
    dcfg = SGLangConfig(urls=(f"http://127.0.0.1:{port}",), sync="distributed", dist_backend="nccl",
                        dist_dtype="bfloat16", concurrency=conc)
    deng = SGLangEngine(dcfg, max_new_tokens=128, eos_id=-1, pad_id=0, work_dir="/tmp/gpu_sglang_dist",
                        export_fn=lambda p, d: None, tensors_fn=lambda p: hf_tensors(model_cfg, p))
    t0 = time.perf_counter(); deng.sync_weights(params, 1); first = time.perf_counter() - t0  # + group setup
    times = []
    for v in range(2, 6):
        t0 = time.perf_counter(); deng.sync_weights(params, v); times.append(time.perf_counter() - t0)
    sent_gb = deng.stats.sync_bytes / 5 / 1e9
    out.update(distributed_first_sync_s=round(first, 3), distributed_sync_s=round(float(np.median(times)), 3),
               distributed_sync_s_per_gb=round(float(np.median(times)) / sent_gb, 3), distributed_sent_gb=round(sent_gb, 3),
               mismatch_kl_k1_after_distributed=mismatch_kl(deng))
    deng.close()
print(json.dumps(out))
PYEOF
