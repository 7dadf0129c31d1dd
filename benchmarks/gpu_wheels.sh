#!/usr/bin/env bash
# Downloads (here, where PyPI is reachable) the wheels benchmarks/gpu_check.sh installs offline on a
# GPU machine with no network whose python3 is CPython 3.12 with JAX (CUDA), torch and transformers:
#   .whl/         what Cadence imports and such a machine lacks
#   .whl-sgljax/  sglang-jax 0.1.0rc0 (--no-deps: it pins jax 0.10.2 and transformers 4.57, yet served
#                 with jax 0.11.2, flax 0.12.12 and transformers 5.17) and the server's missing deps
# Both folders are git-ignored; pass them in the device call's carry. About 10 MB together.
set -euo pipefail
cd "$(dirname "$0")/.."
get() {  # get DIR SPEC...
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "$@"
}
get .whl msgspec==0.23.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 pyzmq==27.0.2 \
  tensorboardX==2.6.4
get .whl-sgljax sglang-jax==0.1.0rc0 fastapi==0.116.1 starlette==0.47.3 uvicorn==0.35.0 pydantic==2.11.7 \
  pydantic_core==2.33.2 annotated_types==0.7.0 typing_inspection==0.4.1 pyzmq==27.0.2 orjson==3.11.3 \
  setproctitle==1.3.6 pybase64==1.5.1 partial_json_parser==0.2.1.1.post7 pathwaysutils==0.1.8 llguidance==1.3.0 \
  python-multipart==0.0.34
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >>.git/info/exclude; }
grep -qx '/.whl-sgljax/' .git/info/exclude || echo '/.whl-sgljax/' >>.git/info/exclude
du -sh .whl .whl-sgljax
