// CUDA-graph and timing helpers of the GPU tests: the work one launcher enqueues, captured once in a graph, then
// replayed (the capture checks of graph-capturable launchers) or timed over many replays with cudaEvents (the
// launch overhead a served decode step sees); eager calls timed with cudaEvents.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/status.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

// Captures `launch(stream)` (returns Status) on `stream` in capture mode `mode` and instantiates it into *exec
// (the caller destroys it). Fatal failures (capture, a failed Status) return early: wrap the call in
// ASSERT_NO_FATAL_FAILURE, as for the helpers below.
template <class Launch>
void capture_graph(cudaStream_t stream, cudaStreamCaptureMode mode, Launch launch, cudaGraphExec_t* exec) {
  cudaGraph_t graph = nullptr;
  DS_CUDA_OK(cudaStreamBeginCapture(stream, mode));
  const Status status = launch(stream);
  DS_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  DS_CUDA_OK(cudaGraphInstantiate(exec, graph, 0));
  cudaGraphDestroy(graph);  // the executable graph does not need it
}

// `launch(stream)` captured once, replayed `replays` times on `stream`, then the stream synchronized.
template <class Launch>
void replay_captured(cudaStream_t stream, cudaStreamCaptureMode mode, int replays, Launch launch) {
  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(capture_graph(stream, mode, launch, &exec));
  for (int i = 0; i < replays; ++i) DS_CUDA_OK(cudaGraphLaunch(exec, stream));
  DS_CUDA_OK(cudaStreamSynchronize(stream));
  DS_CUDA_OK(cudaGraphExecDestroy(exec));
}

// `launch(stream)` captured once, replayed `warmup` times, then `replays` times between two events:
// *ms_per_replay gets the mean.
template <class Launch>
void time_graph_replays(cudaStream_t stream, cudaStreamCaptureMode mode, int warmup, int replays, Launch launch,
                        double* ms_per_replay) {
  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(capture_graph(stream, mode, launch, &exec));
  for (int i = 0; i < warmup; ++i) DS_CUDA_OK(cudaGraphLaunch(exec, stream));
  cudaEvent_t start = nullptr, stop = nullptr;
  DS_CUDA_OK(cudaEventCreate(&start));
  DS_CUDA_OK(cudaEventCreate(&stop));
  DS_CUDA_OK(cudaEventRecord(start, stream));
  for (int i = 0; i < replays; ++i) DS_CUDA_OK(cudaGraphLaunch(exec, stream));
  DS_CUDA_OK(cudaEventRecord(stop, stream));
  DS_CUDA_OK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  DS_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  *ms_per_replay = static_cast<double>(ms) / replays;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
}

// `calls` eager launch(stream) calls back to back between two events (stopping at the first failed Status, which
// is asserted ok): *ms gets the total.
template <class Launch>
void time_eager_calls(cudaStream_t stream, int calls, Launch launch, float* ms) {
  cudaEvent_t start = nullptr, stop = nullptr;
  DS_CUDA_OK(cudaEventCreate(&start));
  DS_CUDA_OK(cudaEventCreate(&stop));
  Status status = Status::ok();
  DS_CUDA_OK(cudaEventRecord(start, stream));
  for (int i = 0; i < calls && status.is_ok(); ++i) status = launch(stream);
  DS_CUDA_OK(cudaEventRecord(stop, stream));
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  DS_CUDA_OK(cudaEventSynchronize(stop));
  DS_CUDA_OK(cudaGetLastError());
  DS_CUDA_OK(cudaEventElapsedTime(ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace deltaserve::kernels::cuda::test
