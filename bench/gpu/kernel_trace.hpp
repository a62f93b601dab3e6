// Kernel timeline of a stretch of GPU work through CUPTI's activity API (bench-only): the start and end of every
// kernel as the GPU ran it, graph replays included, so that the overlap of programmatic dependent launches shows.
// engine_gpu_bench --trace-step prints one decode step's timeline with it. Built without CUPTI, start() fails.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deltaserve::bench {

struct KernelRecord {
  std::string name;             // as CUPTI reports it (mangled for C++ kernels)
  uint64_t start = 0, end = 0;  // ns, GPU timestamps
  int grid = 0, block = 0;      // x * y * z of each
};

// Starts recording kernels (every context of the process); returns an error message, or "" on success.
std::string kernel_trace_start();
// Flushes and stops recording; the kernels recorded since kernel_trace_start, in start order.
std::vector<KernelRecord> kernel_trace_stop();

// A short name: the function name of a demangled or mangled kernel symbol without namespaces, template arguments
// and parameters (`skinny_gemm_v2_kernel`), or the name unchanged when it cannot be parsed.
std::string short_kernel_name(const std::string& name);

// A timeline summed per short kernel name: each kernel adds end - max(end of every kernel before it), clamped at 0,
// so the groups' adds sum to the span (first start to last end).
struct KernelGroup {
  std::string name;
  int count = 0;
  double duration_us = 0.0, adds_us = 0.0;
};
struct KernelTimelineSummary {
  double span_us = 0.0;
  size_t kernels = 0;
  std::vector<KernelGroup> groups;  // largest summed adds first (equal adds: by name)
};
KernelTimelineSummary summarize_kernel_timeline(const std::vector<KernelRecord>& kernels);

// The report of a timeline: every kernel in start order (start from the first kernel's start, duration, the time
// it adds to the span: end - max(end of every kernel before it), clamped at 0; so the adds sum to the span), then per
// short name the count, the summed durations and the summed adds, largest first.
std::string kernel_timeline_report(const std::vector<KernelRecord>& kernels);

}  // namespace deltaserve::bench
