// Host-side validation of mla_decode and mla_prefill (every bad input rejected with InvalidArgument before anything
// is launched; no GPU work) and the split / head-group / workspace sizing they share, ctest label gpu.
#include <cmath>
#include <cstdint>
#include <string>

#include <cublas_v2.h>

#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"
#include "kernels/cuda/tests/mla_test_util.hpp"

namespace deltaserve::kernels::cuda::test {
namespace {

MlaAttentionParams valid_attention_params() {
  MlaAttentionParams p;
  p.num_heads = 32;
  p.kv_lora_rank = 512;
  p.qk_nope = 128;
  p.qk_rope = 64;
  p.v_head = 128;
  p.softmax_scale = 0.07f;
  p.pool = MlaPagePool{fake_device<__nv_bfloat16>(), 10, 2, 64, 576, 576};
  p.layer = 1;
  p.num_seqs = 2;
  p.num_tokens = 2;
  p.cu_q = fake_device<int32_t>();
  p.context_lens = fake_device<int32_t>();
  p.block_tables = fake_device<int32_t>();
  p.max_pages_per_seq = 4;
  p.max_context = 256;
  p.q = fake_device<__nv_bfloat16>();
  p.q_stride = 32 * 192;
  p.kv_b = fake_device<__nv_bfloat16>();
  p.out = fake_device<float>();
  p.workspace = fake_device<void>();
  p.workspace_bytes = mla_attention_workspace_bytes(32, 512, 64, 2, 256);
  return p;
}

TEST(MlaAttentionValidation, RejectsBadHostInputs) {
  struct Bad {
    const char* what;
    void (*edit)(MlaAttentionParams&);
  };
  const Bad cases[] = {
      {"num_heads 0", [](MlaAttentionParams& p) { p.num_heads = 0; }},
      {"num_heads 129", [](MlaAttentionParams& p) { p.num_heads = 129; }},
      {"kv_lora 20", [](MlaAttentionParams& p) { p.kv_lora_rank = 20; }},
      {"kv_lora 520", [](MlaAttentionParams& p) { p.kv_lora_rank = 520; }},
      {"rope 12", [](MlaAttentionParams& p) { p.qk_rope = 12; }},
      {"rope 72", [](MlaAttentionParams& p) { p.qk_rope = 72; }},
      {"nope 0", [](MlaAttentionParams& p) { p.qk_nope = 0; }},
      {"nope 193", [](MlaAttentionParams& p) { p.qk_nope = 193; }},
      {"v_head 257", [](MlaAttentionParams& p) { p.v_head = 257; }},
      {"scale nan", [](MlaAttentionParams& p) { p.softmax_scale = NAN; }},
      {"pages null", [](MlaAttentionParams& p) { p.pool.pages = nullptr; }},
      {"pages misaligned", [](MlaAttentionParams& p) { p.pool.pages = fake_device<__nv_bfloat16>(4098); }},
      {"num_pages 0", [](MlaAttentionParams& p) { p.pool.num_pages = 0; }},
      {"layer out of range", [](MlaAttentionParams& p) { p.layer = 2; }},
      {"page_size 24", [](MlaAttentionParams& p) { p.pool.page_size = 24; }},
      {"page_size 272", [](MlaAttentionParams& p) { p.pool.page_size = 272; }},
      {"row_stride < width", [](MlaAttentionParams& p) { p.pool.row_stride = 568; }},
      {"row_stride not multiple of 8", [](MlaAttentionParams& p) { p.pool.row_stride = 580; }},
      {"width mismatch", [](MlaAttentionParams& p) { p.pool.width = 512; }},
      {"num_tokens negative", [](MlaAttentionParams& p) { p.num_tokens = -1; }},
      {"tokens without sequences", [](MlaAttentionParams& p) { p.num_seqs = 0; }},
      {"max_pages 0", [](MlaAttentionParams& p) { p.max_pages_per_seq = 0; }},
      {"max_context above table", [](MlaAttentionParams& p) { p.max_context = 257; }},
      {"max_context 0 with tokens", [](MlaAttentionParams& p) { p.max_context = 0; }},
      {"q_stride small", [](MlaAttentionParams& p) { p.q_stride = 32 * 192 - 1; }},
      {"cu_q null", [](MlaAttentionParams& p) { p.cu_q = nullptr; }},
      {"q null", [](MlaAttentionParams& p) { p.q = nullptr; }},
      {"out null", [](MlaAttentionParams& p) { p.out = nullptr; }},
      {"workspace small", [](MlaAttentionParams& p) { p.workspace_bytes -= 1; }},
      {"workspace misaligned", [](MlaAttentionParams& p) { p.workspace = fake_device<void>(4100); }},
      {"kv_b misaligned", [](MlaAttentionParams& p) { p.kv_b = fake_device<__nv_bfloat16>(4104); }},
  };
  for (const Bad& bad : cases) {
    MlaAttentionParams p = valid_attention_params();
    bad.edit(p);
    const Status decode = mla_decode(p, nullptr);
    const Status prefill = mla_prefill(p, nullptr);
    EXPECT_EQ(decode.code(), StatusCode::kInvalidArgument) << bad.what << ": " << decode.to_string();
    EXPECT_EQ(prefill.code(), StatusCode::kInvalidArgument) << bad.what << ": " << prefill.to_string();
  }
  // out_bf16: enough for mla_decode (out may then be null; checked up to the workspace size here), rejected by
  // mla_prefill in every form.
  {
    MlaAttentionParams p = valid_attention_params();
    p.out_bf16 = fake_device<__nv_bfloat16>(8192);
    p.out = nullptr;
    p.workspace_bytes -= 1;  // stops mla_decode's validation before any launch
    const Status decode = mla_decode(p, nullptr);
    EXPECT_EQ(decode.code(), StatusCode::kInvalidArgument) << decode.to_string();
    EXPECT_NE(decode.to_string().find("workspace_bytes"), std::string::npos) << decode.to_string();
    for (MlaPrefillForm form : {MlaPrefillForm::kAuto, MlaPrefillForm::kAbsorbed, MlaPrefillForm::kNaive}) {
      p.prefill_form = form;
      const Status prefill = mla_prefill(p, nullptr);
      EXPECT_EQ(prefill.code(), StatusCode::kInvalidArgument) << prefill.to_string();
      EXPECT_NE(prefill.to_string().find("out_bf16"), std::string::npos) << prefill.to_string();
    }
  }
  // The naive form, forced: rejected (no launch) without its host tables or cuBLAS handle, with host tables that
  // do not match num_tokens or the block table, with head dims it does not support, or a workspace below one block.
  {
    static const int32_t cu[3] = {0, 1, 2}, contexts[2] = {100, 256};
    static const int32_t bad_cu[3] = {0, 1, 3}, bad_contexts[2] = {100, 257};
    const Bad naive_cases[] = {
        {"naive without host tables",
         [](MlaAttentionParams& p) {
           p.host_cu_q = nullptr;
           p.host_context_lens = nullptr;
         }},
        {"naive without cuBLAS", [](MlaAttentionParams& p) { p.cublas = nullptr; }},
        {"naive host cu_q[N] != num_tokens", [](MlaAttentionParams& p) { p.host_cu_q = bad_cu; }},
        {"naive context past the table", [](MlaAttentionParams& p) { p.host_context_lens = bad_contexts; }},
        {"naive nope 12",
         [](MlaAttentionParams& p) {
           p.qk_nope = 12;
           p.q_stride = 32 * 76;
         }},
        {"naive v_head 136", [](MlaAttentionParams& p) { p.v_head = 136; }},
        {"naive workspace small",
         [](MlaAttentionParams& p) {
           p.workspace_bytes = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 2, 64) - 1024;
         }},
    };
    for (const Bad& bad : naive_cases) {
      MlaAttentionParams p = valid_attention_params();
      p.prefill_form = MlaPrefillForm::kNaive;
      p.host_cu_q = cu;
      p.host_context_lens = contexts;
      p.cublas = reinterpret_cast<cublasHandle_t>(uintptr_t{4096});  // never used: rejected before any launch
      p.workspace_bytes = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 2, 256);
      bad.edit(p);
      const Status prefill = mla_prefill(p, nullptr);
      EXPECT_EQ(prefill.code(), StatusCode::kInvalidArgument) << bad.what << ": " << prefill.to_string();
    }
    EXPECT_TRUE(mla_prefill_naive_supported(128, 64, 128));
    EXPECT_TRUE(mla_prefill_naive_supported(16, 8, 16));
    EXPECT_FALSE(mla_prefill_naive_supported(128, 72, 128));
    EXPECT_FALSE(mla_prefill_naive_supported(128, 64, 256));
    EXPECT_FALSE(mla_prefill_naive_supported(20, 8, 16));
    // Block sizes: one 64-row granule minimum; Kimi-48B costs 17,536 bytes per row plus 8 bytes per (token, head).
    const size_t b64 = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 8192, 64);
    const size_t b4096 = mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 8192, 4096);
    EXPECT_EQ(b4096 - b64, size_t{4032} * 17536);
    EXPECT_EQ(mla_prefill_workspace_bytes(32, 512, 128, 64, 128, 8192, 1), b64);
    EXPECT_GE(b64, size_t{8192} * 32 * 8 + 64 * 17536);
  }
  // Decode takes at most one query token per sequence; prefill takes any.
  MlaAttentionParams p = valid_attention_params();
  p.num_seqs = 1;
  EXPECT_EQ(mla_decode(p, nullptr).code(), StatusCode::kInvalidArgument);
  // No query tokens: nothing to launch, device pointers may be null.
  p = valid_attention_params();
  p.num_tokens = 0;
  p.q = nullptr;
  p.out = nullptr;
  p.workspace = nullptr;
  p.workspace_bytes = 0;
  EXPECT_TRUE(mla_decode(p, nullptr).is_ok());
  EXPECT_TRUE(mla_prefill(p, nullptr).is_ok());
}

TEST(MlaAttentionValidation, WorkspaceCoversEverySmallerBatch) {
  for (int max_context : {1, 512, 513, 4097, 131072}) {
    const size_t bytes = mla_attention_workspace_bytes(32, 512, 64, 300, max_context);
    for (int64_t t = 1; t <= 300; ++t) {
      const int splits = mla_num_splits(t, max_context);
      ASSERT_GE(splits, 1);
      ASSERT_LE(splits, kMlaMaxSplits);
      const size_t need = static_cast<size_t>(t) * 32 * (576 * 4 + static_cast<size_t>(splits) * (512 * 4 + 8));
      ASSERT_GE(bytes, need) << "t=" << t << " max_context=" << max_context;
    }
  }
  EXPECT_EQ(mla_num_splits(1, 100), 1);
  EXPECT_GT(mla_num_splits(1, 100000), 1);
  {  // >= 128 rows per split, about 132 CTAs
    EXPECT_EQ(mla_num_splits(1, 4096), 32);
    EXPECT_EQ(mla_num_splits(8, 4096), 16);
    EXPECT_EQ(mla_num_splits(32, 4096), 4);
    EXPECT_EQ(mla_num_splits(64, 4096), 2);
    EXPECT_EQ(mla_num_splits(256, 4096), 1);
    EXPECT_EQ(mla_num_splits(1, 512), 4);
    EXPECT_EQ(mla_num_splits(1, 32768), 64);
    EXPECT_EQ(mla_num_splits(8, 32768), 16);
    // Heads per CTA of the attention kernels: smaller groups only where the CTAs would not fill the SMs.
    EXPECT_EQ(mla_decode_head_group(1, 32, 4096), 8);
    EXPECT_EQ(mla_decode_head_group(2, 32, 4096), 16);
    EXPECT_EQ(mla_decode_head_group(4, 32, 4096), 32);
    EXPECT_EQ(mla_decode_head_group(256, 32, 4096), 32);
    EXPECT_EQ(mla_decode_head_group(1, 32, 32768), 16);
    EXPECT_EQ(mla_decode_head_group(1, 2, 4096), 2);
    EXPECT_EQ(mla_decode_head_group(1, 96, 4096), 16);
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cuda::test
