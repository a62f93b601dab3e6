// The CPU side of the kernel tracer (kernel_trace.hpp): short names of mangled and demangled kernel symbols and the
// timeline report's arithmetic (what each kernel adds to the span). Built without CUPTI; start() must say so then.
#include "bench/gpu/kernel_trace.hpp"

#include <gtest/gtest.h>

namespace deltaserve::bench {
namespace {

TEST(KernelTrace, ShortNames) {
  // A kernel in an anonymous namespace of a nested namespace.
  EXPECT_EQ(short_kernel_name("_ZN10deltaserve7kernels4cuda22moe_small_batch_detail60_GLOBAL__N__db2efb2b_27_moe_small_"
                              "batch_pipeline_cu_3ea6581521pipeline_fused_kernelENS3_12PipelineArgsE"),
            "pipeline_fused_kernel");
  // A template kernel: the arguments after the name are not the name.
  EXPECT_EQ(
      short_kernel_name("_ZN10deltaserve7kernels4cuda52_GLOBAL__N__e826260b_19_small_batch_gemm_cu_fde2b91721skinny_"
                        "gemm_v2_kernelI13__nv_bfloat16Li2ELi1ELi9ELb1EEEvNS2_16SkinnyGemmArgsV2E"),
      "skinny_gemm_v2_kernel");
  EXPECT_EQ(short_kernel_name("_Z13stream_kernelPKclN12_GLOBAL__N_17PatternEPj"), "stream_kernel");
  EXPECT_EQ(short_kernel_name("void deltaserve::kernels::cuda::foo<int, 3>(int*)"), "foo");
  // Library kernels come unmangled.
  EXPECT_EQ(short_kernel_name("sm90_xmma_gemm_bf16bf16_bf16f32"), "sm90_xmma_gemm_bf16bf16_bf16f32");
  // Unparseable mangling comes back whole.
  EXPECT_EQ(short_kernel_name("_Z99x"), "_Z99x");
}

TEST(KernelTrace, ReportAddsSumToTheSpan) {
  // a: 0-4 us; b overlaps it, 3-8 (adds 4); a again after a 0.5 us gap, 8.5-9 (adds the gap and itself: 1).
  const std::vector<KernelRecord> kernels = {
      {"_Z1av", 1000, 5000, 1, 1}, {"_Z1bv", 4000, 9000, 2, 1}, {"_Z1av", 9500, 10000, 1, 1}};
  const std::string report = kernel_timeline_report(kernels);
  EXPECT_NE(report.find("span 9.00 us, 3 kernels"), std::string::npos) << report;
  EXPECT_NE(report.find("    1       3.00      5.00      4.00       2  b\n"), std::string::npos) << report;
  EXPECT_NE(report.find("    2       8.50      0.50      1.00       1  a\n"), std::string::npos) << report;
  // By name, largest adds first: a (4 + 1 = 5 of 9 us), then b (4).
  const size_t a = report.find("  a   "), b = report.find("  b   ");
  ASSERT_NE(a, std::string::npos) << report;
  ASSERT_NE(b, std::string::npos) << report;
  EXPECT_LT(a, b) << report;
  EXPECT_NE(report.find("2       4.50       5.00 (55.6 %)"), std::string::npos) << report;
  EXPECT_EQ(kernel_timeline_report({}), "no kernels recorded\n");
}

TEST(KernelTrace, SummaryGroupsByNameLargestAddsFirst) {
  // a: 0-4 us and 8.5-9 (adds 4 + 1); b: 3-8 (adds 4); c: 2-3, inside a (adds 0); d: 9-9.25 (adds 0.25).
  const std::vector<KernelRecord> kernels = {{"_Z1av", 1000, 5000, 1, 1},
                                             {"_Z1cv", 3000, 4000, 1, 1},
                                             {"_Z1bv", 4000, 9000, 2, 1},
                                             {"_Z1av", 9500, 10000, 1, 1},
                                             {"_Z1dv", 10000, 10250, 1, 1}};
  const KernelTimelineSummary s = summarize_kernel_timeline(kernels);
  EXPECT_DOUBLE_EQ(s.span_us, 9.25);
  EXPECT_EQ(s.kernels, 5u);
  ASSERT_EQ(s.groups.size(), 4u);
  const std::vector<std::string> order = {s.groups[0].name, s.groups[1].name, s.groups[2].name, s.groups[3].name};
  EXPECT_EQ(order, (std::vector<std::string>{"a", "b", "d", "c"}));
  EXPECT_EQ(s.groups[0].count, 2);
  EXPECT_DOUBLE_EQ(s.groups[0].duration_us, 4.5);
  EXPECT_DOUBLE_EQ(s.groups[0].adds_us, 5.0);
  EXPECT_DOUBLE_EQ(s.groups[3].duration_us, 1.0);
  EXPECT_DOUBLE_EQ(s.groups[3].adds_us, 0.0);
  double adds = 0.0;
  for (const KernelGroup& g : s.groups) adds += g.adds_us;
  EXPECT_DOUBLE_EQ(adds, s.span_us);
  const KernelTimelineSummary empty = summarize_kernel_timeline({});
  EXPECT_EQ(empty.kernels, 0u);
  EXPECT_TRUE(empty.groups.empty());
}

#ifndef DELTASERVE_HAVE_CUPTI
TEST(KernelTrace, WithoutCuptiStartSaysSo) {
  EXPECT_NE(kernel_trace_start().find("without CUPTI"), std::string::npos);
  EXPECT_TRUE(kernel_trace_stop().empty());
}
#endif

}  // namespace
}  // namespace deltaserve::bench
