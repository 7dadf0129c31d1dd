#!/usr/bin/env bash
# The GPU check for a lent one-GPU machine with no network (this project's H200 device): what of
# the SGLang issue's GPU acceptance runs without main SGLang, plus the built-in engine and learner.
# Main SGLang itself is not there and cannot be carried (it pins torch 2.9.1, its kernels are built
# for that torch, and sglang-kernel + flashinfer are far over a call's 64 MiB); benchmarks/gpu_sglang.sh
# is the check for a machine that has it. sglang-jax is pure Python and runs on the GPU through JAX.
#
#   OUT=/tmp/gpu-check DEADLINE_S=500 bash benchmarks/gpu_check.sh   # logs and JSON lines under $OUT
#
# Uses the machine's python3 (JAX with CUDA, a CUDA torch, transformers). Offline wheels, if present:
# .whl/ (what Cadence imports and the machine lacks: msgspec, math-verify) go to /tmp/site for every
# part; .whl-sgljax/ (sglang-jax 0.1.0rc0 --no-deps and the server's missing deps: fastapi, uvicorn,
# pydantic, pyzmq, ...) go to /tmp/sgl-site, on the server's path only.
# Each part has its own time limit and goes on after a failure; $OUT gets parts.log (every part's
# output) and summary.jsonl (their JSON lines).
#   1. weight sync by nccl broadcast (sync=distributed), a Llama-3.2-1B-shaped model in bf16, Cadence's
#      engine -> a GPU stand-in receiver vs a bare torch.distributed broadcast; KL of the receiver's
#      logits against the learner's JAX model after the sync
#   2. sglang-jax on the GPU (if .whl-sgljax/ is there): generation tokens/s through Cadence's engine vs
#      a bare asyncio client at the same concurrency, a restart weight sync, and the logprob mismatch
#      against Cadence's JAX model (benchmarks/sglang_bench.py, a 170M Llama)
#   3. (1) at float32 on a small model: the transfer is exact (KL ~ 0 up to the two frameworks'
#      float32 matmuls)
#   4. gloo on the same GPU tensors, only if (1) failed
#   5. engine_bench, learner_bench (JAX on the GPU vs bare jitted loops)
#   6. time to held-out exact match 0.5 of the default `cadence train` (one seed)
#   7. the sharded learner at real sizes (benchmarks/learner_scale_bench.py): GRPO updates of 0.5B-
#      and 1.5B-parameter Llama-shaped models, random init, bf16 params and matmuls, float32 Adam
#      moments, remat; tokens/s, MFU and peak memory vs a bare jitted step (written without a GPU:
#      not yet run on one)
#   8. (7) as RL sees it: a long-tail completion-length mix, packed rows (learner.microbatch_tokens) and
#      chunked log-probs (learner.logits_chunk), at 0.5B and 1.5B
#   9. the whole RL loop at 0.5B and 1.5B (benchmarks/rl_loop_bench.py: `cadence train`, engine and
#      learner sharing the GPU, packing and chunked log-probs): seconds per update split into
#      generation and learner, the learner's tokens/s and MFU beside (8)'s learner alone, peak memory
#  10. only on a host with 8 GPUs (skipped with a message otherwise; issue 30): the sharded learner at
#      1.5B with fsdp 8 and with data 2 x fsdp 4 (tokens/s, MFU, per-device peak memory and param
#      bytes); a 14B model (Qwen2.5-14B's shape, ~180 GB of bf16 params, float32 Adam moments and
#      gradients: more than one H100 or H200 holds) written as a random HF checkpoint, loaded straight
#      into the fsdp-8 mesh and trained a few updates; the built-in engine decoding tensor-parallel
#      (engine.tensor_parallel): an 8B model at tp 1 vs tp 8 (same greedy tokens, tokens/s, per-device
#      bytes), and a 70B model that only tp 8 holds (benchmarks/engine_tp_bench.py). Written without
#      a multi-GPU machine: not yet run on one. PARTS=gpu8 runs only these.
# PARTS="wsync_nccl_1b_bf16 learner_scale" runs only the named parts (default: all): the parts that
# have not run on a GPU yet are `PARTS="wsync_nccl_1b_bf16 learner_scale_0.5b learner_scale_1.5b"`.
# SGL_DEVICE=cpu runs part 4's server on the CPU (a dry run of this script's flow on a CPU machine).
# GPU8_DEVICE=cpu runs part 10 on 8 forced CPU devices at tiny sizes (a dry run of its commands).
# Parts stop being started once DEADLINE_S seconds (default 540) have passed, and each is cut at it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/cadence-gpu-check}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

END=$(( $(date +%s) + ${DEADLINE_S:-540} ))
PARTS="${PARTS:-all}"
part() {  # part NAME SECONDS CMD...: runs CMD with a limit, appends its output to $OUT/parts.log
  local name=$1 limit=$2 rc log left
  shift 2
  if [ "$PARTS" != all ] && [[ " $PARTS " != *" $name "* ]] && [[ " $PARTS " != *" ${name%_*} "* ]]; then
    return 0  # not asked for
  fi
  left=$(( END - $(date +%s) ))
  if [ $left -lt 30 ]; then
    echo "== $name skipped: the deadline is near"
    echo "{\"part\": \"$name\", \"skipped\": \"deadline\"}" >>"$OUT/summary.jsonl"
    return 124
  fi
  [ "$limit" -le $left ] || limit=$left
  log=$(mktemp)
  echo "== $name ($(date +%T))"
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  { echo "== $name rc=$rc"; cat "$log"; } >>"$OUT/parts.log"
  echo "rc=$rc"
  if [ $rc -eq 0 ]; then
    grep '^{' "$log" | tail -n 3 | tee -a "$OUT/summary.jsonl"
  else
    tail -n 40 "$log"
    echo "{\"part\": \"$name\", \"rc\": $rc}" >>"$OUT/summary.jsonl"
  fi
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import jax, torch, flax, transformers; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__,
  'nccl', torch.cuda.nccl.version(), '| flax', flax.__version__, '| transformers', transformers.__version__)"

WS=benchmarks/weight_sync_bench.py
part wsync_nccl_1b_bf16 180 "$PY" $WS --backend nccl --preset llama-1b --dist-dtype bfloat16 --receiver-dtype bfloat16 \
  --bucket-mb 512 --repeats 3 --kl
nccl_rc=$?
if { [ "$PARTS" = all ] || [[ " $PARTS " == *" sglang_jax_gpu "* ]]; } && compgen -G ".whl-sgljax/*.whl" >/dev/null \
  && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sgl-site \
       .whl-sgljax/*.whl; then
  # The server's JAX takes a fifth of the GPU (the default 75% would starve this process and torch).
  # XLA compiles each padded shape in ~25 s on the H200 (measured 2026-12-04: 5 extend shapes took
  # 128 s and the start did not finish in the lease), so one extend and one decode shape only.
  CADENCE_SGLANG_PYTHON="$(command -v "$PY")" part sglang_jax_gpu 270 "$PY" benchmarks/sglang_bench.py --model small \
    --prompts 256 --max-new-tokens 64 --concurrency 64 --rounds 2 \
    --launch-args "--device ${SGL_DEVICE:-cuda} --attention-backend native --dtype float32 --grammar-backend none \
--max-total-tokens 8192 --max-running-requests 64 --precompile-token-paddings 1024 \
--precompile-bs-paddings 64 --skip-tokenizer-init --disable-overlap-schedule --skip-server-warmup" \
    --launch-env "JAX_PLATFORMS=${SGL_DEVICE:-cuda}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 "PYTHONPATH=/tmp/sgl-site:${PYTHONPATH:-}"
  pkill -f sgl_jax.launch_server  # a server in its own session outlives a bench cut by its time limit
fi
part wsync_nccl_small_fp32 120 "$PY" $WS --backend nccl --d-model 512 --layers 8 --vocab 8192 --repeats 3 --kl
if [ $nccl_rc -ne 0 ]; then
  part wsync_gloo_cuda_1b_bf16 150 "$PY" $WS --backend gloo --device cuda --preset llama-1b --dist-dtype bfloat16 \
    --receiver-dtype bfloat16 --bucket-mb 512 --repeats 3 --kl
fi
part engine_bench 120 "$PY" benchmarks/engine_bench.py --repeats 9
part learner_bench 120 "$PY" benchmarks/learner_bench.py --repeats 9
part time_to_target 200 "$PY" benchmarks/time_to_target.py --seeds 0 --setups default
# 0.5B: 32 x 1024 tokens per update in microbatches of 8, remat keeping matmul outputs; 1.5B: the
# same tokens in microbatches of 4, remat keeping only block inputs. Peak memory is JAX's own count.
part learner_scale_0.5b 150 "$PY" benchmarks/learner_scale_bench.py --preset 0.5b --seq-len 1024 --batch 32 \
  --microbatch 8 --remat block --repeats 5
part learner_scale_1.5b 210 "$PY" benchmarks/learner_scale_bench.py --preset 1.5b --seq-len 1024 --batch 32 \
  --microbatch 4 --remat full --repeats 5
# The same shapes as RL sees them (issue 28): completions of a long-tail length mix packed into
# token-budget microbatches (learner.microbatch_tokens) with chunked log-probs (logits_chunk 128);
# tokens/s and MFU count real tokens, and row_fill says how full the packed rows are.
part rl_packed_0.5b 150 "$PY" benchmarks/learner_scale_bench.py --preset 0.5b --seq-len 1024 --batch 64 \
  --lengths mix --microbatch-tokens 8192 --logits-chunk 128 --remat block --repeats 5
part rl_packed_1.5b 210 "$PY" benchmarks/learner_scale_bench.py --preset 1.5b --seq-len 1024 --batch 64 \
  --lengths mix --microbatch-tokens 4096 --logits-chunk 128 --remat full --repeats 5
# The whole loop (issue 28): 64 completions of up to 512 tokens per update, random init.
part rl_loop_0.5b 180 "$PY" benchmarks/rl_loop_bench.py --preset 0.5b --steps 8 --batch 64 --max-new-tokens 512 \
  --microbatch-tokens 8192 --logits-chunk 128 --remat block
part rl_loop_1.5b 240 "$PY" benchmarks/rl_loop_bench.py --preset 1.5b --steps 6 --batch 64 --max-new-tokens 512 \
  --microbatch-tokens 4096 --logits-chunk 128 --remat full
# Part 10: one host, 8 GPUs. Rows split over data x fsdp = 8 devices, so microbatches are multiples of 8.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${GPU8_DEVICE:-cuda}" = cpu ]; then  # the same commands at tiny sizes on 8 CPU devices
  G8ENV="JAX_PLATFORMS=cpu"; L8="--preset tiny --devices 8 --seq-len 64 --batch 16 --microbatch 8 --repeats 1"
  B8="$L8"; E8="--preset tiny --devices 8 --batch 8 --prompt-len 16 --new-tokens 16 --repeats 1"; E70="$E8"
elif [ "$NGPU" -ge 8 ]; then
  G8ENV=""; L8="--preset 1.5b --seq-len 1024 --batch 64 --microbatch 8 --remat block --repeats 5"
  B8="--preset 14b --seq-len 1024 --batch 16 --microbatch 8 --remat full --repeats 2"
  E8="--preset 8b --dtype bfloat16 --batch 64 --prompt-len 128 --new-tokens 128 --repeats 3"
  E70="--preset 70b --dtype bfloat16 --batch 32 --prompt-len 128 --new-tokens 64 --repeats 2"
fi
if [ -n "${L8:-}" ]; then
  part gpu8_fsdp8 240 env $G8ENV "$PY" benchmarks/learner_scale_bench.py $L8 --fsdp 8
  part gpu8_data2-fsdp4 240 env $G8ENV "$PY" benchmarks/learner_scale_bench.py $L8 --data 2 --fsdp 4
  CKPT8="${CKPT8:-/tmp/cadence-ckpt-gpu8}"  # ~30 GB at 14B; removed afterwards
  rm -rf "$CKPT8"
  part gpu8_load-train-14b 600 env $G8ENV "$PY" benchmarks/learner_scale_bench.py $B8 --fsdp 8 --no-bare --ckpt "$CKPT8"
  rm -rf "$CKPT8"
  part gpu8_engine-tp8 300 env $G8ENV "$PY" benchmarks/engine_tp_bench.py $E8 --tp 1,8
  part gpu8_engine-tp8-70b 420 env $G8ENV "$PY" benchmarks/engine_tp_bench.py $E70 --tp 8
elif [ "$PARTS" = all ] || [[ " $PARTS " == *" gpu8 "* ]]; then
  echo "== gpu8 skipped: $NGPU GPUs here, part 10 needs 8 (GPU8_DEVICE=cpu: a dry run on CPU devices)"
  echo "{\"part\": \"gpu8\", \"skipped\": \"$NGPU GPUs\"}" >>"$OUT/summary.jsonl"
fi
echo "== done ($(date +%T))"
