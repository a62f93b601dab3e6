#!/usr/bin/env bash
# GPU machine only, from the repo root: where launch 1 of the small-batch MoE layer (small_batch_router_kernel)
# spends its ~10 us at T = 1. Its last CTA routes and builds the plan alone for most of that time (phases of a few
# hundred instructions that take ~1 us each, bench/gpu/engine_notes.md), so Nsight Compute's warp-state samples of
# the kernel are mostly that CTA's stalls. The first router launch of LayerKimi48B runs at T = 1 with the
# Kimi-Linear-48B shapes (E = 256, k = 8). About 2 minutes.
#   bench/gpu/router_profile.sh OUTDIR
exec bash bench/gpu/kernel_profile.sh "${1:?usage: router_profile.sh OUTDIR}" small_batch_router \
  MoeSmallBatch.LayerKimi48B router
