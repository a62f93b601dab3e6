// Hopper (sm_90a) grouped expert FFN for prefill: the contract of moe_expert_ffn_grouped (moe.hpp) on wgmma tensor
// cores fed by TMA (kernel and design notes: ffn_wgmma.cu), and the host-side pieces moe_expert_ffn_grouped and it
// share.
#pragma once

#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda {

// Which of the two expert GEMMs to launch. kGateUp and kDown exist for timing one GEMM alone; kDown reads the
// `activated` rows a previous kGateUp (or kBoth) call wrote.
enum class MoeWgmmaStage { kBoth, kGateUp, kDown };

// Same results and contract as moe_expert_ffn_grouped: activated[r, :] = bf16(glu(x_sorted[r, :] · gate_up[e]^T))
// (fp32 accumulation and glu math, rounded once), y_sorted[r, :] = activated[r, :] · down[e]^T in fp32, for every
// row r < offsets[E] of expert e; rows >= offsets[E] are not written. The tile schedule is derived on the device
// from expert_offsets: no host sync, no allocation, no workspace, graph-capturable (two kernel launches whose
// tensor maps travel as kernel parameters). Requirements: width and intermediate multiples of 8 (16-byte TMA row
// strides; a k or column tail short of the 64 / 128 / 256 tiles is zero-filled by TMA and never stored); gate_up,
// down, x_sorted, activated 16-byte aligned, y_sorted 8-byte aligned; E * 2I and E * width below 2^31 (TMA
// coordinates). Returns kInvalidArgument for inputs outside that contract and kUnimplemented when the current device
// is not compute capability 9.x or the driver lacks cuTensorMapEncodeTiled, each before anything is launched. R == 0
// launches nothing.
Status moe_expert_ffn_wgmma(const MoeFfnParams& params, cudaStream_t stream,
                            MoeWgmmaStage stage = MoeWgmmaStage::kBoth);

namespace detail {
// moe_expert_ffn_grouped without the hand-off to moe_expert_ffn_wgmma: the mma.sync kernels at the row tile of
// moe_grouped_row_tile, whatever R (what runs whenever the wgmma kernels decline). Same contract and checks.
Status moe_expert_ffn_grouped_mma_sync(const MoeFfnParams& params, cudaStream_t stream);

// Host-side checks of MoeFfnParams that moe_expert_ffn_grouped and moe_expert_ffn_wgmma share (ffn_grouped.cu);
// each returns kInvalidArgument with `who` (the launcher) at the start of the message.
// num_experts in [1, kMoeMaxExperts]; width and intermediate positive multiples of 8, at most 2^30.
Status validate_moe_ffn_sizes(const MoeFfnParams& params, const char* who);
// SiTU betas positive when glu is kSitu.
Status validate_moe_ffn_glu(const MoeFfnParams& params, const char* who);
// Weights and row buffers non-null; gate_up, down, x_sorted, activated 16-byte aligned, y_sorted 8-byte.
Status validate_moe_ffn_buffers(const MoeFfnParams& params, const char* who);
}  // namespace detail

}  // namespace deltaserve::kernels::cuda
