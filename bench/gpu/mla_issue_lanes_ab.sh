#!/usr/bin/env bash
# GPU machine only, from the repo root (about 8 minutes): the whole gpu label (gpu_tests.sh), the MLA decode tests with
# the v3 producer's single-lane issue, the 48B step and the attention / combine timeline with the copies issued by
# nine lanes (the default) and by lane 0 (DELTASERVE_MLA_V3_ISSUE_LANES=0), then the decode record (engine.sh,
# PREFILL=0) under whichever of the two was faster at batch 1 (written to OUTDIR/chosen.txt).
#   bench/gpu/mla_issue_lanes_ab.sh OUTDIR COMMIT DATE
set -uo pipefail
out=${1:?usage: mla_issue_lanes_ab.sh OUTDIR COMMIT DATE}
commit=${2:-unknown}
date=${3:-unknown}
mkdir -p "$out"
bash bench/gpu/gpu_tests.sh "$out/gpu_tests"
test=build/gpu/kernels/cuda/kernels_cuda_test
DELTASERVE_MLA_V3_ISSUE_LANES=0 timeout 120 "$test" --gtest_filter='MlaDecode.*:MlaAttentionValidation.*' \
  >"$out/tests_lane0.log" 2>&1
echo "MLA tests, lane 0 issue: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/tests_lane0.log" | tr '\n' ' ')"
BATCHES=1,2,8 CONTEXTS=4096,32768 bash bench/gpu/decode_env_ab.sh "$out/ab" "-" "DELTASERVE_MLA_V3_ISSUE_LANES=0" "-"
bash bench/gpu/mla_v3_trace.sh "$out/v3trace" - DELTASERVE_MLA_V3_ISSUE_LANES=0 | grep -E "^==|^B=|last store|wave"
# Batch-1 step times (ms) of the two settings, summed over both contexts; the repeat of the default counts too.
chosen=$(python3 - "$out/ab" <<'PY'
import json, sys
def b1(path):
    total = 0.0
    for line in open(path):
        r = json.loads(line)
        if r["metric"] == "step_time" and r["case"].endswith(",graph") and ",B=1," in r["case"]:
            total += r["value"]
    return total
lanes = min(b1(f"{sys.argv[1]}/ab1.jsonl"), b1(f"{sys.argv[1]}/ab3.jsonl"))
lane0 = b1(f"{sys.argv[1]}/ab2.jsonl")
print("-" if lanes <= lane0 else "DELTASERVE_MLA_V3_ISSUE_LANES=0")
PY
)
echo "decode record under: $chosen" | tee "$out/chosen.txt"
assignments=()
[[ "$chosen" == "-" ]] || read -r -a assignments <<<"$chosen"
env "${assignments[@]}" PREFILL=0 bash bench/gpu/engine.sh "$out/engine" "$commit" "$date"
