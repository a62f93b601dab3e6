#!/usr/bin/env bash
# (DELTASERVE_MOE_GATE_UP_TRIGGER was removed after this run; its code is at 2325baf.)
# GPU machine only, from the repo root, with another tree staged in .devsrc/old (bench/gpu/stage_branch.sh REV old,
# carry .devsrc): builds both, runs the 48B step at B = 1 / 2 / 4 (4k) of this tree and the old one alternately,
# twice, each under the default and DELTASERVE_MOE_GATE_UP_TRIGGER=issued, then this tree's engine_cuda_test and
# its MoeSmallBatch / MoeDecodeLayer / SkinnyGemm cases (about 4 minutes). Output under /tmp/c3 (tar it into $OUT).
# Fourteenth session, device call 3: whether a B = 4 difference seen on one machine came from the code or the machine.
#   bench/gpu/trigger_tree_ab.sh
set -u
o=/tmp/c3; mkdir -p $o
bash bench/gpu/build_gpu.sh $o/build.log engine_gpu_bench engine_cuda_test kernels_cuda_test
(cd .devsrc/old && bash bench/gpu/build_gpu.sh $o/build_old.log engine_gpu_bench)
for i in 1 2; do
  BATCHES=1,2,4 bash bench/gpu/decode_env_ab.sh $o/head$i "-" "DELTASERVE_MOE_GATE_UP_TRIGGER=issued"
  (cd .devsrc/old && BATCHES=1,2,4 bash bench/gpu/decode_env_ab.sh $o/old$i "-" "DELTASERVE_MOE_GATE_UP_TRIGGER=issued")
done
timeout 150 build/gpu/engine/cuda/engine_cuda_test >$o/engine_tests.log 2>&1
echo "engine_cuda_test rc=$? $(grep -E '^\[  (PASSED|FAILED)' $o/engine_tests.log | tr '\n' ' ')"
timeout 200 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='MoeSmallBatch*:MoeDecodeLayer*:SkinnyGemm*:-*Timing:*Bandwidth*' >$o/moe_tests.log 2>&1
echo "MoE + SkinnyGemm cases rc=$? $(grep -E '^\[  (PASSED|FAILED)' $o/moe_tests.log | tr '\n' ' ')"
