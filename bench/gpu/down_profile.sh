#!/usr/bin/env bash
# GPU machine only, from the repo root: where launch 3 of the small-batch MoE layer (pipeline_down_kernel, 144 CTAs
# of 16 output columns at hidden 2304) spends its time at T = 1: it streams its 42 MB at ~0.6 of the copy bandwidth
# in the 48B step (~15.5 us a layer against ~10 of bytes), and neither splitting the tiles over two CTAs nor an even
# share of the (tile, expert) list per CTA (branch moe-down-balance) made it faster. The first down launch of
# LayerKimi48B runs at T = 1 with the Kimi-Linear-48B shapes. About 2 minutes.
#   bench/gpu/down_profile.sh OUTDIR
exec bash bench/gpu/kernel_profile.sh "${1:?usage: down_profile.sh OUTDIR}" pipeline_down_kernel \
  MoeSmallBatch.LayerKimi48B down
