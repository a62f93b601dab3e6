#!/usr/bin/env bash
# GPU machine only, from the repo root: the cluster built on Debian 12 (carried with its run-time libraries) serving
# the built-in tiny model with --device cuda, checked by the integration suite's streaming correctness and greedy
# tests (openai SDK as the client) in the topologies `serve` (every role in one process), `multi` and `multi_ucx`
# (router, prefill and decode processes, request states over CAF or UCX), and its prefix-cache tests (cached
# continuations equal cold ones, tenants isolated).
#   tests/gpu/cluster_on_gpu.sh OUTDIR
# Expects (carried, git-ignored): .devcarry/bin/deltaserve, .devcarry/lib/*.so*, .whl/*.whl (openai and its deps).
set -uo pipefail
out=${1:-/tmp/cluster-gpu}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  >"$out/pip.log" 2>&1 || tail -5 "$out/pip.log"
export PYTHONPATH=$site
export LD_LIBRARY_PATH=$PWD/.devcarry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DELTASERVE_BINARY=$PWD/.devcarry/bin/deltaserve
export DELTASERVE_HOME=$(mktemp -d)
# Every role process and `deltaserve generate` (the reference) run the model on the GPU; several processes share
# it, so each takes a tenth of its memory.
export DELTASERVE_DEVICE=cuda
export DELTASERVE_GPU_MEMORY_FRACTION=0.1
# Evidence that the model runs on the GPU: the weights' upload progress and the speed line.
"$DELTASERVE_BINARY" generate --prompt "The GPU says" --max-tokens 8 2>&1 >/dev/null | tail -3
timeout 480 python3 -m pytest -q -p no:cacheprovider tests/integration/test_openai_api.py \
  tests/integration/test_prefix_cache.py -k "stream or greedy or prefix or cached or tenant" -rA \
  >"$out/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|PASSED|FAILED|ERROR" "$out/pytest.log" | tail -40
