// CUPTI activity records of kernels (kernel_trace.hpp).
#include "bench/gpu/kernel_trace.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

#ifdef DELTASERVE_HAVE_CUPTI
#include <cupti.h>
#endif

namespace deltaserve::bench {
namespace {

std::mutex g_mutex;
std::vector<KernelRecord> g_records;

#ifdef DELTASERVE_HAVE_CUPTI
constexpr size_t kBufferBytes = size_t{8} << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext /*context*/, uint32_t /*stream*/, uint8_t* buffer, size_t /*size*/,
                               size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    g_records.push_back({kernel->name != nullptr ? kernel->name : "?", kernel->start, kernel->end,
                         kernel->gridX * kernel->gridY * kernel->gridZ,
                         kernel->blockX * kernel->blockY * kernel->blockZ});
  }
  std::free(buffer);
}

std::string cupti_error(const char* what, CUptiResult result) {
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  return std::string(what) + ": " + (text != nullptr ? text : "unknown CUPTI error");
}
#endif

}  // namespace

std::string kernel_trace_start() {
#ifdef DELTASERVE_HAVE_CUPTI
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_records.clear();
  }
  static const CUptiResult registered = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  if (registered != CUPTI_SUCCESS) return cupti_error("cuptiActivityRegisterCallbacks", registered);
  if (const CUptiResult r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL); r != CUPTI_SUCCESS) {
    return cupti_error("cuptiActivityEnable", r);
  }
  return "";
#else
  return "engine_gpu_bench was built without CUPTI (CUDA::cupti not found)";
#endif
}

std::vector<KernelRecord> kernel_trace_stop() {
#ifdef DELTASERVE_HAVE_CUPTI
  cuptiActivityFlushAll(1);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityFlushAll(1);
#endif
  std::vector<KernelRecord> records;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    records.swap(g_records);
  }
  std::sort(records.begin(), records.end(),
            [](const KernelRecord& a, const KernelRecord& b) { return a.start < b.start; });
  return records;
}

std::string short_kernel_name(const std::string& name) {
  if (name.rfind("_Z", 0) == 0) {
    // Itanium mangling: _Z [N (<len><id>)+ E | <len><id>] ...; the last <len><id> before E (or the first one) is the
    // function, template arguments (I...E) skipped.
    size_t i = 2;
    const bool nested = i < name.size() && name[i] == 'N';
    if (nested) ++i;
    std::string last;
    while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) {
      size_t length = 0;
      while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) {
        length = length * 10 + static_cast<size_t>(name[i] - '0');
        ++i;
      }
      if (i + length > name.size()) break;
      last = name.substr(i, length);
      i += length;
      if (!nested) break;
      if (i < name.size() && name[i] == 'I') break;  // template arguments of the function: done
    }
    // Anonymous namespaces come out as _GLOBAL__N_1 or _GLOBAL__N__<hash>: never the function.
    if (!last.empty() && last.rfind("_GLOBAL__N", 0) != 0) return last;
    return name;
  }
  std::string s = name;
  if (const size_t paren = s.find('('); paren != std::string::npos) s.resize(paren);
  int depth = 0;
  std::string flat;
  for (const char c : s) {
    if (c == '<') ++depth;
    if (depth == 0) flat += c;
    if (c == '>') --depth;
  }
  if (const size_t colon = flat.rfind("::"); colon != std::string::npos) flat = flat.substr(colon + 2);
  if (const size_t space = flat.rfind(' '); space != std::string::npos) flat = flat.substr(space + 1);
  return flat.empty() ? name : flat;
}

namespace {

// What each kernel adds to the span (end - max(end of every kernel before it), clamped at 0), in us; the sum is the
// span.
std::vector<double> kernel_adds_us(const std::vector<KernelRecord>& kernels) {
  std::vector<double> adds;
  adds.reserve(kernels.size());
  uint64_t reach = kernels.empty() ? 0 : kernels.front().start;  // the latest end so far
  for (const KernelRecord& k : kernels) {
    adds.push_back(k.end > reach ? (k.end - reach) / 1e3 : 0.0);
    reach = std::max(reach, k.end);
  }
  return adds;
}

}  // namespace

KernelTimelineSummary summarize_kernel_timeline(const std::vector<KernelRecord>& kernels) {
  KernelTimelineSummary summary;
  summary.kernels = kernels.size();
  const std::vector<double> adds = kernel_adds_us(kernels);
  std::map<std::string, KernelGroup> groups;
  uint64_t end = 0;  // the latest end
  for (size_t i = 0; i < kernels.size(); ++i) {
    const KernelRecord& k = kernels[i];
    const std::string name = short_kernel_name(k.name);
    KernelGroup& g = groups[name];
    g.name = name;
    ++g.count;
    g.duration_us += (k.end - k.start) / 1e3;
    g.adds_us += adds[i];
    end = std::max(end, k.end);
  }
  if (!kernels.empty()) summary.span_us = (end - kernels.front().start) / 1e3;
  for (auto& [name, g] : groups) summary.groups.push_back(std::move(g));
  std::stable_sort(summary.groups.begin(), summary.groups.end(),
                   [](const KernelGroup& a, const KernelGroup& b) { return a.adds_us > b.adds_us; });
  return summary;
}

std::string kernel_timeline_report(const std::vector<KernelRecord>& kernels) {
  std::string out;
  if (kernels.empty()) return "no kernels recorded\n";
  const uint64_t t0 = kernels.front().start;
  const std::vector<double> adds = kernel_adds_us(kernels);
  char line[512];
  std::snprintf(line, sizeof(line), "%5s %10s %9s %9s %7s  %s\n", "#", "start_us", "dur_us", "adds_us", "grid",
                "kernel");
  out += line;
  for (size_t i = 0; i < kernels.size(); ++i) {
    const KernelRecord& k = kernels[i];
    const double start_us = (k.start - t0) / 1e3, duration_us = (k.end - k.start) / 1e3;
    std::snprintf(line, sizeof(line), "%5zu %10.2f %9.2f %9.2f %7d  %s\n", i, start_us, duration_us, adds[i], k.grid,
                  short_kernel_name(k.name).c_str());
    out += line;
  }
  const KernelTimelineSummary summary = summarize_kernel_timeline(kernels);
  std::snprintf(line, sizeof(line), "span %.2f us, %zu kernels; by kernel (count, summed duration, summed adds):\n",
                summary.span_us, summary.kernels);
  out += line;
  for (const KernelGroup& g : summary.groups) {
    std::snprintf(line, sizeof(line), "  %-48s %4d %10.2f %10.2f (%4.1f %%)\n", g.name.c_str(), g.count, g.duration_us,
                  g.adds_us, summary.span_us > 0 ? 100.0 * g.adds_us / summary.span_us : 0.0);
    out += line;
  }
  return out;
}

}  // namespace deltaserve::bench
