#!/usr/bin/env bash
# GPU machine only, from the repo root: the cluster built on Debian 12 (carried with its run-time libraries, see
# shared stack notes and scripts/bundle.sh) serving the built-in tiny model with --device cuda, checked by the
# integration suite's streaming correctness tests (openai SDK as the client) in both topologies: `serve` (every
# role in one process) and `multi_ucx` (router, prefill and decode processes, request states over UCX).
#   tests/gpu/cluster_on_gpu.sh OUTDIR
# Expects (carried, git-ignored): .devcarry/bin/deltaserve, .devcarry/lib/*.so*, .whl/*.whl (openai and its deps).
set -uo pipefail
out=${1:-/tmp/cluster-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$out/pip.log" 2>&1 || tail -5 "$out/pip.log"
export PYTHONPATH=/tmp/site
export LD_LIBRARY_PATH=$PWD/.devcarry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export DELTASERVE_BINARY=$PWD/.devcarry/bin/deltaserve
export DELTASERVE_HOME=$(mktemp -d)
# Every role process and `deltaserve generate` (the reference) run the model on the GPU; several processes share
# it, so each takes a tenth of its memory.
export DELTASERVE_DEVICE=cuda
export DELTASERVE_GPU_MEMORY_FRACTION=0.1
"$DELTASERVE_BINARY" generate --prompt "The GPU says" --max-tokens 8 2>&1 | tail -2
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/integration/test_openai_api.py \
  -k "stream or greedy" -rA >"$out/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|PASSED|FAILED|ERROR" "$out/pytest.log" | tail -40
