#!/usr/bin/env bash
# GPU machine only, from the repo root, after build/gpu has engine_gpu_bench: the 48B decode step (CUDA graphs,
# context 4k unless CONTEXTS says otherwise) under several environment settings, one process each, in one run, so
# that a knob's effect is read against the same binary and the same GPU state. The first setting should be the
# default ("-"); repeat it at the end to see the run-to-run spread.
#   bench/gpu/decode_env_ab.sh OUTDIR "-" "DELTASERVE_MLA_MIN_SPLIT_ROWS=64" "DELTASERVE_MOE_PARALLEL_ROUTE=0 X=1" "-"
# Environment: BATCHES (default 1,2,4), CONTEXTS (default 4096), CONFIG (default the Kimi-Linear-48B shape).
set -uo pipefail
out=${1:?usage: decode_env_ab.sh OUTDIR SETTING...}
shift
mkdir -p "$out"
bin=build/gpu/engine/cuda/engine_gpu_bench
config=${CONFIG:-tests/data/configs/kimi-linear-48b-a3b.config.json}
i=0
for setting in "$@"; do
  i=$((i + 1))
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  env "${assignments[@]}" timeout 150 "$bin" --config "$config" --label ab --batches "${BATCHES:-1,2,4}" \
    --contexts "${CONTEXTS:-4096}" --prompts "" --no-ceilings --commit X --date D \
    >"$out/ab$i.jsonl" 2>"$out/ab$i.err"
  rc=$?
  python3 - "$out/ab$i.jsonl" "$setting" "$rc" <<'PY'
import json, sys
path, setting, rc = sys.argv[1:]
steps = []
for line in open(path):
    r = json.loads(line)
    if r["metric"] == "step_time" and r["case"].endswith(",graph"):
        batch = r["case"].split(",")[1]
        context = r["case"].split(",")[2]
        steps.append(f"{batch} {context} {r['value']:.3f} ms")
print(f"[{setting}] rc={rc}: " + "; ".join(steps))
PY
done
